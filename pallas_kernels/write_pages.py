"""Write pages: scatter new tokens' K/V of one layer into their (slot, offset), in place.

`kv` is `[tokens, F, H, D]` in the pool's dtype (FP8 pools: already quantised, their scales
are kept by `kvjax.device.write`); `slot`/`off` are `[tokens]` int32, a negative slot is
padding (skipped); `layer` is a `[1]` int32 array (the index inside the pool, may be traced).
The pool is updated in place when the caller donates it.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Int, Shaped

from pallas_kernels._common import on_gpu


def _portable_kernel(slot_ref: Any, off_ref: Any, layer_ref: Any, kv_ref: Any, pool_in_ref: Any, pool_ref: Any, *,
                     layout: str) -> None:
    del pool_in_ref  # aliased with pool_ref
    i = pl.program_id(0)
    s, o, layer = slot_ref[i], off_ref[i], layer_ref[0]

    @pl.when(s >= 0)
    def _() -> None:
        idx = (s, layer) if layout == "block_first" else (layer, s)
        pool_ref[idx + (slice(None), slice(None), pl.ds(o, 1), slice(None))] = kv_ref[0][:, :, None, :]


def write_pages_portable(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    kv: Shaped[Array, "tokens fields kv_heads head_dim"],
    slot: Int[Array, " tokens"],
    off: Int[Array, " tokens"],
    layer: Int[Array, " 1"],
    *,
    layout: str,
    interpret: bool = True,
) -> Shaped[Array, "a b fields kv_heads tpb head_dim"]:
    """pallas_call, grid over tokens; the whole pool is one aliased ref."""
    n = kv.shape[0]
    return pl.pallas_call(
        functools.partial(_portable_kernel, layout=layout),
        grid=(n,),
        in_specs=[pl.BlockSpec((n,), lambda i: (0,)), pl.BlockSpec((n,), lambda i: (0,)),
                  pl.BlockSpec((1,), lambda i: (0,)),
                  pl.BlockSpec((1,) + kv.shape[1:], lambda i: (i, 0, 0, 0)),
                  pl.BlockSpec(pool.shape, lambda i: (0,) * 6)],
        out_specs=pl.BlockSpec(pool.shape, lambda i: (0,) * 6),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={4: 0},
        interpret=interpret,
    )(slot, off, layer, kv, pool)


def write_pages_mgpu(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    kv: Shaped[Array, "tokens fields kv_heads head_dim"],
    slot: Int[Array, " tokens"],
    off: Int[Array, " tokens"],
    layer: Int[Array, " 1"],
    *,
    layout: str,
    interpret: Any = None,
) -> Shaped[Array, "a b fields kv_heads tpb head_dim"]:
    """Mosaic GPU: one CTA per token; TMA-load its `[F, H, 1, D]` K/V into shared memory,
    then one TMA store per field into the `[H, 1, D]` box at (slot, layer, field, :, off).
    `plgpu.kernel` has no input_output_aliases: the pool is written through a mutable ref."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, f_, h, d = kv.shape
    kv5 = kv.reshape(n, f_, h, 1, d)

    def body(slot_g: Any, off_g: Any, lay: Any, kv_g: Any, pool_g: Any, smem: Any, bar: Any) -> None:
        i = jax.lax.axis_index("t")
        s, o, layer = slot_g[i], off_g[i], lay[0]

        @pl.when(s >= 0)
        def _() -> None:
            plgpu.copy_gmem_to_smem(kv_g.at[i], smem, bar)
            plgpu.barrier_wait(bar)
            for f in range(f_):
                idx = (s, layer, f) if layout == "block_first" else (layer, s, f)
                plgpu.copy_smem_to_gmem(smem.at[f], pool_g.at[idx + (slice(None), pl.ds(o, 1))])
            plgpu.wait_smem_to_gmem(0)

    ref = jax.new_ref(pool)
    plgpu.kernel(body, out_type=(), grid=(n,), grid_names=("t",),
                 scratch_types=(plgpu.SMEM((f_, h, 1, d), kv.dtype), plgpu.Barrier()),
                 interpret=interpret)(slot, off, layer, kv5, ref)
    return jax.freeze(ref)


def write_pages(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    kv: Shaped[Array, "tokens fields kv_heads head_dim"],
    slot: Int[Array, " tokens"],
    off: Int[Array, " tokens"],
    layer: Int[Array, " 1"],
    *,
    layout: str,
) -> Shaped[Array, "a b fields kv_heads tpb head_dim"]:
    """The Mosaic GPU kernel on a GPU, the portable kernel elsewhere."""
    if on_gpu():
        return write_pages_mgpu(pool, kv, slot, off, layer, layout=layout)
    return write_pages_portable(pool, kv, slot, off, layer, layout=layout)


def write_pages_reference(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    kv: Shaped[Array, "tokens fields kv_heads head_dim"],
    slot: Int[Array, " tokens"],
    off: Int[Array, " tokens"],
    layer: Int[Array, " 1"],
    *,
    layout: str,
) -> Shaped[Array, "a b fields kv_heads tpb head_dim"]:
    """Plain jnp oracle of the kernels (for distinct (slot, offset) pairs): one scatter, padding dropped."""
    num_slots = pool.shape[0 if layout == "block_first" else 1]
    s = jnp.where(slot >= 0, slot, num_slots)  # padding -> out of range -> dropped
    if layout == "block_first":
        return pool.at[s, layer[0], :, :, off].set(kv, mode="drop")  # advanced dims first: [tokens, F, H, D]
    return pool.at[layer[0], s, :, :, off].set(kv, mode="drop")
