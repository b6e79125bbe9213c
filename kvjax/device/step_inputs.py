"""A step's device inputs from the ledger's output: positions, sequence lengths, padded
block tables and slot mappings, bucketed to static shapes.

Row convention (what `paged_attention` and `kvjax.models` expect): row b holds the LAST
`q_len` token positions of its sequence, so its query i sits at position
`seq_lens[b] - q_len + i`. A request that adds `chunk_lens[b]` tokens this step (1 for
decode, a prefill chunk otherwise) fills the last `chunk_lens[b]` columns of its row; the
columns before them are padding.

Padding conventions:
  rows          rows past the real ones have `seq_len` 0, positions `-q_len .. -1`, block
                tables full of the null slot and slot mapping -1 (they write nothing and
                attend to nothing: their output is zeros).
  columns       padding columns of a real row have the positions just before its chunk
                (possibly negative) and slot mapping -1: they write nothing; their query
                output is finite garbage from the row's own keys, to be ignored.
  block tables  placeholder entries (negative, or the null slot) and columns past the
                ledger's table are the window's null slot (reads zeros); columns past
                `max_blocks` (>= every row's blocks) are dropped: they hold positions the
                step neither reads nor writes.
  slot mapping  `slot * tokens_per_block + offset` per token, `[batch * q_len]` row-major,
                -1 for padding. A new token whose block is missing or a placeholder is an
                error: the null slot is never written.
Dimensions are rounded up to powers of two (`kvjax.device.bucket`) unless given.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from kvjax._math import ceil_div
from kvjax.config import CacheConfig
from kvjax.device.buckets import bucket
from kvjax.device.geometry import PoolGeometry


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Host (numpy int32) inputs of one forward step; per-window entries are dicts."""

    positions: np.ndarray  # [batch, q_len]
    seq_lens: np.ndarray  # [batch]
    block_tables: dict[int, np.ndarray]  # window -> [batch, max_blocks] slots
    slot_mapping: dict[int, np.ndarray]  # window -> [batch * q_len]
    num_rows: int  # real rows (the first ones)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(batch, q_len, max_blocks): what a compiled step specialises on."""
        b, t = self.positions.shape
        return b, t, next(iter(self.block_tables.values())).shape[1]

    def _only(self, d: dict[int, np.ndarray]) -> np.ndarray:
        if len(d) != 1:
            raise ValueError(f"several windows {sorted(d)}: index the dict by window")
        return next(iter(d.values()))

    @property
    def block_table(self) -> np.ndarray:
        """The block table of a single-window geometry."""
        return self._only(self.block_tables)

    @property
    def slots(self) -> np.ndarray:
        """The slot mapping of a single-window geometry."""
        return self._only(self.slot_mapping)


def _geometry(source) -> PoolGeometry:
    if hasattr(source, "geometry") and isinstance(source.geometry, PoolGeometry):  # KVPools
        return source.geometry
    if isinstance(source, (CacheConfig, PoolGeometry)):
        return PoolGeometry.from_config(source, check_dtype=False)
    raise ValueError(f"expected a CacheConfig, PoolGeometry or KVPools, got {type(source).__name__}")


def _int_vector(name: str, x, n: int | None) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and (not np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_)):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {a.shape} dtype {a.dtype}")
    if n is not None and a.shape[0] != n:
        raise ValueError(f"{name} has {a.shape[0]} entries, expected {n}")
    return a.astype(np.int64)


def _size(name: str, given: int | None, needed: int) -> int:
    if given is None:
        return bucket(needed)
    if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given < max(needed, 1):
        raise ValueError(f"{name}={given!r} must be an int >= {max(needed, 1)}")
    return int(given)


