"""`gather_kv`: contiguous K/V per request, read through a block table of slots."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.device import backend
from kvjax.device import _checks as chk
from kvjax.device import sharding as shd
from kvjax.device.pools import KVPools, PoolMeta


def _gather_xla(arr, meta: PoolMeta, layer: int, block_table, seq_lens):
    """One row gather per field: output row (b, p, :, :) = K/V heads of token p of request b.

    Gathering `[H, D]` rows straight into `[batch, positions, H, D]` fuses the block lookup,
    the heads/tokens transpose and the tail mask into one pass (positions >= seq_len read
    the null slot, which is zero): on XLA CPU about twice as fast as gathering whole blocks
    and transposing them afterwards.
    """
    pool, j = meta.locate(layer)
    b, m = block_table.shape
    t = meta.config.tokens_per_block
    pos = jnp.arange(m * t, dtype=jnp.int32)  # [positions]
    live = pos[None, :] < seq_lens[:, None]  # [batch, positions]
    slot = jnp.where(live, block_table[:, pos // t], pool.null_slot)  # [batch, positions]
    off = jnp.broadcast_to(pos % t, slot.shape)  # [batch, positions]
    out = []
    for f in range(meta.config.kv_factor):
        if meta.block_axis == 0:
            out.append(arr[slot, j, f, :, off, :])  # [batch, positions, H, D]
        else:
            out.append(arr[j, slot, f, :, off, :])  # [batch, positions, H, D]
    return tuple(out)


def _gather_pallas(arr, meta: PoolMeta, layer: int, block_table, seq_lens):
    from pallas_kernels import gather_pages

    pool, j = meta.locate(layer)
    fn = functools.partial(gather_pages.gather_pages, layer=j, layout=meta.config.layout)
    if meta.mesh is not None:
        rep = jax.sharding.PartitionSpec()
        out = shd.head_sharded_spec(4, 2, meta.kv_axes)
        fn = shd.shard_map(fn, meta.mesh, in_specs=(shd.pool_spec(meta.kv_axes), rep, rep),
                           out_specs=(out,) * meta.config.kv_factor)
    return tuple(fn(arr, block_table, seq_lens))


@functools.partial(jax.jit, static_argnames=("meta", "layer", "impl"))
def _gather_kv(arr, block_table, seq_lens, *, meta: PoolMeta, layer: int, impl: str):
    fields = (_gather_pallas if impl == "pallas" else _gather_xla)(arr, meta, layer, block_table, seq_lens)
    return fields if len(fields) == 2 else (fields[0], None)


def check_table(pools: KVPools, layer: int, block_table, seq_lens) -> None:
    pool, _ = pools.locate(layer)
    (b, m), _ = chk.shape_dtype("block_table", block_table, 2, "int")
    (b2,), _ = chk.shape_dtype("seq_lens", seq_lens, 1, "int")
    if b2 != b:
        raise ValueError(f"seq_lens.shape={tuple(seq_lens.shape)} must be [{b}] to match block_table.shape={(b, m)}")
    tab, lens = chk.concrete(block_table), chk.concrete(seq_lens)
    if tab is not None and tab.size and (tab.min() < 0 or tab.max() >= pool.num_slots):
        raise ValueError(f"block_table entries must be slots in [0, {pool.num_slots}) (padding = null slot {pool.null_slot}), "
                         f"got min {int(tab.min())} max {int(tab.max())}")
    cap = m * pools.config.tokens_per_block
    if lens is not None and lens.size and (lens.min() < 0 or lens.max() > cap):
        raise ValueError(f"seq_lens must be in [0, {cap}] (max_blocks * tokens_per_block), got {lens.tolist()}")


def gather_kv(pools: KVPools, layer: int, block_table, seq_lens, *, impl: str = "auto"):
    """K, V of `layer` as `[batch, max_blocks * tokens_per_block, kv_heads, head_dim]`.

    `block_table` int32 `[batch, max_blocks]` holds slots (padding = the pool's null slot);
    positions >= `seq_lens[b]` are zero. K-only caches return `(k, None)`.
    """
    chk.check_pools(pools)
    check_table(pools, layer, block_table, seq_lens)
    impl = backend.resolve(impl, "gather_kv")
    pool, _ = pools.locate(layer)
    return _gather_kv(pools.primary[pool.index], jnp.asarray(block_table, jnp.int32), jnp.asarray(seq_lens, jnp.int32),
                      meta=pools.meta, layer=layer, impl=impl)


def gather_kv_reference(pools: KVPools, layer: int, block_table, seq_lens):
    """Oracle: index every position separately (block = table[p // T], offset = p % T)."""
    arr, pool, j = pools.layer_view(layer)
    t = pools.config.tokens_per_block
    b, m = block_table.shape
    pos = jnp.arange(m * t)  # [positions]
    slots = block_table[:, pos // t]  # [batch, positions]
    offs = jnp.broadcast_to(pos % t, slots.shape)  # [batch, positions]
    layer_arr = arr[:, j] if pools.block_axis == 0 else arr[j]  # [slots, F, H, T, D]
    out = []
    for f in range(pools.config.kv_factor):
        x = layer_arr[slots, f, :, offs, :]  # [batch, positions, H, D]
        live = pos[None, :] < seq_lens[:, None]
        out.append(jnp.where(live[..., None, None], x, 0).astype(arr.dtype))
    return (out[0], out[1]) if len(out) == 2 else (out[0], None)
