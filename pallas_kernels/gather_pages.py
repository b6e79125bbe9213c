"""Gather pages: K/V of one layer, contiguous per request, read through a block table.

Output per field: `[batch, max_blocks * T, kv_heads, head_dim]`, zero at positions >= seq_len.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import on_gpu, page_ref


def _portable_kernel(tbl_ref, lens_ref, pool_ref, *out_refs, layer: int, layout: str, tpb: int):
    b = pl.program_id(0)
    seq_len = lens_ref[b]
    num_blocks = tbl_ref.shape[1]

    def body(m, carry):
        slot = tbl_ref[b, m]
        pos = m * tpb + jax.lax.broadcasted_iota(jnp.int32, (tpb, 1, 1), 0)  # [T, 1, 1]
        for f, out_ref in enumerate(out_refs):
            page = pool_ref[(slot, layer, f) if layout == "block_first" else (layer, slot, f)]  # [H, T, D]
            page = jnp.transpose(page, (1, 0, 2))  # [T, H, D]
            out_ref[0, pl.ds(m * tpb, tpb)] = jnp.where(pos < seq_len, page, jnp.zeros((), page.dtype))
        return carry

    jax.lax.fori_loop(0, num_blocks, body, 0)


def gather_pages_portable(pool, block_table, seq_lens, *, layer: int, layout: str, interpret=True):
    """pallas_call, grid over the batch; pool and table are whole-array refs."""
    f_, h, t, d = pool.shape[2:]
    b, m = block_table.shape
    out_shape = [jax.ShapeDtypeStruct((b, m * t, h, d), pool.dtype) for _ in range(f_)]
    return tuple(pl.pallas_call(
        functools.partial(_portable_kernel, layer=layer, layout=layout, tpb=t),
        grid=(b,),
        in_specs=[pl.BlockSpec(block_table.shape, lambda i: (0, 0)),
                  pl.BlockSpec(seq_lens.shape, lambda i: (0,)),
                  pl.BlockSpec(pool.shape, lambda i: (0,) * 6)],
        out_specs=[pl.BlockSpec((1, m * t, h, d), lambda i: (i, 0, 0, 0)) for _ in range(f_)],
        out_shape=out_shape,
        interpret=interpret,
    )(block_table, seq_lens, pool))


def gather_pages_mgpu(pool, block_table, seq_lens, *, layer: int, layout: str, interpret=None):
    """Mosaic GPU: one CTA per (request, block). A scalar load of the table picks the slot,
    a TMA copy brings `[H, T, D]` into shared memory and per-head TMA stores write it to
    `[T, D]` strided rows of the output. Blocks past seq_len read the zero null slot
    instead (the last table column is never needed for them); the one partial block gets
    its tail rows overwritten with zeros."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f_, h, t, d = pool.shape[2:]
    b, m = block_table.shape
    null_slot = pool.shape[0 if layout == "block_first" else 1] - 1
    zeros = jnp.zeros((t, d), pool.dtype)

    def body(tbl, lens, pool_g, zeros_g, *rest):
        out_refs, (smem, zsmem, bar) = rest[:f_], rest[f_:]
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
            def _zero_tail():
                @pl.loop(valid, t)
                def _(r):
                    for hh in range(h):
                        plgpu.copy_smem_to_gmem(zsmem.at[pl.ds(r, 1)], out.at[i, pl.ds(start + r, 1), hh])

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
    )(block_table, seq_lens, pool, zeros))


def gather_pages(pool, block_table, seq_lens, *, layer: int, layout: str):
    if on_gpu():
        return gather_pages_mgpu(pool, block_table, seq_lens, layer=layer, layout=layout)
    return gather_pages_portable(pool, block_table, seq_lens, layer=layer, layout=layout)
