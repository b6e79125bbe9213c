"""`KVPools`: the paged KV cache as JAX arrays, one primary array per pool plus a host tier.

Layouts (chosen by `CacheConfig.layout`; `F` = kv_factor, 2 for K/V, 1 for K-only):
  block_first  `[slots, layers_in_pool, F, kv_heads, tokens_per_block, head_dim]`
  layer_first  `[layers_in_pool, slots, F, kv_heads, tokens_per_block, head_dim]`
Heads sit before tokens (TensorRT-LLM's order) so one head's tokens of one block are a
contiguous `[tokens_per_block, head_dim]` chunk: the unit a TMA copy or a KVCacheIndex
offset addresses. Primary arrays have `pool.num_slots = primary_blocks + 1` slots; the last
is the null slot, zero forever, that padding and placeholder table entries point to: no op
ever writes it.
The secondary tier mirrors the primary layout with `secondary_blocks` slots in `pinned_host`
memory (no null slot: nothing reads it through a table); a pool without one holds `None`.

FP8 pools (`dtype="float8_e4m3fn"` or `"float8_e5m2"`) keep their fp8 bit patterns in uint8
arrays (`PoolGeometry.storage_dtype`; `kvjax.device.quant.from_bytes` views them as fp8) and
carry float32 scale arrays beside each tier, shaped like the pool without its token and
head_dim axes (`[slots, layers, F, kv_heads]` block_first) and indexed by the same slot, so
every op that moves a block moves its scales with it (`kvjax.device.quant` has the format).
Other pools hold `None` there.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kvjax.config import CacheConfig, PoolSpec
from kvjax.device import sharding as shd
from kvjax.device.geometry import PoolGeometry


def block_axis(geometry: PoolGeometry) -> int:
    """Axis of a pool array that indexes slots."""
    return geometry.block_axis


def pool_shape(config: CacheConfig | PoolGeometry, pool: PoolSpec, num_blocks: int) -> tuple[int, ...]:
    return PoolGeometry.from_config(config).pool_shape(pool, num_blocks)


@dataclasses.dataclass(frozen=True)
class PoolMeta:
    """The static half of `KVPools` (hashable): what jitted ops specialise on."""

    geometry: PoolGeometry
    mesh: Mesh | None = None
    kv_axes: tuple[str, ...] | None = None

    @property
    def block_axis(self) -> int:
        return self.geometry.block_axis


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPools:
    """Device KV pools (a pytree: arrays are leaves; geometry and placement are static).

    `primary[i]` / `secondary[i]` belong to `geometry.pools[i]`; `primary_scales[i]` /
    `secondary_scales[i]` are their FP8 block scales (`None` for 16/32-bit pools). Ops return
    a new `KVPools` and donate the old one: always rebind (`pools = write_kv(pools, ...)`).
    Inspect pools through copies (`np.asarray(jnp.copy(a))`): converting a pool array itself
    may cache a zero-copy numpy view on it (seen on jax 0.11 CPU), and a viewed buffer cannot
    be donated, so the next op would silently copy the whole pool.
    """

    primary: tuple[jax.Array, ...]
    secondary: tuple[jax.Array | None, ...]
    primary_scales: tuple[jax.Array | None, ...]
    secondary_scales: tuple[jax.Array | None, ...]
    geometry: PoolGeometry = dataclasses.field(metadata=dict(static=True))
    mesh: Mesh | None = dataclasses.field(default=None, metadata=dict(static=True))
    kv_axes: tuple[str, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def config(self) -> PoolGeometry:
        """The pools' geometry (a `PoolGeometry`, whose attribute names follow `CacheConfig`).
        The policy half of the CacheConfig the pools came from never reaches the device."""
        return self.geometry

    def locate(self, layer: int) -> tuple[PoolSpec, int]:
        """Global layer (a Python int) -> (its pool, layer index inside the pool)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.geometry.num_layers:
            raise ValueError(f"{layer=} must be an int in [0, {self.geometry.num_layers})")
        p, j = self.geometry.layer_to_pool[layer]
        return self.geometry.pools[p], j

    @property
    def block_axis(self) -> int:
        return self.geometry.block_axis

    @property
    def is_scaled(self) -> bool:
        return self.geometry.is_scaled

    @property
    def meta(self) -> PoolMeta:
        return PoolMeta(self.geometry, self.mesh, self.kv_axes)

    def replace(self, **kw) -> KVPools:
        return dataclasses.replace(self, **kw)

    def with_primary(self, index: int, array: jax.Array, scales: jax.Array | None = None) -> KVPools:
        prim = list(self.primary)
        prim[index] = array
        if scales is None:
            return self.replace(primary=tuple(prim))
        sc = list(self.primary_scales)
        sc[index] = scales
        return self.replace(primary=tuple(prim), primary_scales=tuple(sc))

    def layer_view(self, layer: int) -> tuple[jax.Array, PoolSpec, int]:
        pool, j = self.locate(layer)
        return self.primary[pool.index], pool, j

    @property
    def nbytes(self) -> int:
        arrays = (*self.primary, *self.secondary, *self.primary_scales, *self.secondary_scales)
        return sum(a.nbytes for a in arrays if a is not None)


