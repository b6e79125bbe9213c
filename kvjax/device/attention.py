"""`paged_attention`: attention whose K/V are read through a block table.

Conventions (SPEC §4): q `[batch, q_len, heads, head_dim]` holds the last q_len positions of
each sequence (query i sits at position seq_len - q_len + i), causal inside the chunk;
query head h reads kv head h // (heads // kv_heads); key j is visible to the query at p iff
p - window < j <= p, with the layer's window from `config.layer_windows`; a query at a
negative position (padding) returns zeros. Scores, softmax and the weighted sum run in
float32 at HIGHEST precision (no TF32) whatever the input dtype; the output has q's dtype.
K-only caches (kv_factor 1) use K as V (MLA-style latent).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kvjax.device import backend
from kvjax.device import _checks as chk
from kvjax.device import sharding as shd
from kvjax.device.gather import _gather_xla, check_table, gather_kv_reference
from kvjax.device.pools import KVPools

HIGHEST = jax.lax.Precision.HIGHEST


def visibility(seq_lens, q_len: int, num_keys: int, window: int):
    """Mask `[batch, q_len, num_keys]`: key j visible to query i. Also query positions."""
    qpos = seq_lens[:, None] - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]  # [batch, q_len]
    kpos = jnp.arange(num_keys, dtype=jnp.int32)  # [keys]
    vis = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] > qpos[:, :, None] - window)
    return vis, qpos


def dense_attention(q, k, v, seq_lens, *, scale: float, window: int):
    """Grouped-query attention of q `[B, Q, Hq, D]` over contiguous k, v `[B, S, Hkv, D]`."""
    b, ql, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.astype(jnp.float32).reshape(b, ql, hkv, g, d)  # [B, Q, K, G, D]
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32), precision=HIGHEST) * scale  # [B, K, G, Q, S]
    vis, _ = visibility(seq_lens, ql, k.shape[1], window)  # [B, Q, S]
    vis = vis[:, None, None]  # [B, 1, 1, Q, S]
    m = jnp.max(jnp.where(vis, s, -jnp.inf), axis=-1, keepdims=True)  # [B, K, G, Q, 1]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m), 0.0)  # [B, K, G, Q, S]
    l = jnp.sum(p, axis=-1, keepdims=True)  # [B, K, G, Q, 1]
    o = jnp.einsum("bkgqs,bskd->bqkgd", p / jnp.where(l > 0, l, 1.0), v.astype(jnp.float32), precision=HIGHEST)
    return o.reshape(b, ql, hq, d).astype(q.dtype)  # [B, Q, Hq, D]


def _attention_xla(q, arr, meta, layer, block_table, seq_lens, scale, window):
    fields = _gather_xla(arr, meta, layer, block_table, seq_lens)  # F x [B, S, Hkv, D]
    q = shd.constrain_heads(q, meta.mesh, meta.kv_axes, 2)  # query heads follow their kv heads
    k = fields[0]
    v = fields[1] if len(fields) == 2 else fields[0]
    return dense_attention(q, k, v, seq_lens, scale=scale, window=window)


def _attention_pallas(q, arr, meta, layer, block_table, seq_lens, scale, window):
    from pallas_kernels import paged_attention as pa

    pool, j = meta.locate(layer)
    fn = functools.partial(pa.paged_attention, layer=j, layout=meta.config.layout, scale=scale, window=window)
    if meta.mesh is not None:
        rep = jax.sharding.PartitionSpec()
        qspec = shd.head_sharded_spec(4, 2, meta.kv_axes)
        fn = shd.shard_map(fn, meta.mesh, in_specs=(qspec, shd.pool_spec(meta.kv_axes), rep, rep), out_specs=qspec)
        q = shd.constrain_heads(q, meta.mesh, meta.kv_axes, 2)
    return fn(q, arr, block_table, seq_lens)


@functools.partial(jax.jit, static_argnames=("meta", "layer", "scale", "impl"))
def _paged_attention(q, arr, block_table, seq_lens, *, meta, layer, scale, impl):
    window = meta.config.layer_windows[layer]
    f = _attention_pallas if impl == "pallas" else _attention_xla
    return f(q, arr, meta, layer, block_table, seq_lens, scale, window)


def paged_attention(q, pools: KVPools, layer: int, block_table, seq_lens, *, scale: float | None = None, impl: str = "auto"):
    """Attention of q `[batch, q_len, heads, head_dim]` (the last q_len positions of each
    sequence) over the paged K/V of `layer`; returns `[batch, q_len, heads, head_dim]`."""
    chk.check_pools(pools)
    pool, _ = pools.locate(layer)
    check_table(pools, layer, block_table, seq_lens)
    (b, ql, hq, d), _ = chk.shape_dtype("q", q, 4, "float")
    if b != block_table.shape[0]:
        raise ValueError(f"q.shape={tuple(q.shape)} batch must match block_table.shape={tuple(block_table.shape)}")
    if d != pool.head_dim or hq % pool.num_kv_heads:
        raise ValueError(f"q.shape={tuple(q.shape)} needs head_dim={pool.head_dim} and heads a multiple of kv_heads={pool.num_kv_heads}")
    if ql < 1:
        raise ValueError(f"q_len={ql} must be >= 1")
    scale = float(1.0 / math.sqrt(d) if scale is None else scale)
    impl = backend.resolve(impl, "paged_attention", dtype=pools.primary[pool.index].dtype, head_dim=pool.head_dim,
                           tokens_per_block=pools.config.tokens_per_block)
    return _paged_attention(q, pools.primary[pool.index], jnp.asarray(block_table, jnp.int32),
                            jnp.asarray(seq_lens, jnp.int32), meta=pools.meta, layer=layer, scale=scale, impl=impl)


def paged_attention_reference(q, pools: KVPools, layer: int, block_table, seq_lens, *, scale: float | None = None):
    """Oracle: gather with the reference gather, repeat kv heads, plain masked softmax."""
    k, v = gather_kv_reference(pools, layer, block_table, seq_lens)
    v = k if v is None else v
    b, ql, hq, d = q.shape
    g = hq // k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    window = pools.config.layer_windows[layer]
    kr = jnp.repeat(k.astype(jnp.float32), g, axis=2)  # [B, S, Hq, D]
    vr = jnp.repeat(v.astype(jnp.float32), g, axis=2)  # [B, S, Hq, D]
    s = jnp.einsum("bqhd,bshd->bhqs", q.astype(jnp.float32), kr, precision=HIGHEST) * scale  # [B, Hq, Q, S]
    qpos = seq_lens[:, None] - ql + jnp.arange(ql)[None, :]  # [B, Q]
    j = jnp.arange(k.shape[1])
    vis = (j[None, None, :] <= qpos[..., None]) & (j[None, None, :] > qpos[..., None] - window)  # [B, Q, S]
    p = jax.nn.softmax(jnp.where(vis[:, None], s, -jnp.inf), axis=-1)
    p = jnp.where(vis[:, None], p, 0.0)  # rows with no visible key: nan -> 0
    o = jnp.einsum("bhqs,bshd->bqhd", jnp.nan_to_num(p), vr, precision=HIGHEST)
    return o.astype(q.dtype)
