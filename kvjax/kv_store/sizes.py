"""Byte sizes as users write them in store URLs: `1048576`, `512MiB`, `2GiB`, `10GB`."""
from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"\s*(\d+)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """A non-negative byte count from an int or a string with an optional unit (decimal KB/MB/
    GB/TB, binary KiB/MiB/GiB/TiB, case-insensitive). Raises ValueError on anything else."""
    if isinstance(text, bool):
        raise ValueError(f"a byte size must be an int or a string like '512MiB', got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a byte size must be >= 0, got {text}")
        return text
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"a byte size must be an int or a string like '512MiB' or '2GB', got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]
