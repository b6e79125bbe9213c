"""`packer`: compiled `struct` packers of n native ints, one per (count, code); `int_array`, an
integer array of Python ints made with one of them; `same_ids`, the id-list comparison of the
cached batches.

`struct.pack(f"{n}i", *xs)` looks its format up in `struct`'s small cache on every call and
copies its arguments twice (the format joins them); a compiled `Struct(...).pack` takes them
once. For a 1,280-token prompt that is about 2.5 µs of the 10 µs its encoding costs, paid on
every admission and store. The cache is bounded: it is emptied when it reaches `_MAX` counts.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

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


_SIGNED_CODES = {4: "i", 8: "q"}  # struct codes of native signed ints by size


def int_array(values: Iterable[int], dtype: type = np.int64) -> np.ndarray:
    """A writable 1-D signed integer array (`dtype` of 4 or 8 bytes) of Python ints, made with
    one `struct.pack`: about twice as fast as `np.array` or `np.fromiter` on a list of ints, and
    the per-row passes over a batch of a thousand requests are what a decode step costs.
    `struct.error` for a value out of range."""
    vals = values if isinstance(values, list) else list(values)
    dt = np.dtype(dtype)
    return np.frombuffer(bytearray(packer(len(vals), _SIGNED_CODES[dt.itemsize])(*vals)), dtype=dt)


def same_ids(cached: Sequence[Hashable], ids: Sequence[Hashable]) -> bool:
    """Is `ids` the id list of a cached batch (an id comparing like an array: no)?"""
    try:
        return bool(cached == ids)
    except (TypeError, ValueError):
        return False
