"""Write pages: scatter new tokens' K/V of one layer into their (slot, offset), in place.

`kv` is `[tokens, F, H, D]`; `slot`/`off` are `[tokens]` int32, a negative slot is padding
(skipped). The pool is updated in place when the caller donates it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import on_gpu


def _portable_kernel(slot_ref, off_ref, kv_ref, pool_in_ref, pool_ref, *, layer: int, layout: str):
    del pool_in_ref  # aliased with pool_ref
    i = pl.program_id(0)
    s, o = slot_ref[i], off_ref[i]

    @pl.when(s >= 0)
    def _():
        idx = (s, layer) if layout == "block_first" else (layer, s)
        pool_ref[idx + (slice(None), slice(None), pl.ds(o, 1), slice(None))] = kv_ref[0][:, :, None, :]


def write_pages_portable(pool, kv, slot, off, *, layer: int, layout: str, interpret=True):
    """pallas_call, grid over tokens; the whole pool is one aliased ref."""
    n = kv.shape[0]
    return pl.pallas_call(
        functools.partial(_portable_kernel, layer=layer, layout=layout),
        grid=(n,),
        in_specs=[pl.BlockSpec((n,), lambda i: (0,)), pl.BlockSpec((n,), lambda i: (0,)),
                  pl.BlockSpec((1,) + kv.shape[1:], lambda i: (i, 0, 0, 0)),
                  pl.BlockSpec(pool.shape, lambda i: (0,) * 6)],
        out_specs=pl.BlockSpec(pool.shape, lambda i: (0,) * 6),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0},
        interpret=interpret,
    )(slot, off, kv, pool)


def write_pages_mgpu(pool, kv, slot, off, *, layer: int, layout: str, interpret=None):
    """Mosaic GPU: one CTA per token; TMA-load its `[F, H, 1, D]` K/V into shared memory,
    then one TMA store per field into the `[H, 1, D]` box at (slot, layer, field, :, off).
    `plgpu.kernel` has no input_output_aliases: the pool is written through a mutable ref."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, f_, h, d = kv.shape
    kv5 = kv.reshape(n, f_, h, 1, d)

    def body(slot_g, off_g, kv_g, pool_g, smem, bar):
        i = jax.lax.axis_index("t")
        s, o = slot_g[i], off_g[i]

        @pl.when(s >= 0)
        def _():
            plgpu.copy_gmem_to_smem(kv_g.at[i], smem, bar)
            plgpu.barrier_wait(bar)
            for f in range(f_):
                idx = (s, layer, f) if layout == "block_first" else (layer, s, f)
                plgpu.copy_smem_to_gmem(smem.at[f], pool_g.at[idx + (slice(None), pl.ds(o, 1))])
            plgpu.wait_smem_to_gmem(0)

    ref = jax.new_ref(pool)
    plgpu.kernel(body, out_type=(), grid=(n,), grid_names=("t",),
                 scratch_types=(plgpu.SMEM((f_, h, 1, d), kv.dtype), plgpu.Barrier()),
                 interpret=interpret)(slot, off, kv5, ref)
    return jax.freeze(ref)


def write_pages(pool, kv, slot, off, *, layer: int, layout: str):
    if on_gpu():
        return write_pages_mgpu(pool, kv, slot, off, layer=layer, layout=layout)
    return write_pages_portable(pool, kv, slot, off, layer=layer, layout=layout)
