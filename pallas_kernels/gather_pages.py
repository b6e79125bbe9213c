"""Gather pages: K/V of one layer, contiguous per request, read through a block table.

Output per field: `[batch, max_blocks * T, kv_heads, head_dim]`, zero at positions >= seq_len.
`layer` is a `[1]` int32 array (the index inside the pool; it may be traced). Tables must
already be safe (entries in `[0, num_slots)`): `kvjax.device.gather` maps bad entries to the
null slot first. With `scales` (FP8 pools, whose arrays hold uint8 bit patterns of
`value_dtype`; scales `[slots, L, F, H]` or `[L, slots, F, H]`) every page is viewed as fp8,
multiplied by its block scale and comes out as `out_dtype`.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels._common import fp8_values, on_gpu, page_ref


def _portable_kernel(tbl_ref: Any, lens_ref: Any, layer_ref: Any, pool_ref: Any, *refs: Any, layout: str, tpb: int,
                     fields: int, scaled: bool, value_dtype: DTypeLike | None) -> None:
    scale_ref: Any = refs[0] if scaled else None  # a Pallas ref (untyped), or None
    out_refs = refs[1:] if scaled else refs
    b = pl.program_id(0)
    seq_len = lens_ref[b]
    layer = layer_ref[0]
    num_blocks = tbl_ref.shape[1]

    def body(m: jax.Array, carry: int) -> int:
        slot = tbl_ref[b, m]
        idx = (slot, layer) if layout == "block_first" else (layer, slot)
        pos = m * tpb + jax.lax.broadcasted_iota(jnp.int32, (tpb, 1, 1), 0)  # [T, 1, 1]
        for f, out_ref in enumerate(out_refs):
            page = pool_ref[idx + (f,)]  # [H, T, D]
            if scaled:
                page = fp8_values(page, value_dtype)
                page = page * scale_ref[idx + (f,)][:, None, None]  # [H, T, D]
            page = jnp.transpose(page, (1, 0, 2)).astype(out_ref.dtype)  # [T, H, D]
            out_ref[0, pl.ds(m * tpb, tpb)] = jnp.where(pos < seq_len, page, jnp.zeros((), page.dtype))
        return carry

    jax.lax.fori_loop(0, num_blocks, body, 0)


def gather_pages_portable(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    layer: Int[Array, " 1"],
    scales: Float[Array, "a b fields kv_heads"] | None = None,
    *,
    layout: str,
    out_dtype: DTypeLike | None = None,
    value_dtype: DTypeLike | None = None,
    interpret: bool = True,
) -> tuple[Shaped[Array, "batch positions kv_heads head_dim"], ...]:
    """pallas_call, grid over the batch; pool, scales and table are whole-array refs."""
    f_, h, t, d = pool.shape[2:]
    b, m = block_table.shape
    out_dtype = jnp.dtype(pool.dtype if out_dtype is None else out_dtype)
    out_shape = [jax.ShapeDtypeStruct((b, m * t, h, d), out_dtype) for _ in range(f_)]
    whole = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    inputs = (block_table, seq_lens, layer, pool) + (() if scales is None else (scales,))
    return tuple(pl.pallas_call(
        functools.partial(_portable_kernel, layout=layout, tpb=t, fields=f_, scaled=scales is not None,
                          value_dtype=value_dtype),
        grid=(b,),
        in_specs=[whole(x) for x in inputs],
        out_specs=[pl.BlockSpec((1, m * t, h, d), lambda i: (i, 0, 0, 0)) for _ in range(f_)],
        out_shape=out_shape,
        interpret=interpret,
    )(*inputs))


def gather_pages_mgpu(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    layer: Int[Array, " 1"],
    *,
    layout: str,
    interpret: Any = None,
) -> tuple[Shaped[Array, "batch positions kv_heads head_dim"], ...]:
    """Mosaic GPU: one CTA per (request, block). Scalar loads of the layer and the table pick the slot,
    a TMA copy brings `[H, T, D]` into shared memory and per-head TMA stores write it to
    `[T, D]` strided rows of the output. Blocks past seq_len read the zero null slot
    instead (the last table column is never needed for them); the one partial block gets
    its tail rows overwritten with zeros."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f_, h, t, d = pool.shape[2:]
    b, m = block_table.shape
    null_slot = pool.shape[0 if layout == "block_first" else 1] - 1
    zeros = jnp.zeros((t, d), pool.dtype)

    def body(tbl: Any, lens: Any, lay: Any, pool_g: Any, zeros_g: Any, *rest: Any) -> None:
        out_refs, (smem, zsmem, bar) = rest[:f_], rest[f_:]
        layer = lay[0]
        i = jax.lax.axis_index("b")
        blk = jax.lax.axis_index("m")
        seq_len = lens[i]
        start = blk * t
        valid = jnp.clip(seq_len - start, 0, t)  # live tokens of this block
        slot = jnp.where(valid > 0, tbl[i, blk], null_slot)
        plgpu.copy_gmem_to_smem(zeros_g, zsmem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        for f, out in enumerate(out_refs):
            plgpu.copy_gmem_to_smem(page_ref(pool_g, layout, slot, layer, f), smem, bar.at[1])
            plgpu.barrier_wait(bar.at[1])
            for hh in range(h):
                plgpu.copy_smem_to_gmem(smem.at[hh], out.at[i, pl.ds(start, t), hh])
            plgpu.wait_smem_to_gmem(0)

            @pl.when((valid > 0) & (valid < t))
            def _zero_tail() -> None:
                @pl.loop(valid, t)
                def _(r: Any) -> None:
                    for hh in range(h):
                        # pl.when / pl.loop trace their bodies at once, inside this iteration
                        plgpu.copy_smem_to_gmem(zsmem.at[pl.ds(r, 1)], out.at[i, pl.ds(start + r, 1), hh])  # noqa: B023

                plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct((b, m * t, h, d), pool.dtype) for _ in range(f_)]
    return tuple(plgpu.kernel(
        body,
        out_type=out_type,
        grid=(b, m),
        grid_names=("b", "m"),
        scratch_types=(plgpu.SMEM((h, t, d), pool.dtype), plgpu.SMEM((t, d), pool.dtype),
                       plgpu.Barrier(num_barriers=2)),
        interpret=interpret,
    )(block_table, seq_lens, layer, pool, zeros))


