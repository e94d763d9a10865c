"""The training text: the Python standard library's own sources (code, docstrings and comments), which ship with
every Python, split by file into a training and a held-out part."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Left out: the test suites (a third of the library, mostly repetitive assertions), GUI demos, vendored tools, and
# the codec tables (generated mappings, not text).
SKIPPED_FOLDERS = frozenset(
    {"site-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__", "lib2to3", "ensurepip", "encodings"}
)
HELD_OUT_EVERY = 20  # every 20th file (in sorted order) is held out
FILE_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Corpus:
    train: list[Path]
    held_out: list[Path]

    @staticmethod
    def text(files: list[Path]) -> str:
        return FILE_SEPARATOR.join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(root: Path | None = None) -> Corpus:
    """The library's `.py` files under `root` (this Python's standard library), sorted, split by file."""
    root = root or stdlib_root()
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not SKIPPED_FOLDERS.intersection(p.relative_to(root).parts[:-1]) and not p.name.startswith("config-")
    )
    if not files:
        raise FileNotFoundError(f"{root}: no Python sources (is this Python's standard library installed?)")
    held = [i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 for i in range(len(files))]
    return Corpus(train=[f for f, h in zip(files, held) if not h], held_out=[f for f, h in zip(files, held) if h])
