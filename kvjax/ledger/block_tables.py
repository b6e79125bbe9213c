"""Block tables for attention kernels: each sequence's primary slots, padded with the null slot.

A sequence keeps, per window and beam, an int array mirroring its blocks' slots, so a table is
one concatenation of those rows scattered under a ragged mask: no per-block or per-row numpy
call, whatever the batch.
"""
from __future__ import annotations

import array
from collections.abc import Iterable

import numpy as np

from kvjax.errors import InvalidArgumentError


def slot_rows(seqs: Iterable, index: int) -> list[array.array]:
    """The slot rows of window manager `index`, one per (sequence, beam), in order."""
    rows: list[array.array] = []
    extend = rows.extend
    for seq in seqs:
        extend(seq.windows[index].slots)
    return rows


def padded_table(rows: list[array.array], null_slot: int, max_blocks: int | None) -> np.ndarray:
    """int32 `[len(rows), width]`: each row's slots, then the null slot; `width` is `max_blocks`
    or the longest row."""
    lengths = np.fromiter(map(len, rows), dtype=np.int32, count=len(rows))
    longest = int(lengths.max()) if len(rows) else 0
    width = longest if max_blocks is None else max_blocks
    if width < longest:
        raise InvalidArgumentError(f"max_blocks={max_blocks} is smaller than the longest block list ({longest})")
    out = np.full((len(rows), width), null_slot, dtype=np.int32)
    if longest:
        flat = np.frombuffer(b"".join(rows), dtype=np.int32)
        out[np.arange(width, dtype=np.int32) < lengths[:, None]] = flat  # [rows, width] mask
    return out