def dequantize_pages(
    pages: Shaped[Array, "batch positions kv_heads head_dim"],
    scales: Float[Array, "a b fields kv_heads"],
    block_table: Int[Array, "batch blocks"],
    layer: Int[Array, " 1"],
    field: int,
    *,
    layout: str,
    out_dtype: DTypeLike,
    value_dtype: DTypeLike | None,
) -> Float[Array, "batch positions kv_heads head_dim"]:
    """Epilogue of the Mosaic GPU gather on FP8 pools: view the gathered bytes as fp8 and
    multiply them by their block scales (an XLA fusion over the kernel's output; the kernel
    moves the bytes)."""
    tpb = pages.shape[1] // block_table.shape[1]
    idx = (block_table, layer[0]) if layout == "block_first" else (layer[0], block_table)
    s = scales[idx + (field,)]  # [batch, blocks, H]
    s = jnp.repeat(s, tpb, axis=1)  # [batch, positions, H]
    values = fp8_values(pages, value_dtype)
    return (values * s[..., None]).astype(out_dtype)


def gather_pages(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    layer: Int[Array, " 1"],
    scales: Float[Array, "a b fields kv_heads"] | None = None,
    *,
    layout: str,
    out_dtype: DTypeLike | None = None,
    value_dtype: DTypeLike | None = None,
) -> tuple[Shaped[Array, "batch positions kv_heads head_dim"], ...]:
    """The Mosaic GPU kernel (plus a dequantising epilogue for FP8) on a GPU, the portable kernel elsewhere."""
    out_dtype = jnp.dtype(pool.dtype if out_dtype is None else out_dtype)
    if not on_gpu():
        return gather_pages_portable(pool, block_table, seq_lens, layer, scales, layout=layout, out_dtype=out_dtype,
                                     value_dtype=value_dtype)
    pages = gather_pages_mgpu(pool, block_table, seq_lens, layer, layout=layout)
    if scales is None:
        return tuple(p.astype(out_dtype) for p in pages)
    return tuple(dequantize_pages(p, scales, block_table, layer, f, layout=layout, out_dtype=out_dtype,
                                  value_dtype=value_dtype) for f, p in enumerate(pages))


def gather_pages_reference(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    block_table: Int[Array, "batch blocks"],
    seq_lens: Int[Array, " batch"],
    layer: Int[Array, " 1"],
    scales: Float[Array, "a b fields kv_heads"] | None = None,
    *,
    layout: str,
    out_dtype: DTypeLike | None = None,
    value_dtype: DTypeLike | None = None,
) -> tuple[Shaped[Array, "batch positions kv_heads head_dim"], ...]:
    """Plain jnp oracle of the kernels: index the pool by the table, dequantise, zero past seq_len."""
    out_dtype = jnp.dtype(pool.dtype if out_dtype is None else out_dtype)
    idx = (block_table, layer[0]) if layout == "block_first" else (layer[0], block_table)
    pages = pool[idx]  # [B, M, F, H, T, D]
    if scales is not None:
        pages = fp8_values(pages, value_dtype) * scales[idx][..., None, None]
    b, m, f_, h, t, d = pages.shape
    flat = jnp.transpose(pages, (2, 0, 1, 4, 3, 5)).reshape(f_, b, m * t, h, d)  # [F, B, M*T, H, D]
    live = (jnp.arange(m * t)[None, :] < seq_lens[:, None])[:, :, None, None]  # [B, M*T, 1, 1]
    return tuple(jnp.where(live, flat[f].astype(out_dtype), jnp.zeros((), out_dtype)) for f in range(f_))
