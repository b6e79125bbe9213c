"""`write_kv`: scatter new K/V tokens (prefill chunks and decode tokens, ragged across
requests) into their slots, in place (the pools are donated).

Safe padding: a token is written only if its slot mapping is `>= 0` and below
`primary_blocks * tokens_per_block`, i.e. outside the null block, and its layer lies in the
pool. Anything else is dropped (numpy inputs with entries in the null block or beyond are
rejected up front; checked mode reports traced ones).

FP8 pools quantise on write (`kvjax.device.quant`): per touched block, writing offset 0
restarts the block's scale; otherwise the scale grows when a new value needs it, and the
block's earlier tokens are rescaled to the new scale in the same op (exact: scales are
powers of two).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax._math import ceil_div
from kvjax.config import PoolSpec
from kvjax.device import _checks as chk
from kvjax.device import backend, checking, layers, quant
from kvjax.device import sharding as shd
from kvjax.device.pools import KVPools, PoolMeta

#: Blocks rescaled per loop step when a write grows scales (bounds the temporary).
RESCALE_CHUNK = 64


def at(block_axis: int, slot, layer):
    """Leading index of a pool (or scale) array: (slot, layer) or (layer, slot)."""
    return (slot, layer) if block_axis == 0 else (layer, slot)


def token_targets(slot_mapping: Int[Array, " n"], j: Int[Array, ""], pool: PoolSpec, tpb: int):
    """Per token `(slot, offset, valid)`. Padding (negative), the null block and beyond, and a
    layer outside the pool give `slot = num_slots`: an out-of-range index that scatters drop."""
    sm = slot_mapping.astype(jnp.int32)
    valid = (sm >= 0) & (sm < pool.primary_blocks * tpb) & (j < pool.num_layers)  # [n]
    slot = jnp.where(valid, sm // tpb, pool.num_slots)  # [n]
    off = jnp.where(valid, sm % tpb, 0)  # [n]
    return slot, off, valid


def validate_write(k, v, slot_mapping, j, *, meta: PoolMeta, pool_index: int) -> None:
    """Checked mode: what `write_kv` would silently drop, reported."""
    pool = meta.geometry.pools[pool_index]
    limit = pool.primary_blocks * meta.geometry.tokens_per_block
    sm = slot_mapping.astype(jnp.int32)
    checking.check(j < pool.num_layers, f"write_kv: the layer is not in pool {pool_index} (in-pool index {{}})", j)
    checking.check(~jnp.any(sm >= limit), f"write_kv: slot_mapping entry {{}} targets the null block or beyond "
                   f"(entries must be < primary_blocks*tokens_per_block={limit}, or negative for padding)", jnp.max(sm))
    for name, x in (("k", k), ("v", v)):
        if x is not None:
            checking.check(jnp.all(jnp.isfinite(x)), f"write_kv: {name} holds NaN or inf")


# ---------------------------------------------------------------------------- unscaled
def _write_xla(arr, meta: PoolMeta, pool: PoolSpec, j, k, v, slot_mapping):
    """One scatter per K/V field, each straight from its `[tokens, H, D]` input.

    Stacking K and V into one `[tokens, F, H, D]` update first costs a fresh temporary as
    large as the whole chunk, and on XLA CPU a fresh buffer page-faults on every call:
    measured 2-2.5x slower for decode-like writes (random slots) and 3-5x slower for
    prefill-like ones (whole blocks), from 64 to 32768 tokens.
    """
    slot, off, _ = token_targets(slot_mapping, j, pool, meta.geometry.tokens_per_block)
    for f, x in enumerate((k, v)[: meta.geometry.kv_factor]):
        x = x.astype(arr.dtype)  # [tokens, H, D]
        arr = arr.at[at(meta.block_axis, slot, j) + (f, slice(None), off, slice(None))].set(x, mode="drop")
    return arr


# ------------------------------------------------------------------------------ scaled
def _rescale_blocks(arr, ba: int, j, slot, rep, ratio, dtype, heads):
    """Multiply blocks `slot[i]` (where `rep[i]`) by `ratio[i]` `[F, H]`, in chunks of
    `RESCALE_CHUNK` blocks inside a loop that runs only as often as there are such blocks.
    `arr` holds uint8 bit patterns of fp8 `dtype`."""
    n = slot.shape[0]
    c = min(n, RESCALE_CHUNK)
    width = ceil_div(n, c) * c
    num_slots = arr.shape[ba]
    count = jnp.sum(rep)
    dest = jnp.where(rep, jnp.cumsum(rep) - 1, width)  # [n] compacted position (or dropped)
    slots = jnp.full((width,), num_slots, jnp.int32).at[dest].set(slot, mode="drop")  # [width]
    ratios = heads(jnp.ones((width,) + ratio.shape[1:], jnp.float32), 2).at[dest].set(ratio, mode="drop")  # [width, F, H]

    def body(i, a):
        s = jax.lax.dynamic_slice_in_dim(slots, i * c, c)  # [c]
        r = jax.lax.dynamic_slice_in_dim(ratios, i * c, c)  # [c, F, H]
        blk = a.at[at(ba, s, j)].get(mode="fill", fill_value=0)  # [c, F, H, T, D] uint8
        blk = quant.encode(quant.decode(blk, dtype) * r[..., None, None], dtype)  # exact: power-of-two ratios
        return a.at[at(ba, s, j)].set(blk, mode="drop")

    return jax.lax.fori_loop(0, ceil_div(count, c), body, arr)


def update_scales(arr, sarr, meta: PoolMeta, pool: PoolSpec, j, xs, slot, off, valid):
    """Scale bookkeeping of a write (see the module docstring): restart blocks whose offset 0
    is written, grow scales the new values need, rescale the older tokens of grown blocks.
    Returns (arr, sarr, per-token block scale `[n, F, H]`)."""
    ba, n = meta.block_axis, slot.shape[0]
    dtype = meta.geometry.dtype
    heads = lambda x, axis: shd.constrain_heads(x, meta.mesh, meta.kv_axes, axis)  # noqa: E731  (pools' head sharding)
    amax = jnp.stack([jnp.max(jnp.abs(heads(x, 1).astype(jnp.float32)), axis=-1) for x in xs], axis=1)  # [n, F, H]
    amax = heads(amax, 2)
    need_tok = quant.needed_scale(jnp.where(valid[:, None, None], amax, 0.0), dtype)  # [n, F, H]
    restart = jnp.where(valid & (off == 0), slot, pool.num_slots)  # [n]
    sarr = sarr.at[at(ba, restart, j)].set(jnp.zeros_like(need_tok), mode="drop")
    base = sarr.at[at(ba, slot, j)].get(mode="fill", fill_value=0.0)  # [n, F, H]
    block_need = heads(jnp.zeros((pool.num_slots,) + need_tok.shape[1:], jnp.float32), 2)
    block_need = block_need.at[slot].max(need_tok, mode="drop")  # [slots, F, H]
    need = block_need.at[slot].get(mode="fill", fill_value=0.0)  # [n, F, H]: max over the block's new tokens
    new = quant.grown_scale(base, need)  # [n, F, H]
    sarr = sarr.at[at(ba, slot, j)].set(new, mode="drop")  # duplicates carry equal values
    grew = valid & jnp.any((base > 0) & (new > base), axis=(1, 2))  # [n]
    first = jnp.full((pool.num_slots,), n, jnp.int32).at[slot].min(jnp.arange(n, dtype=jnp.int32), mode="drop")
    rep = grew & (first.at[slot].get(mode="fill", fill_value=-1) == jnp.arange(n))  # [n] one token per block
    ratio = jnp.where(new > 0, base / jnp.where(new > 0, new, 1.0), 1.0)  # [n, F, H]
    arr = _rescale_blocks(arr, ba, j, slot, rep, ratio, dtype, heads)
    return arr, sarr, new


def _write_scaled_xla(arr, sarr, meta: PoolMeta, pool: PoolSpec, j, k, v, slot_mapping):
    slot, off, valid = token_targets(slot_mapping, j, pool, meta.geometry.tokens_per_block)
    xs = tuple(shd.constrain_heads(x, meta.mesh, meta.kv_axes, 1) for x in (k, v)[: meta.geometry.kv_factor])
    arr, sarr, scale = update_scales(arr, sarr, meta, pool, j, xs, slot, off, valid)
    for f, x in enumerate(xs):
        q = quant.quantize_bytes(x, scale[:, f, :, None], meta.geometry.jnp_dtype)  # [tokens, H, D] uint8
        arr = arr.at[at(meta.block_axis, slot, j) + (f, slice(None), off, slice(None))].set(q, mode="drop")
    return arr, sarr


# ------------------------------------------------------------------------------ pallas
def _write_pallas(arr, sarr, meta: PoolMeta, pool: PoolSpec, j, k, v, slot_mapping):
    from pallas_kernels import write_pages

    slot, off, valid = token_targets(slot_mapping, j, pool, meta.geometry.tokens_per_block)
    xs = (k, v)[: meta.geometry.kv_factor]
    if sarr is not None:  # scale bookkeeping in XLA, the kernel writes the quantised bytes
        arr, sarr, scale = update_scales(arr, sarr, meta, pool, j, xs, slot, off, valid)
        xs = tuple(quant.quantize_bytes(x, scale[:, f, :, None], meta.geometry.jnp_dtype) for f, x in enumerate(xs))
    kv = jnp.stack([x.astype(arr.dtype) for x in xs], axis=1)  # [tokens, F, H, D]
    slot = jnp.where(valid, slot, -1)  # kernels skip negative slots
    layer = jnp.where(j < pool.num_layers, j, 0).reshape(1)  # [1]
    fn = functools.partial(write_pages.write_pages, layout=meta.geometry.layout)
    if meta.mesh is not None:
        rep = jax.sharding.PartitionSpec()
        fn = shd.shard_map(
            fn,
            meta.mesh,
            in_specs=(shd.pool_spec(meta.kv_axes), shd.head_sharded_spec(4, 2, meta.kv_axes), rep, rep, rep),
            out_specs=shd.pool_spec(meta.kv_axes),
        )
        kv = shd.constrain_heads(kv, meta.mesh, meta.kv_axes, 2)
    return fn(arr, kv, slot, off, layer), sarr


@functools.partial(jax.jit, static_argnames=("meta", "pool_index", "impl", "checked"), donate_argnames=("arr", "sarr"))
def _write_kv(arr, sarr, k, v, slot_mapping, j, *, meta: PoolMeta, pool_index: int, impl: str, checked: bool):
    # Only the layer's pool array (and its scales) go through jit, donated: other pools, and
    # host arrays whose memory kind a pass-through output could lose, stay outside. The
    # layer is a traced index, so every layer of a pool shares one executable.
    pool = meta.geometry.pools[pool_index]
    if checked:
        validate_write(k, v, slot_mapping, j, meta=meta, pool_index=pool_index)
    if impl == "pallas":
        return _write_pallas(arr, sarr, meta, pool, j, k, v, slot_mapping)
    if sarr is not None:
        return _write_scaled_xla(arr, sarr, meta, pool, j, k, v, slot_mapping)
    return _write_xla(arr, meta, pool, j, k, v, slot_mapping), None


def write_kv(
    pools: KVPools,
    layer: int | Int[Array, ""],
    k: Float[Array, "tokens kv_heads head_dim"],
    v: Float[Array, "tokens kv_heads head_dim"] | None,
    slot_mapping: Int[Array, " tokens"] | Int[np.ndarray, " tokens"],
    *,
    impl: str = "auto",
    pool: int | None = None,
) -> KVPools:
    """Write `k`, `v` `[tokens, kv_heads, head_dim]` of `layer` at `slot_mapping` `[tokens]`
    (`slot * tokens_per_block + offset`; negative = padding, skipped). Returns the new pools;
    the old ones are donated. K-only caches pass `v=None`. Duplicate targets are undefined.

    `layer` is a global layer index, a Python int or a traced int scalar (`lax.scan` over
    layers); a traced layer needs a single-pool geometry or `pool=` (docs/device.md).
    """
    chk.check_pools(pools)
    geo = pools.geometry
    spec, j = layers.resolve(geo, layer, pool)
    (n, h, d), _ = chk.shape_dtype("k", k, 3, "float")
    if (h, d) != (spec.num_kv_heads, spec.head_dim):
        raise ValueError(f"k.shape={tuple(k.shape)} must be [tokens, {spec.num_kv_heads}, {spec.head_dim}] for {layer=}")
    if geo.kv_factor == 2:
        if v is None:
            raise ValueError("v is required: the cache stores K and V")
        chk.shape_dtype("v", v, 3, "float")
        if tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"v.shape={tuple(v.shape)} must equal k.shape={tuple(k.shape)}")
    elif v is not None:
        raise ValueError("v must be None for a K-only cache (cache_type='self_k_only')")
    (m,), host = chk.int_array("slot_mapping", slot_mapping, 1)
    if m != n:
        raise ValueError(f"slot_mapping.shape={tuple(slot_mapping.shape)} must be [{n}] to match k")
    limit = spec.primary_blocks * geo.tokens_per_block
    if host is not None and host.size and host.max() >= limit:
        raise ValueError(f"slot_mapping has entries >= primary_blocks*tokens_per_block={limit} (the null block "
                         f"{spec.null_slot} and beyond are never written): max {int(host.max())}")
    impl = backend.resolve(impl, "write_kv", dtype=geo.jnp_dtype, head_dim=spec.head_dim,
                           tokens_per_block=geo.tokens_per_block)
    arr, sarr = pools.primary[spec.index], pools.primary_scales[spec.index]
    sm = chk.as_int32(slot_mapping)
    checked = checking.is_checked()
    if checked and not chk.any_tracer(arr, sarr, k, v, sm, j):
        checking.run_eager_checks(validate_write, k, v, sm, j, meta=pools.meta, pool_index=spec.index)
        checked = False
    arr, sarr = _write_kv(arr, sarr, k, v, sm, j, meta=pools.meta, pool_index=spec.index, impl=impl, checked=checked)
    return pools.with_primary(spec.index, arr, sarr)


# --------------------------------------------------------------------------- references
def write_kv_reference(
    pools: KVPools,
    layer: int,
    k: Float[Array, "tokens kv_heads head_dim"],
    v: Float[Array, "tokens kv_heads head_dim"] | None,
    slot_mapping: Int[Array, " tokens"],
) -> KVPools:
    """Oracle (no donation). 16/32-bit pools: one token at a time, in order, with
    dynamic_update_slice. FP8 pools: the documented scale rules, block by block in numpy."""
    if pools.is_scaled:
        return _write_scaled_reference(pools, layer, k, v, slot_mapping)
    arr, pool, j = pools.layer_view(layer)
    tpb = pools.geometry.tokens_per_block
    xs = [k]
    if pools.geometry.kv_factor == 2:
        if v is None:
            raise ValueError("v is required: this cache stores values (kv_factor 2)")
        xs.append(v)
    kv = jnp.stack([x.astype(arr.dtype) for x in xs], axis=1)  # [tokens, F, H, D]
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


def _np_pow2_at_least(y: np.ndarray) -> np.ndarray:
    m, e = np.frexp(y.astype(np.float32))
    e = np.where(m == 0.5, e - 1, e)
    return np.where(y > 0, np.ldexp(np.float32(1), e), np.float32(0)).astype(np.float32)


def _write_scaled_reference(pools: KVPools, layer: int, k, v, slot_mapping) -> KVPools:
    pool, j = pools.locate(layer)
    geo = pools.geometry
    tpb, dtype = geo.tokens_per_block, geo.jnp_dtype
    q = np.array(jnp.copy(pools.primary[pool.index])).view(dtype)  # [..., F, H, T, D] fp8
    scales = pools.primary_scales[pool.index]
    assert scales is not None  # an FP8 pool always has its block scales
    s = np.array(jnp.copy(scales))  # [..., F, H]
    if pools.block_axis == 1:
        q, s = np.swapaxes(q, 0, 1), np.swapaxes(s, 0, 1)  # block axis first
    xs = np.stack([np.asarray(x, np.float32) for x in (k, v)[: geo.kv_factor]], axis=1)  # [n, F, H, D]
    sm = np.asarray(slot_mapping)
    live = np.flatnonzero(sm >= 0)
    qm = quant.qmax(dtype)
    blocks = sorted({int(sm[t]) // tpb for t in live})
    for b in blocks:
        toks = [t for t in live if sm[t] // tpb == b]
        restart = any(sm[t] % tpb == 0 for t in toks)
        base = np.zeros_like(s[b, j]) if restart else s[b, j]  # [F, H]
        need = _np_pow2_at_least(np.max(np.abs(xs[toks]), axis=-1).max(axis=0) / qm)  # [F, H]
        new = np.where(need > base, quant.HEADROOM * need, base).astype(np.float32)
        if not restart:
            ratio = np.where(new > 0, base / np.where(new > 0, new, 1), 1).astype(np.float32)
            q[b, j] = (q[b, j].astype(np.float32) * ratio[..., None, None]).astype(q.dtype)
        s[b, j] = new
        for t in toks:
            inv = np.where(new > 0, 1 / np.where(new > 0, new, 1), 0)[..., None]  # [F, H, 1]
            q[b, j, :, :, sm[t] % tpb] = np.clip(xs[t] * inv, -qm, qm).astype(q.dtype)
    if pools.block_axis == 1:
        q, s = np.swapaxes(q, 0, 1), np.swapaxes(s, 0, 1)
    q = np.ascontiguousarray(q).view(np.uint8)
    arr = pools.primary[pool.index]
    return pools.with_primary(pool.index, jax.device_put(q, arr.sharding), jax.device_put(s, scales.sharding))
