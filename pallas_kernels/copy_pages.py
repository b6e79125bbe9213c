"""Copy pages: whole blocks (every layer, field, head) between a pool and a staging buffer.

`gather_blocks(pool, idx)` -> staging `[n, L, F, H, T, D]` (block axis first, whatever the
pool layout): the device half of an offload, the source half of a copy.
`scatter_blocks(pool, staging, dst, num_tokens)` writes staging block i into slot dst[i],
only its first num_tokens[i] tokens (partial copy), in place; dst < 0 is padding.
Together they run the batched intra-pool copies and the device side of tier swaps.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Int, Shaped

from pallas_kernels._common import on_gpu
from pallas_kernels.tuning import DEFAULT_COPY_TUNING, CopyTuning


def _blk(pool_ref: Any, block_axis: int, slot: Any) -> Any:
    # [L, F, H, T, D] view of one slot
    return pool_ref[slot] if block_axis == 0 else pool_ref[:, slot]


def _gather_kernel(idx_ref: Any, pool_ref: Any, out_ref: Any, *, block_axis: int) -> None:
    out_ref[0] = _blk(pool_ref, block_axis, idx_ref[pl.program_id(0)])


def gather_blocks_portable(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"], idx: Int[Array, " n"], *, block_axis: int, interpret: bool = True
) -> Shaped[Array, "n layers fields kv_heads tpb head_dim"]:
    n = idx.shape[0]
    blk = pool.shape[:block_axis] + pool.shape[block_axis + 1:]  # [L, F, H, T, D]
    return pl.pallas_call(
        functools.partial(_gather_kernel, block_axis=block_axis),
        grid=(n,),
        in_specs=[pl.BlockSpec((n,), lambda i: (0,)), pl.BlockSpec(pool.shape, lambda i: (0,) * 6)],
        out_specs=pl.BlockSpec((1,) + blk, lambda i: (i, 0, 0, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((n,) + blk, pool.dtype),
        interpret=interpret,
    )(idx, pool)


def _scatter_kernel(dst_ref: Any, num_ref: Any, stage_ref: Any, pool_in_ref: Any, pool_ref: Any, *, block_axis: int) -> None:
    del pool_in_ref  # aliased with pool_ref
    i = pl.program_id(0)
    d, n = dst_ref[i], num_ref[i]

    @pl.when(d >= 0)
    def _() -> None:
        new = stage_ref[0]  # [L, F, H, T, D]
        old = _blk(pool_ref, block_axis, d)
        tok = jax.lax.broadcasted_iota(jnp.int32, new.shape, 3)
        merged = jnp.where(tok < n, new, old)
        if block_axis == 0:
            pool_ref[d] = merged
        else:
            pool_ref[:, d] = merged


def scatter_blocks_portable(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    staging: Shaped[Array, "n layers fields kv_heads tpb head_dim"],
    dst: Int[Array, " n"],
    num_tokens: Int[Array, " n"],
    *,
    block_axis: int,
    interpret: bool = True,
) -> Shaped[Array, "a b fields kv_heads tpb head_dim"]:
    n = staging.shape[0]
    return pl.pallas_call(
        functools.partial(_scatter_kernel, block_axis=block_axis),
        grid=(n,),
        in_specs=[pl.BlockSpec((n,), lambda i: (0,)), pl.BlockSpec((n,), lambda i: (0,)),
                  pl.BlockSpec((1,) + staging.shape[1:], lambda i: (i, 0, 0, 0, 0, 0)),
                  pl.BlockSpec(pool.shape, lambda i: (0,) * 6)],
        out_specs=pl.BlockSpec(pool.shape, lambda i: (0,) * 6),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0},
        interpret=interpret,
    )(dst, num_tokens, staging, pool)


def _chunking(pool: Any, block_axis: int, tuning: CopyTuning) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split a block `[L, F, H, T, D]` into CTA chunks: `[H, T, D]` per (layer, field) when it
    fits `tuning.smem_chunk_bytes`, else `[T, D]` per (layer, field, head)."""
    blk = pool.shape[:block_axis] + pool.shape[block_axis + 1:]
    l_, f_, h, t, d = blk
    if h * t * d * pool.dtype.itemsize <= tuning.smem_chunk_bytes:
        return (l_, f_), (h, t, d)
    return (l_, f_, h), (t, d)


def _chunk(pool_g: Any, block_axis: int, slot: Any, outer: tuple) -> Any:
    idx = (slot,) + outer if block_axis == 0 else (outer[0], slot) + outer[1:]
    return pool_g.at[idx]


def _unravel(c: Any, dims: tuple[int, ...]) -> tuple[Any, ...]:
    out = []
    for size in reversed(dims):
        out.append(jax.lax.rem(c, size))
        c = c // size
    return tuple(reversed(out))


