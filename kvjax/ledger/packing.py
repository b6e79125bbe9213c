"""`packer`: compiled `struct` packers of n native ints, one per (count, code).

`struct.pack(f"{n}i", *xs)` looks its format up in `struct`'s small cache on every call and
copies its arguments twice (the format joins them); a compiled `Struct(...).pack` takes them
once. For a 1,280-token prompt that is about 2.5 µs of the 10 µs its encoding costs, paid on
every admission and store. The cache is bounded: it is emptied when it reaches `_MAX` counts.
"""
from __future__ import annotations

import struct
from collections.abc import Callable

_MAX = 4096
_PACKERS: dict[tuple[int, str], Callable[..., bytes]] = {}


def packer(n: int, code: str = "i") -> Callable[..., bytes]:
    """`struct.Struct(f"{n}{code}").pack` (native sizes; `struct.error` for a value out of
    range)."""
    key = (n, code)
    p = _PACKERS.get(key)
    if p is None:
        if len(_PACKERS) >= _MAX:
            _PACKERS.clear()
        p = _PACKERS[key] = struct.Struct(f"{n}{code}").pack
    return p
