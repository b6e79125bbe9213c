"""`KVPools`: the paged KV cache as JAX arrays, one primary array per pool plus a host tier.

Layouts (chosen by `CacheConfig.layout`; `F` = kv_factor, 2 for K/V, 1 for K-only):
  block_first  `[slots, layers_in_pool, F, kv_heads, tokens_per_block, head_dim]`
  layer_first  `[layers_in_pool, slots, F, kv_heads, tokens_per_block, head_dim]`
Heads sit before tokens (TensorRT-LLM's order) so one head's tokens of one block are a
contiguous `[tokens_per_block, head_dim]` chunk: the unit a TMA copy or a KVCacheIndex
offset addresses. Primary arrays have `pool.num_slots = primary_blocks + 1` slots; the last
is the null slot, zero forever, that padding and placeholder table entries point to.
The secondary tier mirrors the primary layout with `secondary_blocks` slots in `pinned_host`
memory (no null slot: nothing reads it through a table); a pool without one holds `None`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kvjax.config import CacheConfig, PoolSpec
from kvjax.device import sharding as shd


def block_axis(config: CacheConfig) -> int:
    """Axis of a pool array that indexes slots."""
    return 0 if config.layout == "block_first" else 1


def pool_shape(config: CacheConfig, pool: PoolSpec, num_blocks: int) -> tuple[int, ...]:
    inner = (config.kv_factor, pool.num_kv_heads, config.tokens_per_block, pool.head_dim)
    if config.layout == "block_first":
        return (num_blocks, pool.num_layers) + inner
    return (pool.num_layers, num_blocks) + inner


def pool_dtype(config: CacheConfig) -> jnp.dtype:
    return jnp.dtype(config.dtype)


@dataclasses.dataclass(frozen=True)
class PoolMeta:
    """The static half of `KVPools` (hashable): what jitted ops specialise on."""

    config: CacheConfig
    mesh: Mesh | None = None
    kv_axes: tuple[str, ...] | None = None

    def locate(self, layer: int) -> tuple[PoolSpec, int]:
        p, j = self.config.layer_to_pool[layer]
        return self.config.pools[p], j

    @property
    def block_axis(self) -> int:
        return block_axis(self.config)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPools:
    """Device KV pools (a pytree: arrays are leaves, config and placement are static).

    `primary[i]` / `secondary[i]` belong to `config.pools[i]`. Ops return a new `KVPools`
    and donate the old one: always rebind (`pools = write_kv(pools, ...)`). Inspect pools
    through copies (`np.asarray(jnp.copy(a))`): converting a pool array itself may cache a
    zero-copy numpy view on it (seen on jax 0.11 CPU), and a viewed buffer cannot be donated,
    so the next op would silently copy the whole pool.
    """

    primary: tuple[jax.Array, ...]
    secondary: tuple[jax.Array | None, ...]
    config: CacheConfig = dataclasses.field(metadata=dict(static=True))
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    kv_axes: tuple[str, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

    def locate(self, layer: int) -> tuple[PoolSpec, int]:
        """Global layer -> (its pool, layer index inside the pool)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise ValueError(f"{layer=} must be an int in [0, {self.config.num_layers})")
        p, j = self.config.layer_to_pool[layer]
        return self.config.pools[p], j

    @property
    def block_axis(self) -> int:
        return block_axis(self.config)

    @property
    def meta(self) -> PoolMeta:
        return PoolMeta(self.config, self.mesh, self.kv_axes)

    def replace(self, **kw) -> "KVPools":
        return dataclasses.replace(self, **kw)

    def with_primary(self, index: int, array: jax.Array) -> "KVPools":
        prim = list(self.primary)
        prim[index] = array
        return self.replace(primary=tuple(prim))

    def layer_view(self, layer: int) -> tuple[jax.Array, PoolSpec, int]:
        pool, j = self.locate(layer)
        return self.primary[pool.index], pool, j

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.primary) + sum(a.nbytes for a in self.secondary if a is not None)


@functools.lru_cache(maxsize=None)
def _allocator(shape: tuple[int, ...], dtype: jnp.dtype, sharding) -> callable:
    # One jitted zeros per (shape, dtype, sharding): the array is born with its final
    # sharding. Host arrays go through an explicit device_put inside the jit: an array whose
    # memory kind comes only from `out_shardings` gets an aval without the host memory space
    # (jax 0.12), and later jitted ops then mix memory spaces.
    if sharding.memory_kind == "pinned_host":
        return jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), jax.memory.Space.Host), out_shardings=sharding)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def allocate_pools(config: CacheConfig, sharding=None) -> KVPools:
    """Zero-filled pools for `config`, created in place with their final sharding.

    `sharding`: None (default device), a Device, a `Mesh` (kv heads sharded over all its
    axes) or a `NamedSharding(mesh, P(axis))` naming the kv-head axis. Block tables and
    slot mappings stay replicated.
    """
    if not isinstance(config, CacheConfig):
        raise ValueError(f"config must be a CacheConfig, got {type(config)=}")
    mesh, axes, device = shd.resolve_placement(sharding)
    if mesh is not None:
        n = shd.axis_size(mesh, axes)
        for pool in config.pools:
            if pool.num_kv_heads % n:
                raise ValueError(f"pool {pool.index}: {pool.num_kv_heads=} is not divisible by the kv mesh size {n} ({axes=})")
    dtype = pool_dtype(config)
    prim, sec = [], []
    for pool in config.pools:
        s_dev = shd.pool_sharding(mesh, axes, device, "device")
        prim.append(_allocator(pool_shape(config, pool, pool.num_slots), dtype, s_dev)())
        if pool.secondary_blocks:
            s_host = shd.pool_sharding(mesh, axes, device, "pinned_host")
            sec.append(_allocator(pool_shape(config, pool, pool.secondary_blocks), dtype, s_host)())
        else:
            sec.append(None)
    return KVPools(tuple(prim), tuple(sec), config, mesh, axes)
