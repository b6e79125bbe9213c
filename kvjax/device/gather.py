"""`gather_kv`: contiguous K/V per request, read through a block table of slots.

Safe padding: a table entry outside `[0, primary_blocks)` (negative, the null slot, or past
the pool) reads the null slot, whose K/V is zero, whether the table is a numpy array or a
traced one; numpy tables with entries outside `[0, num_slots)` are rejected up front, and
checked mode reports traced ones. Positions `>= seq_len` read as zeros too. FP8 pools are
dequantised on the way out (bfloat16 by default: exact for power-of-two scales).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax.config import PoolSpec
from kvjax.device import _checks as chk
from kvjax.device import backend, checking, layers, quant
from kvjax.device import sharding as shd
from kvjax.device.pools import KVPools, PoolMeta
from kvjax.device.write import at


def safe_table(block_table: Int[Array, "batch blocks"], pool: PoolSpec) -> Int[Array, "batch blocks"]:
    """Entries outside `[0, primary_blocks)` -> the null slot (zero K/V, zero scales)."""
    t = block_table.astype(jnp.int32)
    return jnp.where((t >= 0) & (t < pool.primary_blocks), t, pool.null_slot)


def output_dtype(meta: PoolMeta, dtype) -> jnp.dtype:
    """What gathered K/V come out as: `dtype` if given, else the pool's (bfloat16 for FP8)."""
    if dtype is not None:
        return jnp.dtype(dtype)
    return jnp.dtype(jnp.bfloat16) if meta.geometry.is_scaled else meta.geometry.jnp_dtype


def validate_table(block_table, seq_lens, j, *, meta: PoolMeta, pool_index: int, op: str) -> None:
    """Checked mode: what the gather would silently read as zeros, reported."""
    pool = meta.geometry.pools[pool_index]
    t = block_table.astype(jnp.int32)
    cap = t.shape[1] * meta.geometry.tokens_per_block
    checking.check(j < pool.num_layers, f"{op}: the layer is not in pool {pool_index} (in-pool index {{}})", j)
    checking.check(jnp.all((t >= 0) & (t < pool.num_slots)),
                   f"{op}: block_table entries must be slots in [0, {pool.num_slots}) (padding = null slot "
                   f"{pool.null_slot}); got min {{}} max {{}}", jnp.min(t), jnp.max(t))
    checking.check(jnp.all((seq_lens >= 0) & (seq_lens <= cap)),
                   f"{op}: seq_lens must be in [0, {cap}]; got min {{}} max {{}}", jnp.min(seq_lens), jnp.max(seq_lens))


