"""`write_kv`: scatter new K/V tokens (prefill chunks and decode tokens, ragged across
requests) into their slots, in place (the pools are donated)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.device import backend
from kvjax.device import _checks as chk
from kvjax.device import sharding as shd
from kvjax.device.pools import KVPools, PoolMeta


def _stack_kv(meta, arr, k, v):
    # [tokens, F, kv_heads, head_dim]
    kv = k[:, None] if meta.config.kv_factor == 1 else jnp.stack([k, v], axis=1)
    return kv.astype(arr.dtype)


def _slot_and_offset(slot_mapping, num_slots: int, tpb: int):
    """Split `slot*tpb + offset`; padding (negative) gets an out-of-range slot that scatters drop."""
    sm = slot_mapping.astype(jnp.int32)
    valid = sm >= 0
    slot = jnp.where(valid, sm // tpb, num_slots)  # [tokens]
    off = jnp.where(valid, sm % tpb, 0)  # [tokens]
    return slot, off


def _write_xla(arr, meta: PoolMeta, layer: int, k, v, slot_mapping):
    """One scatter per K/V field, each straight from its `[tokens, H, D]` input.

    Stacking K and V into one `[tokens, F, H, D]` update first costs a fresh temporary as
    large as the whole chunk, and on XLA CPU a fresh buffer page-faults on every call:
    measured 2-2.5x slower for decode-like writes (random slots) and 3-5x slower for
    prefill-like ones (whole blocks), from 64 to 32768 tokens.
    """
    pool, j = meta.locate(layer)
    slot, off = _slot_and_offset(slot_mapping, pool.num_slots, meta.config.tokens_per_block)
    for f, x in enumerate((k, v)[: meta.config.kv_factor]):
        x = x.astype(arr.dtype)  # [tokens, H, D]
        if meta.block_axis == 0:
            arr = arr.at[slot, j, f, :, off, :].set(x, mode="drop")
        else:
            arr = arr.at[j, slot, f, :, off, :].set(x, mode="drop")
    return arr


def _write_pallas(arr, meta: PoolMeta, layer: int, k, v, slot_mapping):
    from pallas_kernels import write_pages

    pool, j = meta.locate(layer)
    slot, off = _slot_and_offset(slot_mapping, pool.num_slots, meta.config.tokens_per_block)
    slot = jnp.where(slot >= pool.num_slots, -1, slot)  # kernels skip negative slots
    kv = _stack_kv(meta, arr, k, v)  # [tokens, F, H, D]
    fn = functools.partial(write_pages.write_pages, layer=j, layout=meta.config.layout)
    if meta.mesh is not None:
        rep = jax.sharding.PartitionSpec()
        fn = shd.shard_map(
            fn,
            meta.mesh,
            in_specs=(shd.pool_spec(meta.kv_axes), shd.head_sharded_spec(4, 2, meta.kv_axes), rep, rep),
            out_specs=shd.pool_spec(meta.kv_axes),
        )
        kv = shd.constrain_heads(kv, meta.mesh, meta.kv_axes, 2)
    return fn(arr, kv, slot, off)


@functools.partial(jax.jit, static_argnames=("meta", "layer", "impl"), donate_argnames=("arr",))
def _write_kv(arr, k, v, slot_mapping, *, meta: PoolMeta, layer: int, impl: str):
    # Only the layer's pool array goes through jit (donated): other pools, and host arrays
    # whose memory kind a pass-through output could lose, stay outside.
    f = _write_pallas if impl == "pallas" else _write_xla
    return f(arr, meta, layer, k, v, slot_mapping)


def write_kv(pools: KVPools, layer: int, k, v, slot_mapping, *, impl: str = "auto") -> KVPools:
    """Write `k`, `v` `[tokens, kv_heads, head_dim]` of `layer` at `slot_mapping` `[tokens]`
    (`slot * tokens_per_block + offset`; negative = padding, skipped). Returns the new pools;
    the old ones are donated. K-only caches pass `v=None`. Duplicate targets are undefined."""
    chk.check_pools(pools)
    pool, _ = pools.locate(layer)
    (n, h, d), _ = chk.shape_dtype("k", k, 3, "float")
    if (h, d) != (pool.num_kv_heads, pool.head_dim):
        raise ValueError(f"k.shape={k.shape} must be [tokens, {pool.num_kv_heads}, {pool.head_dim}] for {layer=}")
    if pools.config.kv_factor == 2:
        if v is None:
            raise ValueError("v is required: the cache stores K and V")
        chk.shape_dtype("v", v, 3, "float")
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"v.shape={tuple(v.shape)} must equal k.shape={tuple(k.shape)}")
    elif v is not None:
        raise ValueError("v must be None for a K-only cache (cache_type='self_k_only')")
    (m,), _ = chk.shape_dtype("slot_mapping", slot_mapping, 1, "int")
    if m != n:
        raise ValueError(f"slot_mapping.shape={tuple(slot_mapping.shape)} must be [{n}] to match k")
    host = chk.concrete(slot_mapping)
    limit = pool.num_slots * pools.config.tokens_per_block
    if host is not None and host.size and host.max() >= limit:
        raise ValueError(f"slot_mapping has entries >= num_slots*tokens_per_block={limit}: max {int(host.max())}")
    impl = backend.resolve(impl, "write_kv")
    arr = _write_kv(pools.primary[pool.index], k, v, jnp.asarray(slot_mapping, jnp.int32),
                    meta=pools.meta, layer=layer, impl=impl)
    return pools.with_primary(pool.index, arr)


def write_kv_reference(pools: KVPools, layer: int, k, v, slot_mapping) -> KVPools:
    """Oracle: one token at a time, in order, with dynamic_update_slice (no donation)."""
    arr, pool, j = pools.layer_view(layer)
    tpb = pools.config.tokens_per_block
    kv = _stack_kv(pools, arr, k, v)  # [tokens, F, H, D]
    ba = pools.block_axis

    def body(t, a):
        sm = slot_mapping[t]
        slot, off = sm // tpb, sm % tpb
        upd = kv[t][None, None, :, :, None, :]  # [1, 1, F, H, 1, D]
        start = (slot, j, 0, 0, off, 0) if ba == 0 else (j, slot, 0, 0, off, 0)
        new = jax.lax.dynamic_update_slice(a, upd, start)
        return jnp.where(sm >= 0, new, a)

    arr = jax.lax.fori_loop(0, kv.shape[0], body, arr)
    return pools.with_primary(pool.index, arr)
