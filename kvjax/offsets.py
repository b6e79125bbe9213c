"""TensorRT-LLM `KVCacheIndex` offsets from slot tables, in pure numpy.

The ledger (`block_offsets`, no JAX allowed there) and the device side (a jitted builder in
`kvjax.device.offsets`) must produce the same numbers, so the formula lives here once.

An offset counts `[kv_heads, tokens_per_block, head_dim]` chunks of one pool array:
  block_first `[slots, layers, kv_factor, ...]`: offset = slot * layers_in_pool * kv_factor + field
  layer_first `[layers, slots, kv_factor, ...]`: offset = slot * kv_factor + field
                                                (kernels add layer * num_slots * kv_factor)
field 0 is K, field 1 is V. K-only pools (kv_factor 1) have no V chunk: their V row repeats
the null slot's K offset, so a kernel that reads it reads zeros. Padding and placeholder
entries (the null slot, or any negative entry) map to the null slot's offset.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from kvjax.config import CacheConfig, PoolSpec

if TYPE_CHECKING:  # the device-side geometry carries the same layout fields; no JAX at run time
    from kvjax.device.geometry import PoolGeometry


def chunk_stride(config: CacheConfig | PoolGeometry, pool: PoolSpec) -> int:
    """Offset distance between consecutive slots of `pool`."""
    if config.layout == "block_first":
        return pool.num_layers * config.kv_factor
    return config.kv_factor


def _tables_by_window(config: CacheConfig, slot_tables: Mapping[int, np.ndarray] | np.ndarray) -> dict[int, np.ndarray]:
    if not isinstance(slot_tables, Mapping):
        if len(config.windows) != 1:
            raise ValueError(f"config has windows {config.windows}: pass a dict window -> slot table")
        slot_tables = {config.windows[0]: slot_tables}
    missing = [w for w in config.windows if w not in slot_tables]
    extra = [w for w in slot_tables if w not in config.windows]
    if missing or extra:
        raise ValueError(f"slot tables must cover windows {config.windows}; missing {missing}, unknown {extra}")
    out: dict[int, np.ndarray] = {}
    batch = None
    for w in config.windows:
        t = np.asarray(slot_tables[w])
        if t.ndim != 2 or not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"slot table of window {w} must be a 2-D int array, got {t.shape=} {t.dtype=}")
        if batch is None:
            batch = t.shape[0]
        elif t.shape[0] != batch:
            raise ValueError(f"slot tables differ in batch size: window {w} has {t.shape[0]}, expected {batch}")
        out[w] = t.astype(np.int64)
    return out


def kvcache_index_offsets(config: CacheConfig, slot_tables_per_window: Mapping[int, np.ndarray] | np.ndarray) -> np.ndarray:
    """Offsets `[num_pools, batch*beam, 2, max_blocks]` int32 from per-window slot tables.

    `slot_tables_per_window` maps each window of `config` to an int `[batch*beam, blocks]`
    slot table (what `KVCacheManager.block_table(ids, window)` returns); a single-window config
    also accepts the bare array. Tables narrower than the widest are padded with the null slot.
    """
    tables = _tables_by_window(config, slot_tables_per_window)
    batch = next(iter(tables.values())).shape[0]
    max_blocks = max(t.shape[1] for t in tables.values())
    out = np.empty((len(config.pools), batch, 2, max_blocks), np.int32)
    for pool in config.pools:
        t = tables[pool.window]
        if t.size and (t >= pool.num_slots).any():
            raise ValueError(f"slot table of window {pool.window} has slots >= num_slots={pool.num_slots}: max {int(t.max())}")
        stride = chunk_stride(config, pool)
        null_off = pool.null_slot * stride
        slots = np.full((batch, max_blocks), pool.null_slot, np.int64)
        slots[:, : t.shape[1]] = np.where(t < 0, pool.null_slot, t)
        # [batch, max_blocks]
        base = slots * stride
        out[pool.index, :, 0] = base
        out[pool.index, :, 1] = base + 1 if config.kv_factor == 2 else null_off
    return out
