"""Paged attention: online-softmax attention that reads K/V pages straight from the pool.

One program per (request, kv head) handles all `q_len * G` query rows of that kv head
(G = heads // kv_heads), so each page is read once for the whole group. Only the blocks that
can hold visible keys are visited: from the window's first key to seq_len. Conventions as
`kvjax.device.attention`: query row r is query i = r // G at position seq_len - q_len + i;
key j visible iff p - window < j <= p; rows with no visible key return zeros.
`layer` is a `[1]` int32 array (the index inside the pool; it may be traced); tables must be
safe (`kvjax.device.attention` maps bad entries to the null slot first). The portable kernel
takes FP8 pools with their `scales` and dequantises each page as it loads it.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels._common import fp8_values, on_gpu
from pallas_kernels.tuning import DEFAULT_ATTENTION_TUNING, AttentionTuning

HIGHEST = jax.lax.Precision.HIGHEST
_NEG = -1e30  # finite "minus infinity": keeps exp(m_old - m_new) free of nan


def _group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B, Q, Hq, D] -> [B, Hkv, Q*G, D] (row r = query r // G, head kv*G + r % G)."""
    b, ql, hq, d = q.shape
    g = hq // kv_heads
    return jnp.transpose(q.reshape(b, ql, kv_heads, g, d), (0, 2, 1, 3, 4)).reshape(b, kv_heads, ql * g, d)