def gather_blocks_mgpu(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"], idx: Int[Array, " n"], *, block_axis: int,
    tuning: CopyTuning = DEFAULT_COPY_TUNING, interpret: Any = None
) -> Shaped[Array, "n layers fields kv_heads tpb head_dim"]:
    """Mosaic GPU: one CTA per (entry, chunk): scalar-load the slot, TMA chunk in, TMA out."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = idx.shape[0]
    outer, chunk = _chunking(pool, block_axis, tuning)
    blk = pool.shape[:block_axis] + pool.shape[block_axis + 1:]

    def body(idx_g: Any, pool_g: Any, out_g: Any, smem: Any, bar: Any) -> None:
        i = jax.lax.axis_index("n")
        o = _unravel(jax.lax.axis_index("c"), outer)
        plgpu.copy_gmem_to_smem(_chunk(pool_g, block_axis, idx_g[i], o), smem, bar)
        plgpu.barrier_wait(bar)
        plgpu.copy_smem_to_gmem(smem, out_g.at[(i,) + o])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((n,) + blk, pool.dtype),
                        grid=(n, math.prod(outer)), grid_names=("n", "c"),
                        scratch_types=(plgpu.SMEM(chunk, pool.dtype), plgpu.Barrier()),
                        interpret=interpret)(idx, pool)


def scatter_blocks_mgpu(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    staging: Shaped[Array, "n layers fields kv_heads tpb head_dim"],
    dst: Int[Array, " n"],
    num_tokens: Int[Array, " n"],
    *,
    block_axis: int,
    tuning: CopyTuning = DEFAULT_COPY_TUNING,
    interpret: Any = None,
) -> Shaped[Array, "a b fields kv_heads tpb head_dim"]:
    """Mosaic GPU: one CTA per (entry, chunk): TMA the staged chunk in, then one TMA store of
    the whole chunk (full blocks) or one per live token row (partial copies)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = staging.shape[0]
    outer, chunk = _chunking(pool, block_axis, tuning)
    tpb = chunk[-2]

    def body(dst_g: Any, num_g: Any, stage_g: Any, pool_g: Any, smem: Any, bar: Any) -> None:
        i = jax.lax.axis_index("n")
        o = _unravel(jax.lax.axis_index("c"), outer)
        d, num = dst_g[i], num_g[i]

        @pl.when(d >= 0)
        def _() -> None:
            plgpu.copy_gmem_to_smem(stage_g.at[(i,) + o], smem, bar)
            plgpu.barrier_wait(bar)
            dst_chunk = _chunk(pool_g, block_axis, d, o)

            @pl.when(num >= tpb)
            def _full() -> None:
                plgpu.copy_smem_to_gmem(smem, dst_chunk)

            @pl.when(num < tpb)
            def _partial() -> None:
                @pl.loop(0, num)
                def _(r: Any) -> None:
                    if len(chunk) == 3:  # TMA needs contiguous SMEM: one [1, D] row per head
                        for hh in range(chunk[0]):
                            plgpu.copy_smem_to_gmem(smem.at[hh, pl.ds(r, 1)], dst_chunk.at[hh, pl.ds(r, 1)])
                    else:
                        plgpu.copy_smem_to_gmem(smem.at[pl.ds(r, 1)], dst_chunk.at[pl.ds(r, 1)])

            plgpu.wait_smem_to_gmem(0)

    ref = jax.new_ref(pool)
    plgpu.kernel(body, out_type=(), grid=(n, math.prod(outer)), grid_names=("n", "c"),
                 scratch_types=(plgpu.SMEM(chunk, pool.dtype), plgpu.Barrier()),
                 interpret=interpret)(dst, num_tokens, staging, ref)
    return jax.freeze(ref)


def gather_blocks(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"], idx: Int[Array, " n"], *, block_axis: int
) -> Shaped[Array, "n layers fields kv_heads tpb head_dim"]:
    """The Mosaic GPU kernel on a GPU, the portable kernel elsewhere."""
    if on_gpu():
        return gather_blocks_mgpu(pool, idx, block_axis=block_axis)
    return gather_blocks_portable(pool, idx, block_axis=block_axis)


def scatter_blocks(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    staging: Shaped[Array, "n layers fields kv_heads tpb head_dim"],
    dst: Int[Array, " n"],
    num_tokens: Int[Array, " n"],
    *,
    block_axis: int,
) -> Shaped[Array, "a b fields kv_heads tpb head_dim"]:
    """The Mosaic GPU kernel on a GPU, the portable kernel elsewhere."""
    if on_gpu():
        return scatter_blocks_mgpu(pool, staging, dst, num_tokens, block_axis=block_axis)
    return scatter_blocks_portable(pool, staging, dst, num_tokens, block_axis=block_axis)


def gather_blocks_reference(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"], idx: Int[Array, " n"], *, block_axis: int
) -> Shaped[Array, "n layers fields kv_heads tpb head_dim"]:
    """Plain jnp oracle: the indexed blocks, block axis first."""
    return jnp.moveaxis(jnp.take(pool, idx, axis=block_axis), block_axis, 0)


def scatter_blocks_reference(
    pool: Shaped[Array, "a b fields kv_heads tpb head_dim"],
    staging: Shaped[Array, "n layers fields kv_heads tpb head_dim"],
    dst: Int[Array, " n"],
    num_tokens: Int[Array, " n"],
    *,
    block_axis: int,
) -> Shaped[Array, "a b fields kv_heads tpb head_dim"]:
    """Plain jnp oracle (for distinct destinations): the first num_tokens[i] tokens of staged
    block i replace those of slot dst[i]; dst < 0 is dropped."""
    num_slots = pool.shape[block_axis]
    safe = jnp.where(dst >= 0, dst, 0)
    old = gather_blocks_reference(pool, safe, block_axis=block_axis)  # [n, L, F, H, T, D]
    tok = jnp.arange(staging.shape[4])[None, None, None, None, :, None]
    merged = jnp.where(tok < num_tokens[:, None, None, None, None, None], staging, old)
    target = jnp.where(dst >= 0, dst, num_slots)  # padding -> out of range -> dropped
    if block_axis == 0:
        return pool.at[target].set(merged, mode="drop")
    return pool.at[:, target].set(jnp.moveaxis(merged, 0, 1), mode="drop")