@functools.cache
def _allocator(shape: tuple[int, ...], dtype: jnp.dtype, sharding) -> Callable[[], jax.Array]:
    # One jitted zeros per (shape, dtype, sharding): the array is born with its final
    # sharding. Host arrays go through an explicit device_put inside the jit: an array whose
    # memory kind comes only from `out_shardings` gets an aval without the host memory space
    # (jax 0.12), and later jitted ops then mix memory spaces.
    if sharding.memory_kind == "pinned_host":
        return jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), jax.memory.Space.Host), out_shardings=sharding)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def allocate_pools(config: CacheConfig | PoolGeometry, sharding=None) -> KVPools:
    """Zero-filled pools for `config`, created in place with their final sharding.

    Only the geometry of `config` is kept (`PoolGeometry`): configs that differ in ledger
    policy alone give pools that share every compiled op. `sharding`: None (default device),
    a Device, a `Mesh` (kv heads sharded over all its axes) or a `NamedSharding(mesh, P(axis))`
    naming the kv-head axis. Block tables and slot mappings stay replicated.
    """
    if not isinstance(config, (CacheConfig, PoolGeometry)):
        raise ValueError(f"config must be a CacheConfig, got {type(config)=}")
    geometry = PoolGeometry.from_config(config)
    mesh, axes, device = shd.resolve_placement(sharding)
    if mesh is not None:
        assert axes is not None  # resolve_placement names the kv axes with every mesh
        n = shd.axis_size(mesh, axes)
        for pool in geometry.pools:
            if pool.num_kv_heads % n:
                hint = ("; with fewer KV heads than devices, build the cache config from the sharded model's spec "
                        "(shard_model replicates the heads: kvjax.models.parallel.tensor_parallel_spec)"
                        if pool.num_kv_heads < n else "")
                raise ValueError(f"pool {pool.index}: {pool.num_kv_heads=} is not divisible by the kv mesh size {n} "
                                 f"({axes=}){hint}")
    dtype = geometry.storage_dtype
    prim: list[jax.Array] = []
    sec: list[jax.Array | None] = []
    prim_s: list[jax.Array | None] = []
    sec_s: list[jax.Array | None] = []
    for pool in geometry.pools:
        s_dev = shd.pool_sharding(mesh, axes, device, "device")
        prim.append(_allocator(geometry.pool_shape(pool, pool.num_slots), dtype, s_dev)())
        s_host = shd.pool_sharding(mesh, axes, device, "pinned_host")
        sec.append(_allocator(geometry.pool_shape(pool, pool.secondary_blocks), dtype, s_host)()
                   if pool.secondary_blocks else None)
        if geometry.is_scaled:
            sc_dev = shd.pool_sharding(mesh, axes, device, "device", scales=True)
            prim_s.append(_allocator(geometry.scale_shape(pool, pool.num_slots), jnp.dtype(jnp.float32), sc_dev)())
            sc_host = shd.pool_sharding(mesh, axes, device, "pinned_host", scales=True)
            sec_s.append(_allocator(geometry.scale_shape(pool, pool.secondary_blocks), jnp.dtype(jnp.float32), sc_host)()
                         if pool.secondary_blocks else None)
        else:
            prim_s.append(None)
            sec_s.append(None)
    return KVPools(tuple(prim), tuple(sec), tuple(prim_s), tuple(sec_s), geometry, mesh, axes)
