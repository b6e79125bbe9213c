"""Host-tier blocks as bytes: copies between the secondary (host) pools and numpy staging
buffers, for the third tier (`kvjax.kv_store`), which stores a block as one byte string.

A block's bytes are the concatenation, over the pools given (one window's pools), of its
`[layers, F, kv_heads, tokens_per_block, head_dim]` values and then its FP8 scales
(`[layers, F, kv_heads]`, FP8 pools only), each C-ordered, so the scales travel with their
block. Reads return copies (`[n, block_bytes]` uint8): no numpy view of a pool array is kept
(a viewed buffer cannot be donated, see `kvjax.device.pools`), so a block staged here stays
valid whatever later ops do to its slot. Writes donate the secondary arrays they update.
Blocks move one by one inside a `fori_loop` of dynamic slices (the pattern XLA's host-offload
pass turns into one DMA per block on GPU, where host arrays refuse gathers); slot counts are
bucketed to powers of two, so a serving loop compiles a handful of variants.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from kvjax.device.pools import KVPools


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _on_host(arr: jax.Array) -> bool:
    return getattr(arr.sharding, "memory_kind", None) == "pinned_host"


@functools.partial(jax.jit, static_argnames=("ba", "host"))
def _gather(sec: jax.Array, idx: Int[Array, " N"], count: Int[Array, ""], *, ba: int, host: bool) -> jax.Array:
    """Blocks `idx[:count]` of a host array, block axis first, in device memory: `[N, *block]`."""
    blk_shape = sec.shape[:ba] + sec.shape[ba + 1:]
    out = jnp.zeros((idx.shape[0],) + blk_shape, sec.dtype)  # [N, *block]
    def body(i, st):
        blk = jax.lax.dynamic_index_in_dim(sec, idx[i], ba, keepdims=False)
        if host:
            blk = jax.device_put(blk, jax.memory.Space.Device)
        return jax.lax.dynamic_update_index_in_dim(st, blk, i, 0)

    return jax.lax.fori_loop(0, count, body, out)


@functools.partial(jax.jit, static_argnames=("ba", "host"), donate_argnums=(0,))
def _scatter(sec: jax.Array, blocks: jax.Array, idx: Int[Array, " N"], count: Int[Array, ""], *, ba: int,
             host: bool) -> jax.Array:
    """`sec` with `blocks[i]` (`[N, *block]`) written into slot `idx[i]`, for i < count."""
    def body(i, s):
        blk = jax.lax.dynamic_index_in_dim(blocks, i, 0, keepdims=True)  # [1, *block]
        if host:
            blk = jax.device_put(blk, jax.memory.Space.Host)
        return jax.lax.dynamic_update_slice_in_dim(s, jnp.moveaxis(blk, 0, ba), idx[i], ba)

    return jax.lax.fori_loop(0, count, body, sec)


def _arrays(pools: KVPools, pool_indices: Sequence[int]) -> list[tuple[int, bool]]:
    """(pool index, scales?) of every array a block's bytes span, in byte order."""
    out = []
    for p in pool_indices:
        if pools.secondary[p] is None:
            raise ValueError(f"pool {p} has no host tier (secondary_blocks=0)")
        out.append((p, False))
        if pools.secondary_scales[p] is not None:
            out.append((p, True))
    return out


def _array(pools: KVPools, p: int, scales: bool) -> jax.Array:
    a = pools.secondary_scales[p] if scales else pools.secondary[p]
    assert a is not None  # checked by _arrays
    return a


def host_block_bytes(pools: KVPools, pool_indices: Sequence[int]) -> int:
    """Bytes of one host block over `pool_indices` (values, then scales, pool by pool)."""
    total = 0
    ba = pools.block_axis
    for p, sc in _arrays(pools, pool_indices):
        a = _array(pools, p, sc)
        total += a.nbytes // a.shape[ba]
    return total


def _index(slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    n = len(slots)
    idx = np.zeros(_bucket(n), np.int32)  # [N] padded: entries past `count` are never touched
    idx[:n] = slots
    return idx, np.asarray(n, np.int32)


def read_host_blocks(pools: KVPools, pool_indices: Sequence[int], slots: Sequence[int]) -> np.ndarray:
    """Copies of host slots `slots` as bytes, `[n, block_bytes]` uint8 (row i: slot `slots[i]`)."""
    n = len(slots)
    parts = []
    idx, count = _index(slots)
    for p, sc in _arrays(pools, pool_indices):
        a = _array(pools, p, sc)
        blocks = np.asarray(jax.device_get(_gather(a, idx, count, ba=pools.block_axis, host=_on_host(a))))[:n]
        parts.append(np.ascontiguousarray(blocks).view(np.uint8).reshape(n, -1))  # [n, bytes of this array]
    return np.ascontiguousarray(np.concatenate(parts, axis=1))  # [n, block_bytes]


def write_host_blocks(pools: KVPools, pool_indices: Sequence[int], slots: Sequence[int], data: np.ndarray) -> KVPools:
    """`pools` with host slots `slots` holding `data` (`[n, block_bytes]` uint8, as
    `read_host_blocks` returns it); the updated secondary arrays are donated."""
    n = len(slots)
    width = host_block_bytes(pools, pool_indices)
    if data.dtype != np.uint8 or data.shape != (n, width):
        raise ValueError(f"data must be uint8 [{n}, {width}], got {data.dtype} {data.shape}")
    idx, count = _index(slots)
    ba = pools.block_axis
    sec, sec_scales = list(pools.secondary), list(pools.secondary_scales)
    off = 0
    for p, sc in _arrays(pools, pool_indices):
        a = _array(pools, p, sc)
        blk_shape = a.shape[:ba] + a.shape[ba + 1:]
        size = a.nbytes // a.shape[ba]
        blocks = np.zeros((len(idx),) + blk_shape, a.dtype)  # [N, *block]
        blocks[:n] = np.ascontiguousarray(data[:, off: off + size]).view(a.dtype).reshape((n,) + blk_shape)
        off += size
        new = _scatter(a, blocks, idx, count, ba=ba, host=_on_host(a))
        if sc:
            sec_scales[p] = new
        else:
            sec[p] = new
    return pools.replace(secondary=tuple(sec), secondary_scales=tuple(sec_scales))
