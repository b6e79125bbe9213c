"""Jitted TensorRT-LLM `KVCacheIndex` offsets from slot tables (formula: `kvjax.offsets`).

For engines that hand offsets to TRT-LLM-style kernels without a host round trip; the
numbers equal `kvjax.offsets.kvcache_index_offsets` (and the ledger's `block_offsets`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from kvjax.config import CacheConfig
from kvjax.device.geometry import PoolGeometry
from kvjax.offsets import chunk_stride


@functools.partial(jax.jit, static_argnames=("config",))
def _build(config: PoolGeometry, tables: tuple):
    by_window = dict(zip(config.windows, tables, strict=True))
    batch = tables[0].shape[0]
    width = max(t.shape[1] for t in tables)
    rows = []
    for pool in config.pools:
        t = by_window[pool.window].astype(jnp.int32)  # [batch, blocks]
        t = jnp.where(t < 0, pool.null_slot, t)
        t = jnp.pad(t, ((0, 0), (0, width - t.shape[1])), constant_values=pool.null_slot)  # [batch, width]
        stride = chunk_stride(config, pool)
        base = t * stride
        v = base + 1 if config.kv_factor == 2 else jnp.full_like(base, pool.null_slot * stride)
        rows.append(jnp.stack([base, v], axis=1))  # [batch, 2, width]
    return jnp.stack(rows).reshape(len(config.pools), batch, 2, width)  # [pools, batch, 2, width]


def build_kvcache_offsets(config: CacheConfig | PoolGeometry, slot_tables) -> Int[Array, "pools batch 2 blocks"]:
    """`[num_pools, batch*beam, 2, max_blocks]` int32 offsets on device.

    `slot_tables`: a dict window -> int `[batch*beam, blocks]` slot table (every window of
    `config`), or one array for a single-window config. Only the geometry of `config` is
    compiled in (ledger policy never recompiles this).
    """
    config = PoolGeometry.from_config(config, check_dtype=False)
    if not isinstance(slot_tables, dict):
        if len(config.windows) != 1:
            raise ValueError(f"config has windows {config.windows}: pass a dict window -> slot table")
        slot_tables = {config.windows[0]: slot_tables}
    if sorted(slot_tables) != list(config.windows):
        raise ValueError(f"slot tables must cover exactly windows {config.windows}, got {sorted(slot_tables)}")
    tables = tuple(jnp.asarray(slot_tables[w]) for w in config.windows)
    for w, t in zip(config.windows, tables, strict=True):
        if t.ndim != 2 or not jnp.issubdtype(t.dtype, jnp.integer):
            raise ValueError(f"slot table of window {w} must be a 2-D int array, got {t.shape=} {t.dtype=}")
        if t.shape[0] != tables[0].shape[0]:
            raise ValueError(f"slot tables differ in batch size: window {w} has {t.shape[0]}")
    return _build(config, tables)
