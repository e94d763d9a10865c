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


# What the runner must never take (docs/architecture.md, "the step batch"): a request, or a plan that holds them.
RUNNER_NEVER_IMPORTS = (
    "jaxserve.request.record",
    "jaxserve.request.Request",
    "jaxserve.request.step.StepPlan",
    "jaxserve.request.step.StepRow",
)


def writes_to_arguments(source: str) -> list[str]:
    """Each assignment, in `source`, to an attribute or an item of an object a function received (its parameters
    but self and cls), reached through any chain of attributes and items: `arg.x = ...`, `arg.x[i] += ...`."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        arguments = function.args
        received = {
            a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs if a.arg not in ("self", "cls")
        }
        for node in ast.walk(function):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign | ast.AnnAssign)
                else []
            )
            for target in targets:
                for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                    root = element
                    while isinstance(root, ast.Attribute | ast.Subscript):
                        root = root.value
                    if element is not root and isinstance(root, ast.Name) and root.id in received:
                        found.append(f"line {node.lineno}: {ast.unparse(element)}")
    return found


def test_the_runner_takes_step_batches_and_never_changes_what_it_receives():
    """The runner imports no request record and no plan of them, and writes no attribute or item of an object it
    was handed (a step batch's arrays are read-only besides)."""
    found = []
    for path in sorted((REPO / "jaxserve" / "runner").rglob("*.py")):
        source = path.read_text()
        found += [f"{path.name} imports {name}" for name in imported_modules(source) if name in RUNNER_NEVER_IMPORTS]
        found += [f"{path.name} {write}" for write in writes_to_arguments(source)]
    assert found == []


def test_the_write_scan_sees_writes_through_attributes_and_items():
    source = (
        "def f(self, batch, rows):\n    batch.x = 1\n    rows.a[0] += 2\n    self.y = 3\n    local = rows\n"
        "    b, rows.c = 1, 2\n"
    )
    assert writes_to_arguments(source) == ["line 2: batch.x", "line 3: rows.a[0]", "line 6: rows.c"]