def _ungroup(o: jax.Array, q_shape: tuple[int, ...]) -> jax.Array:
    b, ql, hq, d = q_shape
    hkv = o.shape[1]
    return jnp.transpose(o.reshape(b, hkv, ql, hq // hkv, d), (0, 2, 1, 3, 4)).reshape(q_shape)


def _block_range(seq_len: jax.Array, q_len: int, window: int, tpb: int, max_blocks: int) -> tuple[jax.Array, jax.Array]:
    first_key = jnp.maximum(seq_len - q_len - window + 1, 0)
    lo = first_key // tpb
    hi = jnp.minimum((seq_len + tpb - 1) // tpb, max_blocks)
    return lo, hi


def _portable_kernel(tbl_ref: Any, lens_ref: Any, layer_ref: Any, q_ref: Any, pool_ref: Any, *refs: Any, layout: str,
                     scale: float, window: int, q_len: int, group: int, scaled: bool, value_dtype: DTypeLike | None) -> None:
    scale_ref: Any = refs[0] if scaled else None  # a Pallas ref (untyped), or None
    o_ref = refs[-1]
    b, kh = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    seq_len = lens_ref[b]
    tpb = pool_ref.shape[4]
    fv = pool_ref.shape[2] - 1  # V field (K itself for K-only caches)
    q = q_ref[0, 0].astype(jnp.float32)  # [R, D]
    rows = q.shape[0]
    qpos = seq_len - q_len + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group  # [R, 1]
    lo, hi = _block_range(seq_len, q_len, window, tpb, tbl_ref.shape[1])

    def body(m: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        acc, m_i, l_i = carry
        slot = tbl_ref[b, m]
        idx = (slot, layer) if layout == "block_first" else (layer, slot)
        k, v = pool_ref[idx + (0, kh)], pool_ref[idx + (fv, kh)]  # [T, D] each
        if scaled:  # FP8 (uint8 bit patterns): view as fp8, dequantise with the block scale
            k = fp8_values(k, value_dtype) * scale_ref[idx + (0, kh)]
            v = fp8_values(v, value_dtype) * scale_ref[idx + (fv, kh)]
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=HIGHEST) * scale  # [R, T]
        kpos = m * tpb + jax.lax.broadcasted_iota(jnp.int32, (1, tpb), 1)  # [1, T]
        vis = (kpos <= qpos) & (kpos > qpos - window)  # [R, T]
        s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m_i, s.max(axis=1, keepdims=True))  # [R, 1]
        p = jnp.where(vis, jnp.exp(s - m_new), 0.0)  # [R, T]
        alpha = jnp.exp(m_i - m_new)  # [R, 1]
        acc = acc * alpha + jax.lax.dot(p, v, precision=HIGHEST)  # [R, D]
        return acc, m_new, l_i * alpha + p.sum(axis=1, keepdims=True)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((rows, 1), _NEG, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
    acc, _, l_i = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[0, 0] = jnp.where(l_i > 0, acc / jnp.where(l_i > 0, l_i, 1.0), 0.0).astype(o_ref.dtype)


def paged_attention_portable(
    q: Float[Array, "batch q_len heads head_dim"],
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    layer: Int[Array, " 1"],
    scales: Float[Array, "a b fields kv_heads"] | None = None,
    *,
    layout: str,
    scale: float,
    window: int,
    value_dtype: DTypeLike | None = None,
    interpret: bool = True,
) -> Float[Array, "batch q_len heads head_dim"]:
    """pallas_call, grid over (request, kv head); pool, scales and tables are whole-array refs."""
    b, ql, hq, d = q.shape
    hkv = pool.shape[3]
    qg = _group_queries(q, hkv)  # [B, Hkv, R, D]
    rows = qg.shape[2]
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, h: (0,) * x.ndim)  # noqa: E731
    extra = () if scales is None else (scales,)
    out = pl.pallas_call(
        functools.partial(_portable_kernel, layout=layout, scale=scale, window=window, q_len=ql, group=hq // hkv,
                          scaled=scales is not None, value_dtype=value_dtype),
        grid=(b, hkv),
        in_specs=[whole(block_table), whole(seq_lens), whole(layer),
                  pl.BlockSpec((1, 1, rows, d), lambda i, h: (i, h, 0, 0)),
                  whole(pool)] + [whole(x) for x in extra],
        out_specs=pl.BlockSpec((1, 1, rows, d), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        interpret=interpret,
    )(block_table, seq_lens, layer, qg, pool, *extra)
    return _ungroup(out, q.shape)


def paged_attention_reference(
    q: Float[Array, "batch q_len heads head_dim"],
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    layer: Int[Array, " 1"],
    scales: Float[Array, "a b fields kv_heads"] | None = None,
    *,
    layout: str,
    scale: float,
    window: int,
    value_dtype: DTypeLike | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Plain jnp oracle of the kernels: gather every table page, dequantise, masked softmax in f32."""
    b, ql, hq, d = q.shape
    idx = (block_table, layer[0]) if layout == "block_first" else (layer[0], block_table)
    pages = pool[idx]  # [B, M, F, H, T, D]
    if scales is not None:
        pages = fp8_values(pages, value_dtype) * scales[idx][..., None, None]
    pages = pages.astype(jnp.float32)
    m, f_, hkv, t = pages.shape[1], pages.shape[2], pages.shape[3], pages.shape[4]
    kv = jnp.transpose(pages, (0, 2, 1, 4, 3, 5)).reshape(b, f_, m * t, hkv, d)  # [B, F, S, H, D]
    k = jnp.repeat(kv[:, 0], hq // hkv, axis=2)  # [B, S, Hq, D]
    v = jnp.repeat(kv[:, f_ - 1], hq // hkv, axis=2)  # [B, S, Hq, D]
    s = jnp.einsum("bqhd,bshd->bhqs", q.astype(jnp.float32), k, precision=HIGHEST) * scale  # [B, Hq, Q, S]
    qpos = seq_lens[:, None] - ql + jnp.arange(ql)[None, :]  # [B, Q]
    kpos = jnp.arange(m * t)  # [S]
    vis = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] > qpos[:, :, None] - window)  # [B, Q, S]
    s = jnp.where(vis[:, None], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(jnp.where(vis[:, None], s, _NEG), axis=-1, keepdims=True))  # [B, Hq, Q, S]
    denom = p.sum(axis=-1, keepdims=True)
    out = jnp.einsum("bhqs,bshd->bqhd", p / jnp.where(denom > 0, denom, 1.0), v, precision=HIGHEST)  # [B, Q, Hq, D]
    return out.astype(q.dtype)


# ------------------------------------------------------------------------------ Mosaic GPU
def mgpu_supported(dtype: DTypeLike, head_dim: int | None, tokens_per_block: int | None,
                   tuning: AttentionTuning = DEFAULT_ATTENTION_TUNING) -> bool:
    """Shapes the Mosaic GPU kernel handles: 16-bit K/V (wgmma, f32 accumulation),
    head_dim a multiple of 64 (128-byte swizzle), pages of >= 8 tokens that tile
    `tuning.min_block_kv` (or are a multiple of it)."""
    if head_dim is None or tokens_per_block is None:
        return False
    kv = tuning.min_block_kv
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 64 == 0
            and tokens_per_block % 8 == 0 and (tokens_per_block <= kv and kv % tokens_per_block == 0
                                               or tokens_per_block % kv == 0))


def paged_attention_mgpu(
    q: Float[Array, "batch q_len heads head_dim"],
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    layer: Int[Array, " 1"],
    *,
    layout: str,
    scale: float,
    window: int,
    tuning: AttentionTuning = DEFAULT_ATTENTION_TUNING,
    interpret: Any = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Mosaic GPU, one warpgroup per (request, kv head, `tuning.block_q`-row query tile).

    Each step TMA-loads `pages_per_step` pages of K and V (slots from scalar loads of the
    block table) into swizzled shared memory, double-buffered so the next step's copies fly
    while this step computes; QK^T and PV run on wgmma with f32 accumulators and the online
    softmax runs in registers (f32). Pages outside [window start, seq_len) are never loaded.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, ql, hq, d = q.shape
    hkv, tpb = pool.shape[3], pool.shape[4]
    f_ = pool.shape[2]
    group = hq // hkv
    block_q = tuning.block_q
    if not mgpu_supported(pool.dtype, d, tpb, tuning):
        raise ValueError(f"Mosaic GPU paged attention needs 16-bit K/V, head_dim % 64 == 0 and tokens_per_block "
                         f"dividing (or a multiple of) {tuning.min_block_kv}: got {pool.dtype=}, {d=}, {tpb=}")
    bk = max(tuning.min_block_kv, tpb)  # keys per step
    pps = bk // tpb  # pages per step
    null_slot = pool.shape[0 if layout == "block_first" else 1] - 1
    m = block_table.shape[1]
    m_pad = -(-m // pps) * pps
    table = jnp.pad(block_table, ((0, 0), (0, m_pad - m)), constant_values=null_slot)  # [B, m_pad]
    qg = _group_queries(q.astype(pool.dtype), hkv)  # [B, Hkv, R, D]
    rows = qg.shape[2]
    tiles = -(-rows // block_q)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, tiles * block_q - rows), (0, 0)))  # [B, Hkv, tiles*block_q, D]
    steps_total = m_pad // pps
    dtype = pool.dtype

    def page(pool_g: Any, slot: Any, layer: Any, field: int, kh: Any) -> Any:
        idx = (slot, layer, field, kh) if layout == "block_first" else (layer, slot, field, kh)
        return pool_g.at[idx]  # [T, D]

    def body(tbl: Any, lens: Any, lay: Any, q_g: Any, pool_g: Any, o_g: Any, q_smem: Any, k_smem: Any, v_smem: Any,
             q_bar: Any, k_bar: Any, v_bar: Any) -> None:
        bi, kh, tile = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("r")
        layer = lay[0]
        seq_len = lens[bi]
        first_key = jnp.maximum(seq_len - ql - window + 1, 0)
        lo = first_key // bk
        hi = jnp.minimum((seq_len + bk - 1) // bk, steps_total)

        def issue(step: Any, slot: Any) -> None:
            for p in range(pps):
                s = tbl[bi, step * pps + p]
                plgpu.copy_gmem_to_smem(page(pool_g, s, layer, 0, kh), k_smem.at[slot, pl.ds(p * tpb, tpb)], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(page(pool_g, s, layer, f_ - 1, kh), v_smem.at[slot, pl.ds(p * tpb, tpb)],
                                        v_bar.at[slot])

        plgpu.copy_gmem_to_smem(q_g.at[bi, kh, pl.ds(tile * block_q, block_q)], q_smem, q_bar)

        @pl.when(lo < hi)
        def _() -> None:
            issue(lo, 0)

        plgpu.barrier_wait(q_bar)
        row = plgpu.broadcasted_iota(jnp.int32, (block_q, bk), 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (block_q, bk), 1, layout=plgpu.Layout.WGMMA)
        qpos = seq_len - ql + jax.lax.div(row + tile * block_q, group)  # [block_q, bk]

        m_i = plgpu.layout_cast(jnp.full((block_q,), _NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((block_q, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def step_fn(step: Any, carry: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
            acc, m_i, l_i = carry
            slot = jax.lax.rem(step - lo, 2)

            @pl.when(step + 1 < hi)
            def _prefetch() -> None:
                issue(step + 1, 1 - slot)

            plgpu.barrier_wait(k_bar.at[slot])

            def qk_fn(acc_ref: Any) -> Any:
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk_fn, plgpu.ACC((block_q, bk), jnp.float32)) * scale  # [block_q, bk]
            kpos = step * bk + col
            vis = (kpos <= qpos) & (kpos > qpos - window)
            s = jnp.where(vis, s, _NEG)
            m_new = jnp.maximum(m_i, s.max(axis=1))  # [block_q]
            p = jnp.where(vis, jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)  # [block_q, bk]
            alpha = jnp.exp(m_i - m_new)
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bar.at[slot])

            def pv_fn(acc_ref: Any) -> None:
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])

            acc = pl.run_state(pv_fn)(plgpu.ACC.init(acc))
            plgpu.wgmma_wait(0)
            return acc, m_new, l_i

        acc, m_i, l_i = jax.lax.fori_loop(lo, hi, step_fn, (acc, m_i, l_i))
        l_b = jax.lax.broadcast_in_dim(l_i, (block_q, d), [0])
        out = jnp.where(l_b > 0, acc / jnp.where(l_b > 0, l_b, 1.0), 0.0)
        q_smem[...] = out.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_g.at[bi, kh, pl.ds(tile * block_q, block_q)])
        plgpu.wait_smem_to_gmem(0)

    # jax declares transform_array abstract on the transform base class; these are concrete
    tiling = plgpu.TilingTransform((8, 64))  # type: ignore[abstract]
    swizzle = plgpu.SwizzleTransform(128)  # type: ignore[abstract]
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(qg.shape, dtype),
        grid=(b, hkv, tiles),
        grid_names=("b", "h", "r"),
        scratch_types=(
            plgpu.SMEM((block_q, d), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((2, bk, d), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((2, bk, d), dtype, transforms=(tiling, swizzle)),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=pps, num_barriers=2),
            plgpu.Barrier(num_arrivals=pps, num_barriers=2),
        ),
        interpret=interpret,
    )(table, seq_lens, layer, qg, pool)
    return _ungroup(out[:, :, :rows], q.shape).astype(q.dtype)


def paged_attention(
    q: Float[Array, "batch q_len heads head_dim"],
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    layer: Int[Array, " 1"],
    scales: Float[Array, "a b fields kv_heads"] | None = None,
    *,
    layout: str,
    scale: float,
    window: int,
    value_dtype: DTypeLike | None = None,
    tuning: AttentionTuning = DEFAULT_ATTENTION_TUNING,
) -> Float[Array, "batch q_len heads head_dim"]:
    """The Mosaic GPU kernel on a GPU, the portable kernel elsewhere (FP8 pools: XLA path on GPU)."""
    if not on_gpu():
        return paged_attention_portable(q, pool, block_table, seq_lens, layer, scales, layout=layout, scale=scale,
                                        window=window, value_dtype=value_dtype)
    if scales is not None:
        raise ValueError("the Mosaic GPU attention kernel takes 16-bit K/V; FP8 pools run the XLA path (impl='xla')")
    return paged_attention_mgpu(q, pool, block_table, seq_lens, layer, layout=layout, scale=scale, window=window,
                                tuning=tuning)
