"""How a configuration field declares its command-line flag (`flag`), the parsers flags share (sizes, memory
fractions), and ConfigError, which every configuration refusal raises."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A config.json (or preset override) that jaxserve cannot run; the message names the field and value."""


_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(text: str) -> int:
    """'80GiB', '141GB', '24e9' -> bytes."""
    number = text.strip().rstrip("bBiIkKmMgGtT")
    unit = text.strip()[len(number) :].upper()
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise ConfigError(f"{text!r}: not a size; write e.g. 80GiB, 141GB or 24e9") from None
    if value <= 0:
        raise ConfigError(f"{text!r}: must be positive")
    return int(value)


def check_memory_fraction(value: float, name: str | None) -> float:
    """`value` if it is a share of a device's memory, in (0, 1]; else ConfigError naming `name` (a field or a
    variable; None: a flag's value, which argparse names)."""
    if not 0 < value <= 1:
        raise ConfigError(f"{'' if name is None else name + '='}{value!r}: must be a number in (0, 1]")
    return value


def parse_fraction(text: str) -> float:
    """'0.9' -> 0.9, refused outside (0, 1] (--gpu-memory-utilization)."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{text!r}: not a number; write e.g. 0.9") from None
    return check_memory_fraction(value, None)


@dataclass(frozen=True)
class Flag:
    """A config field's command-line flag (named after the field: max_num_seqs is --max-num-seqs): what parses a
    value, its help, and optionally its choices and metavar (default: N for integers, SECONDS for floats)."""

    type: Callable[[str], Any]
    help: str
    choices: Collection[str] | None = None  # a tuple, or a plug-in kind's Registry (config.registry)
    metavar: str | None = None


def flag(
    type: Callable[[str], Any], help: str, choices: Collection[str] | None = None, metavar: str | None = None
) -> dict[str, Flag]:
    """A dataclass field's metadata declaring its flag: `jaxserve.cli` gives every such field one."""
    return {"flag": Flag(type, help, choices, metavar)}
