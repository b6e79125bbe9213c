"""Attention: the one visibility rule and grouped-query formula of kvjax, and
`paged_attention`, attention whose K/V are read through a block table.

Conventions (docs/device.md, "Attention"): q `[batch, q_len, heads, head_dim]` holds the
last q_len positions of each sequence (query i sits at position seq_len - q_len + i), causal
inside the chunk; query head h reads kv head h // (heads // kv_heads); key j is visible to
the query at p iff p - window < j <= p, with the layer's window; a query that sees no key
(padding: a negative position) returns zeros, never NaN. Scores, softmax and the weighted
sum run in float32 at HIGHEST precision (no TF32) whatever the input dtype; the output has
q's dtype. K-only caches (kv_factor 1) use K as V (MLA-style latent). FP8 pools are
dequantised inside the op (the XLA gather's fusion, or the kernel's page loads).

`visibility_mask` and `grouped_attention` are shared with `kvjax.models` (its dense path),
so the model's oracle and the device ops cannot drift apart.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from kvjax.device import _checks as chk
from kvjax.device import backend, layers, quant
from kvjax.device import sharding as shd
from kvjax.device.gather import check_table, gather_kv_reference, run_table_checks, safe_table, validate_table
from kvjax.device.pools import KVPools, PoolMeta
from kvjax.device.write import at

HIGHEST = jax.lax.Precision.HIGHEST


def query_positions(seq_lens: Int[Array, " batch"], q_len: int) -> Int[Array, "batch q_len"]:
    """Position of each query: the last `q_len` positions of each sequence."""
    return seq_lens[:, None].astype(jnp.int32) - q_len + jnp.arange(q_len, dtype=jnp.int32)[None, :]


def visibility_mask(q_positions: Int[Array, "batch q_len"], k_positions: Int[Array, "batch keys"],
                    window: int) -> Bool[Array, "batch q_len keys"]:
    """Key at `k_positions[b, s]` is visible to the query at `q_positions[b, t]` iff
    `q - window < k <= q` (a global layer has `window >= max_seq_len`)."""
    q = q_positions[:, :, None]  # [B, T, 1]
    k = k_positions[:, None, :]  # [B, 1, S]
    return (k <= q) & (k > q - window)  # [B, T, S]


def grouped_attention(q: Float[Array, "batch q_len heads head_dim"], k: Float[Array, "batch keys kv_heads head_dim"],
                      v: Float[Array, "batch keys kv_heads head_dim"], mask: Bool[Array, "batch q_len keys"],
                      scale: float) -> Float[Array, "batch q_len heads head_dim"]:
    """Softmax attention with kv-head groups (query head n reads kv head n // G), in float32
    at HIGHEST precision. A query that sees no key gets zeros, never NaN."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, kv_heads, n // kv_heads, h)  # [B, T, K, G, H]
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32), precision=HIGHEST) * scale  # [B, K, G, T, S]
    visible = mask[:, None, None, :, :]  # [B, 1, 1, T, S]
    logits = jnp.where(visible, logits, -jnp.inf)  # [B, K, G, T, S]
    peak = jnp.max(logits, axis=-1, keepdims=True)  # [B, K, G, T, 1]
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.where(visible, jnp.exp(logits - peak), 0.0)  # [B, K, G, T, S]
    denom = jnp.sum(weights, axis=-1, keepdims=True)  # [B, K, G, T, 1]
    probs = weights / jnp.where(denom > 0, denom, 1.0)  # [B, K, G, T, S]
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32), precision=HIGHEST)  # [B, T, K, G, H]
    return out.reshape(b, t, n, h).astype(q.dtype)  # [B, T, N, H]


def dense_attention(q: Float[Array, "batch q_len heads head_dim"], k: Float[Array, "batch keys kv_heads head_dim"],
                    v: Float[Array, "batch keys kv_heads head_dim"], seq_lens: Int[Array, " batch"], *, scale: float,
                    window: int) -> Float[Array, "batch q_len heads head_dim"]:
    """Grouped-query attention of q over contiguous k, v (key s at position s)."""
    b, ql = q.shape[:2]
    kpos = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=jnp.int32), (b, k.shape[1]))  # [B, S]
    mask = visibility_mask(query_positions(seq_lens, ql), kpos, window)  # [B, Q, S]
    return grouped_attention(q, k, v, mask, scale)


