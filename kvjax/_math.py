"""Integer helpers shared by the ledger, the offsets and the device code (no JAX, no numpy)."""
from __future__ import annotations


def ceil_div[N](a: N, b: int) -> N:
    """`a / b` rounded up, for ints and for integer arrays elementwise (`b` > 0): the number of
    `b`-token blocks `a` tokens start."""
    return -(-a // b)  # type: ignore[operator]