def step_inputs(
    geometry: CacheConfig | PoolGeometry,
    block_tables: Mapping[int, Int[np.ndarray, "n blocks"]] | Int[np.ndarray, "n blocks"],
    seq_lens: Int[np.ndarray, " n"],
    chunk_lens: Int[np.ndarray, " n"],
    *,
    batch: int | None = None,
    q_len: int | None = None,
    max_blocks: int | None = None,
) -> StepInputs:
    """Device inputs of one step for `n` requests (module docstring for the conventions).

    block_tables: window -> int `[n, blocks]` slots, as `KVCacheManager.block_table(ids,
      window)` returns them (a bare array for a single-window geometry).
    seq_lens: `[n]` tokens of each sequence including this step's chunk.
    chunk_lens: `[n]` new tokens of each request this step (`0 <= chunk <= seq_len`).
    batch, q_len, max_blocks: padded sizes (default: powers of two >= what is needed).
    Raises ValueError on inconsistent input; never silently drops a token.
    """
    geo = _geometry(geometry)
    tpb = geo.tokens_per_block
    if not isinstance(block_tables, Mapping):
        if len(geo.windows) != 1:
            raise ValueError(f"the geometry has windows {geo.windows}: pass a dict window -> block table")
        block_tables = {geo.windows[0]: block_tables}
    if sorted(block_tables) != list(geo.windows):
        raise ValueError(f"block tables must cover exactly the windows {geo.windows}, got {sorted(block_tables)}")
    seq = _int_vector("seq_lens", seq_lens, None)
    n = seq.shape[0]
    if n == 0:
        raise ValueError("step_inputs needs at least one request")
    chunk = _int_vector("chunk_lens", chunk_lens, n)
    if (chunk < 0).any() or (chunk > seq).any():
        i = int(np.argmax((chunk < 0) | (chunk > seq)))
        raise ValueError(f"row {i}: chunk_lens={int(chunk[i])} must be in [0, seq_len={int(seq[i])}]")
    b = _size("batch", batch, n)
    t = _size("q_len", q_len, int(chunk.max()))
    m = _size("max_blocks", max_blocks, ceil_div(int(seq.max()), tpb))
    out_seq = np.zeros((b,), np.int32)  # [B]
    out_seq[:n] = seq
    positions = out_seq[:, None] - t + np.arange(t, dtype=np.int32)[None, :]  # [B, T]
    rows = np.repeat(np.arange(n), chunk)  # [new tokens]: row of each new token
    pos = np.concatenate([np.arange(s - c, s) for s, c in zip(seq, chunk, strict=True)]).astype(np.int64)  # [new tokens]
    col = np.concatenate([np.arange(t - c, t) for c in chunk]).astype(np.int64)  # [new tokens]
    tables, slots = {}, {}
    for w in geo.windows:
        null = geo.null_slot_for(w)
        tab = np.asarray(block_tables[w])
        if (
            tab.ndim != 2
            or tab.shape[0] != n
            or (tab.size and (not np.issubdtype(tab.dtype, np.integer) or tab.dtype == np.bool_))
        ):
            raise ValueError(f"block table of window {w} must be an integer [{n}, blocks] array, got {tab.shape} {tab.dtype}")
        if tab.size and tab.max() > null:
            raise ValueError(f"block table of window {w} has entries > the null slot {null}: max {int(tab.max())}")
        tab = np.where(tab < 0, null, tab).astype(np.int64)  # placeholders -> null slot
        width = min(tab.shape[1], m)  # later columns only hold positions >= seq_len: never reached
        table = np.full((b, m), null, np.int32)  # [B, M]
        table[:n, :width] = tab[:, :width]
        blk = pos // tpb  # [new tokens]
        held = blk < tab.shape[1]
        slot = np.where(held, tab[rows, np.minimum(blk, max(tab.shape[1] - 1, 0))] if tab.shape[1] else null, null)
        if (slot == null).any():
            i = int(np.argmax(slot == null))
            raise ValueError(f"row {int(rows[i])}: window {w} has no block for new position {int(pos[i])} "
                             "(the null slot is never written)")
        sm = np.full((b, t), -1, np.int32)  # [B, T]
        sm[rows, col] = slot * tpb + pos % tpb
        tables[w], slots[w] = table, sm.reshape(-1)
    return StepInputs(positions.astype(np.int32), out_seq, tables, slots, n)


def slots_for_positions(
    block_table: Int[Array, "batch blocks"],
    positions: Int[Array, "batch q_len"],
    write: Bool[Array, "batch q_len"],
    *,
    tokens_per_block: int,
    num_slots: int,
) -> Int[Array, "batch q_len"]:
    """Slot mapping computed on device (inside jit): `table[b, p // T] * T + p % T` where
    `write`, else -1. Positions past the table and entries that are not real slots (negative,
    the null slot `num_slots - 1`, or beyond) give -1 too, so nothing lands where it must not."""
    t = tokens_per_block
    m = block_table.shape[1]
    blk = positions // t  # [B, Q]
    inside = (positions >= 0) & (blk < m)
    slot = jnp.take_along_axis(block_table.astype(jnp.int32), jnp.clip(blk, 0, m - 1), axis=1)  # [B, Q]
    real = (slot >= 0) & (slot < num_slots - 1)
    return jnp.where(write & inside & real, slot * t + positions % t, -1).astype(jnp.int32)
