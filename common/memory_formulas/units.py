"""Parsing and formatting sizes: ``"80GB"``, ``"7B"``, bytes to GB for the planner's tables."""

from __future__ import annotations

import re

from common.errors import ConfigError

GB = 1e9  # decimal GB, as memory tables quote it (112 GB = 7e9 x 16 B)
GIB = 2**30


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")
_SIZE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | float | int) -> float:
    """``"80GB"`` -> 8e10, ``"80GiB"`` -> 80 x 2^30, ``"141e9"`` -> 1.41e11; a plain number is bytes."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(f"cannot read {text!r} as a memory size; write e.g. 80GB, 24GiB or 8e10")
    number, unit, binary = float(match.group(1)), match.group(2).lower(), match.group(3)
    if binary and unit:
        return number * _BINARY_UNITS[unit]
    return number * _SIZE_UNITS[unit]


def parse_count(text: str | float | int) -> int:
    """``"7e9"``, ``"7B"``, ``"125M"``, ``"7000000000"`` -> an integer parameter count."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return int(text)
    raw = str(text).strip().replace("_", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(raw[-1:].lower())
    try:
        value = float(raw[:-1]) * scale if scale else float(raw)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a parameter count; write e.g. 7e9 or 7B") from None
    if value < 1:
        raise ConfigError(f"parameter count must be >= 1, got {text!r}")
    return int(value)


def fmt_gb(nbytes: float | None, digits: int = 2) -> str:
    """Bytes as decimal GB (1e9), e.g. ``26.25 GB``; None as ``n/a``."""
    if nbytes is None:
        return "n/a"
    if nbytes == 0:
        return "0"
    if abs(nbytes) >= 1e9:
        return f"{nbytes / GB:.{digits}f} GB"
    if abs(nbytes) >= 1e6:
        return f"{nbytes / 1e6:.1f} MB"
    return f"{nbytes / 1e3:.1f} kB"