#: Bytes of pages (one field, as the dots read them) or of scores one step of the XLA path's
#: column loop holds, on a CPU: enough to amortise a loop step, few enough that a step's pages
#: and scores stay in cache (1 MiB: measured fastest among 128 KiB - 8 MiB). Read when an op is traced.
CHUNK_BYTES = 1 << 20
#: The same on an accelerator (FP8 pools take the XLA path on GPUs), where every step costs its
#: kernel launches: steps large enough to amortise them, small enough that the columns a step
#: reads past a short row's end stay cheap (an engine's tables are all `table_width` wide: with
#: 256 MiB a batch-8 decode step read its whole 128-column table whatever its rows' lengths,
#: 32x the short rows' own columns; 16 MiB is about a loop step's launch cost in reads on an
#: H100/H200). NOT measured on a GPU yet: gpu_check's `kernels` row times the step budgets.
CHUNK_BYTES_ACCELERATOR = 16 << 20


def chunk_bytes_budget() -> int:
    """The step budget of the XLA path for the default backend."""
    return CHUNK_BYTES if jax.default_backend() == "cpu" else CHUNK_BYTES_ACCELERATOR


def xla_chunk_columns(batch: int, columns: int, column_bytes: int, chunk_bytes: int) -> int:
    """Table columns per step of the XLA path's online softmax: the largest power of two for
    which `batch` rows of `column_bytes` each (a column's pages of one field, or its float32
    scores if larger: a long prefill chunk) fit in `chunk_bytes`, at least one column and at
    most the table's width."""
    c = 1
    while c * 2 <= columns and batch * c * 2 * column_bytes <= chunk_bytes:
        c *= 2
    return columns if c * 2 > columns else c  # a table narrower than two steps: one step