def gather_slots(meta: PoolMeta, pool: PoolSpec, j, block_table, seq_lens):
    """Per position of every request: `(slot, offset, layer)` to read; positions past
    seq_len, bad table entries and a layer outside the pool all read the null slot."""
    t = meta.geometry.tokens_per_block
    b, m = block_table.shape
    in_pool = j < pool.num_layers
    table = safe_table(block_table, pool)  # [batch, blocks]
    pos = jnp.arange(m * t, dtype=jnp.int32)  # [positions]
    live = (pos[None, :] < seq_lens[:, None]) & in_pool  # [batch, positions]
    slot = jnp.where(live, table[:, pos // t], pool.null_slot)  # [batch, positions]
    off = jnp.broadcast_to(pos % t, slot.shape)  # [batch, positions]
    return slot, off, jnp.where(in_pool, j, 0)


def _gather_xla(arr, sarr, meta: PoolMeta, pool: PoolSpec, j, block_table, seq_lens, out_dtype):
    """One row gather per field: output row (b, p, :, :) = K/V heads of token p of request b.

    Gathering `[H, D]` rows straight into `[batch, positions, H, D]` fuses the block lookup,
    the heads/tokens transpose and the tail mask into one pass (positions >= seq_len read
    the null slot, which is zero): on XLA CPU about twice as fast as gathering whole blocks
    and transposing them afterwards. FP8 rows are multiplied by their block's scale in the
    same fusion.
    """
    slot, off, jj = gather_slots(meta, pool, j, block_table, seq_lens)
    if sarr is not None:  # scales per block (not per position): positions past seq_len read 0 anyway
        blocks = jnp.where(j < pool.num_layers, safe_table(block_table, pool), pool.null_slot)  # [batch, blocks]
    out = []
    for f in range(meta.geometry.kv_factor):
        x = arr[at(meta.block_axis, slot, jj) + (f, slice(None), off, slice(None))]  # [batch, positions, H, D]
        if sarr is not None:
            scale = sarr[at(meta.block_axis, blocks, jj) + (f,)]  # [batch, blocks, H]
            scale = jnp.repeat(scale, meta.geometry.tokens_per_block, axis=1)  # [batch, positions, H]
            x = quant.dequantize_bytes(x, scale[..., None], meta.geometry.jnp_dtype, out_dtype)
        out.append(x.astype(out_dtype))
    return tuple(out)


def _gather_pallas(arr, sarr, meta: PoolMeta, pool: PoolSpec, j, block_table, seq_lens, out_dtype):
    from pallas_kernels import gather_pages

    in_pool = j < pool.num_layers
    table = jnp.where(in_pool, safe_table(block_table, pool), pool.null_slot)  # [batch, blocks]
    layer = jnp.where(in_pool, j, 0).reshape(1)  # [1]
    fn = functools.partial(gather_pages.gather_pages, layout=meta.geometry.layout, out_dtype=out_dtype,
                           value_dtype=meta.geometry.jnp_dtype)
    args = (arr, table, seq_lens, layer) + (() if sarr is None else (sarr,))
    if meta.mesh is not None:
        rep = jax.sharding.PartitionSpec()
        out = shd.head_sharded_spec(4, 2, meta.kv_axes)
        specs = (shd.pool_spec(meta.kv_axes), rep, rep, rep) + (() if sarr is None else (shd.scale_spec(meta.kv_axes),))
        fn = shd.shard_map(fn, meta.mesh, in_specs=specs, out_specs=(out,) * meta.geometry.kv_factor)
    return tuple(fn(*args))


@functools.partial(jax.jit, static_argnames=("meta", "pool_index", "impl", "checked", "out_dtype"))
def _gather_kv(arr, sarr, block_table, seq_lens, j, *, meta: PoolMeta, pool_index: int, impl: str, checked: bool,
               out_dtype):
    pool = meta.geometry.pools[pool_index]
    if checked:
        validate_table(block_table, seq_lens, j, meta=meta, pool_index=pool_index, op="gather_kv")
    f = _gather_pallas if impl == "pallas" else _gather_xla
    fields = f(arr, sarr, meta, pool, j, block_table, seq_lens, out_dtype)
    return fields if len(fields) == 2 else (fields[0], None)


def check_table(pools: KVPools, pool: PoolSpec, block_table, seq_lens) -> None:
    """Host checks of a block table and its sequence lengths (shape, dtype, int32 range and,
    for numpy inputs, values)."""
    (b, m), tab = chk.int_array("block_table", block_table, 2)
    (b2,), lens = chk.int_array("seq_lens", seq_lens, 1)
    if b2 != b:
        raise ValueError(f"seq_lens.shape={tuple(seq_lens.shape)} must be [{b}] to match block_table.shape={(b, m)}")
    if tab is not None and tab.size and (tab.min() < 0 or tab.max() >= pool.num_slots):
        raise ValueError(f"block_table entries must be slots in [0, {pool.num_slots}) (padding = null slot {pool.null_slot}), "
                         f"got min {int(tab.min())} max {int(tab.max())}")
    cap = m * pools.geometry.tokens_per_block
    if lens is not None and lens.size and (lens.min() < 0 or lens.max() > cap):
        raise ValueError(f"seq_lens must be in [0, {cap}] (max_blocks * tokens_per_block), got {lens.tolist()}")


def run_table_checks(pools: KVPools, spec: PoolSpec, arrays, table, lens, j, op: str) -> bool:
    """Checked mode, eager call: validate device inputs before the op runs. Returns whether
    the op itself must still carry the checks (it is being traced)."""
    if not checking.is_checked():
        return False
    if chk.any_tracer(arrays, table, lens, j):
        return True
    checking.run_eager_checks(validate_table, table, lens, j, meta=pools.meta, pool_index=spec.index, op=op)
    return False


def gather_kv(
    pools: KVPools,
    layer: int | Int[Array, ""],
    block_table: Int[Array, "batch blocks"] | Int[np.ndarray, "batch blocks"],
    seq_lens: Int[Array, " batch"] | Int[np.ndarray, " batch"],
    *,
    impl: str = "auto",
    pool: int | None = None,
    dtype=None,
) -> tuple[Float[Array, "batch positions kv_heads head_dim"], Float[Array, "batch positions kv_heads head_dim"] | None]:
    """K, V of `layer` as `[batch, max_blocks * tokens_per_block, kv_heads, head_dim]`.

    `block_table` int32 `[batch, max_blocks]` holds slots (padding = the pool's null slot);
    positions >= `seq_lens[b]` are zero. K-only caches return `(k, None)`. FP8 pools come
    out dequantised, as `dtype` (default bfloat16). `layer` may be traced (see `write_kv`).
    """
    chk.check_pools(pools)
    spec, j = layers.resolve(pools.geometry, layer, pool)
    check_table(pools, spec, block_table, seq_lens)
    impl = backend.resolve(impl, "gather_kv", dtype=pools.geometry.jnp_dtype, head_dim=spec.head_dim,
                           tokens_per_block=pools.geometry.tokens_per_block)
    arr, sarr = pools.primary[spec.index], pools.primary_scales[spec.index]
    table, lens = chk.as_int32(block_table), chk.as_int32(seq_lens)
    checked = run_table_checks(pools, spec, (arr, sarr), table, lens, j, "gather_kv")
    return _gather_kv(arr, sarr, table, lens, j, meta=pools.meta, pool_index=spec.index, impl=impl, checked=checked,
                      out_dtype=output_dtype(pools.meta, dtype))


def gather_kv_reference(
    pools: KVPools,
    layer: int,
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    *,
    dtype=None,
) -> tuple[Float[Array, "batch positions kv_heads head_dim"], Float[Array, "batch positions kv_heads head_dim"] | None]:
    """Oracle: index every position separately (block = table[p // T], offset = p % T);
    entries outside `[0, primary_blocks)` and positions past seq_len read zeros."""
    arr, pool, j = pools.layer_view(layer)
    sarr = pools.primary_scales[pool.index]
    t = pools.geometry.tokens_per_block
    b, m = block_table.shape
    pos = jnp.arange(m * t)  # [positions]
    slots = jnp.asarray(block_table)[:, pos // t]  # [batch, positions]
    ok = (slots >= 0) & (slots < pool.primary_blocks) & (pos[None, :] < seq_lens[:, None])  # [batch, positions]
    slots = jnp.clip(slots, 0, pool.num_slots - 1)
    offs = jnp.broadcast_to(pos % t, slots.shape)  # [batch, positions]
    layer_arr = arr[:, j] if pools.block_axis == 0 else arr[j]  # [slots, F, H, T, D]
    out_dtype = output_dtype(pools.meta, dtype)
    out = []
    for f in range(pools.geometry.kv_factor):
        x = layer_arr[slots, f, :, offs, :]  # [batch, positions, H, D]
        if sarr is not None:
            x = jax.lax.bitcast_convert_type(x, pools.geometry.jnp_dtype)
        x = x.astype(jnp.float32)
        if sarr is not None:
            layer_s = sarr[:, j] if pools.block_axis == 0 else sarr[j]  # [slots, F, H]
            x = x * layer_s[slots, f][..., None]
        out.append(jnp.where(ok[..., None, None], x, 0).astype(out_dtype))
    return (out[0], out[1]) if len(out) == 2 else (out[0], None)
