"""Static shapes for a serving loop: batch, blocks per sequence and op counts rounded up to
powers of two, so jit sees a handful of shapes instead of one per step."""
from __future__ import annotations

import numpy as np
from jaxtyping import Int, Shaped


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    if n < 0:
        raise ValueError(f"{n=} must be >= 0")
    n = max(int(n), int(minimum))
    return 1 << (n - 1).bit_length()


def pad_rows(a: Shaped[np.ndarray, "n *rest"], rows: int, fill: int) -> Shaped[np.ndarray, "rows *rest"]:
    """Pad axis 0 of `a` to `rows` with `fill`."""
    a = np.asarray(a)
    if a.shape[0] > rows:
        raise ValueError(f"cannot pad {a.shape[0]} rows down to {rows=}")
    out = np.full((rows,) + a.shape[1:], fill, a.dtype)
    out[: a.shape[0]] = a
    return out


def pad_block_table(table: Int[np.ndarray, "n blocks"], null_slot: int, *, batch: int | None = None,
                    max_blocks: int | None = None) -> Int[np.ndarray, "batch max_blocks"]:
    """Pad an int32 `[batch, blocks]` slot table to bucketed `[batch, max_blocks]` with the null slot."""
    table = np.asarray(table, np.int32)
    if table.ndim != 2:
        raise ValueError(f"block table must be 2-D, got {table.shape=}")
    b = bucket(table.shape[0]) if batch is None else batch
    m = bucket(table.shape[1]) if max_blocks is None else max_blocks
    if b < table.shape[0] or m < table.shape[1]:
        raise ValueError(f"cannot pad {table.shape=} to ({b}, {m})")
    out = np.full((b, m), null_slot, np.int32)
    out[: table.shape[0], : table.shape[1]] = table
    return out


def pad_seq_lens(seq_lens: Int[np.ndarray, " n"], batch: int | None = None) -> Int[np.ndarray, " batch"]:
    """Pad `[batch]` sequence lengths with zeros (padding rows attend to nothing)."""
    seq_lens = np.asarray(seq_lens, np.int32)
    return pad_rows(seq_lens, bucket(seq_lens.shape[0]) if batch is None else batch, 0)


def pad_slot_mapping(slot_mapping: Int[np.ndarray, " n"], num_tokens: int | None = None) -> Int[np.ndarray, " tokens"]:
    """Pad a `[tokens]` slot mapping with -1 (skipped by `write_kv`)."""
    slot_mapping = np.asarray(slot_mapping, np.int32)
    return pad_rows(slot_mapping, bucket(slot_mapping.shape[0]) if num_tokens is None else num_tokens, -1)
