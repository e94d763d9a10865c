"""ruff (lint and format) and mypy over the whole repository, configured in pyproject.toml: the README's test command
runs them, so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The package-dir mapping of pyproject.toml: these folders are installed as subpackages of `jaxserve`.
MAPPED = ("kernels", "checkpoints", "server", "cli")
# mypy's incremental cache, kept between runs as a .mypy_cache would be (it checks each module's file against it): a
# run with nothing changed takes under a second instead of about ten.
MYPY_CACHE = Path.home() / ".cache" / "jaxserve" / "mypy-tests"


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_ruff_lint_is_clean():
    result = run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = run("ruff", "format", "--check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean(tmp_path):
    """mypy cannot follow the package-dir mapping, so it reads a tree of links laid out as the installed package."""
    package = tmp_path / "jaxserve"
    package.mkdir()
    for entry in (REPO / "jaxserve").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for folder in MAPPED:
        (package / folder).symlink_to(REPO / folder)
    result = run(
        "mypy",
        "--config-file",
        str(REPO / "pyproject.toml"),
        "--cache-dir",
        str(MYPY_CACHE),
        "-p",
        "jaxserve",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