def xla_chunk_range(seq_lens: Int[Array, " batch"], q_len: int, window: int, steps: int,
                    span: int) -> tuple[Int[Array, ""], Int[Array, ""]]:
    """Steps `[lo, hi)` (of `steps`, `span` positions each) of the column loop that can hold a
    visible key: none past the longest row, none before the oldest key a sliding window still
    shows; a row with no query at a non-negative position holds no key and bounds nothing."""
    lens = seq_lens.astype(jnp.int32)
    first = jnp.where(lens > 0, jnp.maximum(lens - q_len - window + 1, 0), steps * span)  # [B] oldest visible key
    lo = jnp.min(first) // span
    hi = jnp.minimum((jnp.max(jnp.maximum(lens, 0)) + span - 1) // span, steps)  # the table ends at step `steps`
    return lo, hi


def _attention_xla(q, arr, sarr, meta: PoolMeta, pool, j, block_table, seq_lens, scale, chunk_bytes: int):
    """Attention read from the pool chunk by chunk: a loop over steps of `C` table columns
    (`xla_chunk_columns`), each gathering `[batch, C, kv_heads, tokens, head_dim]` pages per
    field in the pool's own dtype, with an online softmax (running max, denominator and output
    in float32), so no copy of the whole K/V and no float32 copy of it exists. The loop runs only
    over steps holding a visible key (`xla_chunk_range`). Scores and the weighted sum are dots
    accumulating in float32 at HIGHEST precision. With 16-bit pages the float32 weights enter the
    weighted sum as two 16-bit terms (`w = hi + lo`, 2^-16 relative) stacked in one dot, so V is
    read once in its own dtype. FP8 pages enter the dots as their exact bfloat16 values, their
    per-block scales multiplying the scores (K) and the weights (V). Entries outside the pool,
    and a layer outside it, read the null slot (zero K/V)."""
    geo = meta.geometry
    b, ql, n, h = q.shape
    kh, tpb = pool.num_kv_heads, geo.tokens_per_block
    g, m = n // kh, block_table.shape[1]
    if m == 0:  # a table without columns holds no key
        return jnp.zeros_like(q)
    dot_dtype = jnp.promote_types(q.dtype, jnp.bfloat16 if sarr is not None else arr.dtype)
    c = xla_chunk_columns(b, m, kh * tpb * max(h * dot_dtype.itemsize, g * ql * 4), chunk_bytes)  # pages or scores
    span, steps = c * tpb, -(-m // c)  # positions per step, steps
    in_pool = j < pool.num_layers
    table = jnp.where(in_pool, safe_table(block_table, pool), pool.null_slot)  # [B, M]
    table = jnp.pad(table, ((0, 0), (0, steps * c - m)), constant_values=pool.null_slot)  # [B, steps * C]
    layer = jnp.where(in_pool, j, 0)
    q = shd.constrain_heads(q, meta.mesh, meta.kv_axes, 2)  # query heads follow their kv heads
    qg = jnp.transpose(q.astype(dot_dtype).reshape(b, ql, kh, g, h), (0, 2, 3, 1, 4))  # [B, K, G, T, H]
    qpos = query_positions(seq_lens, ql)  # [B, T]
    offsets = jnp.arange(span, dtype=jnp.int32)  # [S]

    def load(cols, f):
        index = at(meta.block_axis, cols, layer)
        x = arr[index + (f,)]  # [B, C, K, P, H] in the storage dtype
        if sarr is None:
            return x, None
        x = quant.from_bytes(x, geo.jnp_dtype).astype(jnp.bfloat16)  # exact
        return x, jnp.swapaxes(sarr[index + (f,)], 1, 2)[:, :, None, None, :, None]  # [B, K, 1, 1, C, 1]

    def step(i, carry):
        peak, denom, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, H]
        cols = jax.lax.dynamic_slice_in_dim(table, i * c, c, axis=1)  # [B, C]
        k, kscale = load(cols, 0)
        logits = jnp.einsum("bkgth,bckph->bkgtcp", qg, k.astype(dot_dtype), precision=HIGHEST,
                            preferred_element_type=jnp.float32) * scale  # [B, K, G, T, C, P]
        if kscale is not None:
            logits = logits * kscale
        logits = logits.reshape(b, kh, g, ql, span)  # [B, K, G, T, S]
        kpos = jnp.broadcast_to(i * span + offsets, (b, span))  # [B, S]
        visible = visibility_mask(qpos, kpos, pool.window)  # [B, T, S]
        if steps * c > m:  # the padding columns hold no key, whatever seq_lens says
            visible = visible & (kpos < m * tpb)[:, None, :]
        visible = visible[:, None, None]  # [B, 1, 1, T, S]
        logits = jnp.where(visible, logits, -jnp.inf)
        top = jnp.maximum(peak, jnp.max(logits, axis=-1))  # [B, K, G, T]
        top_ = jnp.where(jnp.isfinite(top), top, 0.0)
        weights = jnp.where(visible, jnp.exp(logits - top_[..., None]), 0.0)  # [B, K, G, T, S]
        rescale = jnp.exp(peak - top_)  # [B, K, G, T]; 0 while nothing was visible
        denom = denom * rescale + jnp.sum(weights, axis=-1)
        v, vscale = (k, kscale) if geo.kv_factor == 1 else load(cols, geo.kv_factor - 1)  # K-only: K is V
        weights = weights.reshape(b, kh, g, ql, c, tpb)  # [B, K, G, T, C, P]
        if vscale is not None:
            weights = weights * vscale
        if v.dtype == jnp.float32:
            terms = weights
        else:  # float32 weights as hi + lo in V's dtype: one dot, V read once, unconverted
            top16 = weights.astype(v.dtype)
            terms = jnp.concatenate([top16, (weights - top16.astype(jnp.float32)).astype(v.dtype)], axis=2)  # [B, K, 2G, T, C, P]
        out = jnp.einsum("bkgtcp,bckph->bkgth", terms, v, precision=HIGHEST,
                         preferred_element_type=jnp.float32)  # [B, K, G or 2G, T, H]
        if v.dtype != jnp.float32:
            out = out[:, :, :g] + out[:, :, g:]
        return top, denom, acc * rescale[..., None] + out

    lo, hi = xla_chunk_range(seq_lens, ql, pool.window, steps, span)
    init = (jnp.full((b, kh, g, ql), -jnp.inf, jnp.float32), jnp.zeros((b, kh, g, ql), jnp.float32),
            jnp.zeros((b, kh, g, ql, h), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(lo, hi, step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [B, K, G, T, H]; zeros where no key is visible
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, ql, n, h).astype(q.dtype)  # [B, T, N, H]


def _attention_pallas(q, arr, sarr, meta: PoolMeta, pool, j, block_table, seq_lens, scale):
    from pallas_kernels import paged_attention as pa

    in_pool = j < pool.num_layers
    table = jnp.where(in_pool, safe_table(block_table, pool), pool.null_slot)  # [batch, blocks]
    layer = jnp.where(in_pool, j, 0).reshape(1)  # [1]
    fn = functools.partial(pa.paged_attention, layout=meta.geometry.layout, scale=scale, window=pool.window,
                           value_dtype=meta.geometry.jnp_dtype)
    args = (q, arr, table, seq_lens, layer) + (() if sarr is None else (sarr,))
    if meta.mesh is not None:
        rep = jax.sharding.PartitionSpec()
        qspec = shd.head_sharded_spec(4, 2, meta.kv_axes)
        specs = (qspec, shd.pool_spec(meta.kv_axes), rep, rep, rep) + (() if sarr is None else (shd.scale_spec(meta.kv_axes),))
        fn = shd.shard_map(fn, meta.mesh, in_specs=specs, out_specs=qspec)
        args = (shd.constrain_heads(q, meta.mesh, meta.kv_axes, 2),) + args[1:]
    return fn(*args)


@functools.partial(jax.jit, static_argnames=("meta", "pool_index", "scale", "impl", "checked", "chunk_bytes"))
def _paged_attention(q, arr, sarr, block_table, seq_lens, j, *, meta: PoolMeta, pool_index: int, scale: float, impl: str,
                     checked: bool, chunk_bytes: int):
    pool = meta.geometry.pools[pool_index]
    if checked:
        validate_table(block_table, seq_lens, j, meta=meta, pool_index=pool_index, op="paged_attention")
    if impl == "pallas":
        return _attention_pallas(q, arr, sarr, meta, pool, j, block_table, seq_lens, scale)
    return _attention_xla(q, arr, sarr, meta, pool, j, block_table, seq_lens, scale, chunk_bytes)


def paged_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    pools: KVPools,
    layer: int | Int[Array, ""],
    block_table: Int[Array, "batch blocks"] | Int[np.ndarray, "batch blocks"],
    seq_lens: Int[Array, " batch"] | Int[np.ndarray, " batch"],
    *,
    scale: float | None = None,
    impl: str = "auto",
    pool: int | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Attention of q `[batch, q_len, heads, head_dim]` (the last q_len positions of each
    sequence) over the paged K/V of `layer`; returns `[batch, q_len, heads, head_dim]`.
    `scale` defaults to `1 / sqrt(head_dim)`; `layer` may be traced (see `write_kv`)."""
    chk.check_pools(pools)
    spec, j = layers.resolve(pools.geometry, layer, pool)
    check_table(pools, spec, block_table, seq_lens)
    (b, ql, hq, d), _ = chk.shape_dtype("q", q, 4, "float")
    if b != block_table.shape[0]:
        raise ValueError(f"q.shape={tuple(q.shape)} batch must match block_table.shape={tuple(block_table.shape)}")
    if d != spec.head_dim or hq % spec.num_kv_heads:
        raise ValueError(
            f"q.shape={tuple(q.shape)} needs head_dim={spec.head_dim} and heads a multiple of kv_heads={spec.num_kv_heads}"
        )
    if ql < 1:
        raise ValueError(f"q_len={ql} must be >= 1")
    scale = chk.finite_scale(1.0 / math.sqrt(d) if scale is None else scale)
    impl = backend.resolve(impl, "paged_attention", dtype=pools.geometry.jnp_dtype, head_dim=spec.head_dim,
                           tokens_per_block=pools.geometry.tokens_per_block)
    arr, sarr = pools.primary[spec.index], pools.primary_scales[spec.index]
    table, lens = chk.as_int32(block_table), chk.as_int32(seq_lens)
    checked = run_table_checks(pools, spec, (arr, sarr, q), table, lens, j, "paged_attention")
    return _paged_attention(q, arr, sarr, table, lens, j, meta=pools.meta, pool_index=spec.index, scale=scale,
                            impl=impl, checked=checked, chunk_bytes=chunk_bytes_budget() if impl == "xla" else 0)


def paged_attention_reference(
    q: Float[Array, "batch q_len heads head_dim"],
    pools: KVPools,
    layer: int,
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    *,
    scale: float | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Oracle: the reference gather (dequantised to float32), kv heads repeated per query
    head, a plain masked softmax. Shares only `visibility_mask` (the convention itself)."""
    k, v = gather_kv_reference(pools, layer, block_table, seq_lens, dtype=jnp.float32)
    v = k if v is None else v
    b, ql, hq, d = q.shape
    g = hq // k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    window = pools.geometry.layer_windows[layer]
    kr = jnp.repeat(k, g, axis=2)  # [B, S, Hq, D]
    vr = jnp.repeat(v, g, axis=2)  # [B, S, Hq, D]
    s = jnp.einsum("bqhd,bshd->bhqs", q.astype(jnp.float32), kr, precision=HIGHEST) * scale  # [B, Hq, Q, S]
    kpos = jnp.broadcast_to(jnp.arange(k.shape[1]), (b, k.shape[1]))  # [B, S]
    vis = visibility_mask(query_positions(seq_lens, ql), kpos, window)  # [B, Q, S]
    p = jax.nn.softmax(jnp.where(vis[:, None], s, -jnp.inf), axis=-1)
    p = jnp.where(vis[:, None], p, 0.0)  # rows with no visible key: nan -> 0
    o = jnp.einsum("bhqs,bshd->bqhd", jnp.nan_to_num(p), vr, precision=HIGHEST)
    return o.astype(q.dtype)
