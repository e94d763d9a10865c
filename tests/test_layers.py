"""The dependency direction (docs/architecture.md): each layer imports only the layers below it, under whatever
import name, lazily inside a function or not. The layers are the repository's folders."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# folder -> the installed package names it must never import (below it: what it may).
FORBIDDEN = {
    "kernels": ("jaxserve",),  # pure-JAX primitives: nothing of ours
    "jaxserve": ("jaxserve.server", "jaxserve.checkpoints", "jaxserve.cli"),  # the core
    # Checkpoints build the model's weights from files: the device runner is not theirs to reach.
    "checkpoints": ("jaxserve.server", "jaxserve.cli", "jaxserve.runner", "jaxserve.engine", "jaxserve.scheduler"),
    "server": ("jaxserve.checkpoints", "jaxserve.cli"),
    "training": ("jaxserve.server", "jaxserve.cli"),  # a tool beside the layers: the core and checkpoints only
    # Inside the core, the rooms along a request's way (text -> engine -> scheduler, runner -> model -> kernels, all
    # passing the records of jaxserve/request): none imports a room before it on the way.
    "jaxserve/engine": ("jaxserve.text",),
    # The host scheduler keeps its accounts on the host: nothing of the device model (KV page arithmetic is
    # jaxserve.paging's, shared).
    "jaxserve/scheduler": ("jaxserve.text", "jaxserve.engine", "jaxserve.runner", "jaxserve.model"),
    "jaxserve/runner": ("jaxserve.text", "jaxserve.engine", "jaxserve.scheduler"),
    "jaxserve/model": ("jaxserve.text", "jaxserve.engine", "jaxserve.scheduler", "jaxserve.runner", "jaxserve.request"),
    "jaxserve/request": ("jaxserve.text", "jaxserve.engine", "jaxserve.scheduler", "jaxserve.runner", "jaxserve.model"),
}
# The folders as the import system would also find them from the repository root.
TOP_LEVEL_ALIASES = {
    "server": "jaxserve.server",
    "checkpoints": "jaxserve.checkpoints",
    "cli": "jaxserve.cli",
    "kernels": "jaxserve.kernels",
}
NEVER_AT_RUN_TIME = ("torch", "transformers")
# `python -m jaxserve` runs the composition root; Python looks for a package's __main__.py in its own folder, so
# this one file of the core's folder is the cli layer's, and may import only that layer.
ENTRY_POINT = REPO / "jaxserve" / "__main__.py"


def imported_modules(source: str) -> list[str]:
    """Every module an `import`, `from ... import` or importlib.import_module("...") in `source` names."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.append(str(node.args[0].value))
    return names


def canonical(name: str) -> str:
    head, _, rest = name.partition(".")
    alias = TOP_LEVEL_ALIASES.get(head)
    return name if alias is None else alias + ("." + rest if rest else "")


def violations(folder: str) -> list[str]:
    found = []
    for path in sorted(p for p in (REPO / folder).rglob("*.py") if p != ENTRY_POINT):
        for name in map(canonical, imported_modules(path.read_text())):
            banned = FORBIDDEN[folder] + NEVER_AT_RUN_TIME
            if any(name == b or name.startswith(b + ".") for b in banned):
                found.append(f"{path.relative_to(REPO)} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_each_layer_imports_only_the_layers_below_it(folder):
    assert violations(folder) == []


def test_python_m_jaxserve_imports_only_the_cli():
    assert {canonical(n) for n in imported_modules(ENTRY_POINT.read_text())} == {
        "sys",
        "jaxserve.cli",
        "jaxserve.cli.main",
    }


def test_the_scan_sees_every_form_of_import():
    source = (
        "import server.app\nfrom checkpoints import load\nfrom jaxserve.server.routes import router\n"
        "def f():\n    import jaxserve.cli.main\n    importlib.import_module('jaxserve.checkpoints.load')\n"
    )
    names = {canonical(n) for n in imported_modules(source)}
    assert {
        "jaxserve.server.app",
        "jaxserve.checkpoints.load",
        "jaxserve.server.routes",
        "jaxserve.cli.main",
        "jaxserve.checkpoints",
    } <= names
