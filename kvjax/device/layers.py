"""Layer indices: a Python int or a traced scalar (a `jax.lax.scan` over layers).

A layer lives in one pool (layers are grouped by window, kv heads and head dim), and the
pool decides array shapes, so the pool must be known when tracing. A traced layer therefore
needs the pool to be static: either the pools hold a single pool, or the caller names it
with `pool=`. Inside the pool, the layer becomes a traced index; a layer that is not in that
pool (or out of range) maps to the index `pool.num_layers`, which writes nothing and reads
zeros (and is reported in checked mode).
"""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from kvjax.config import PoolSpec
from kvjax.device.geometry import PoolGeometry

LayerIndex = int | Int[Array, ""]


def _is_static_int(layer) -> bool:
    if isinstance(layer, (bool, np.bool_)):
        return False
    if isinstance(layer, (int, np.integer)):
        return True
    return isinstance(layer, np.ndarray) and layer.ndim == 0 and np.issubdtype(layer.dtype, np.integer)


def resolve(geometry: PoolGeometry, layer: LayerIndex, pool: int | None = None) -> tuple[PoolSpec, Int[Array, ""]]:
    """`(pool spec, int32 index inside the pool)` of a global `layer`.

    Static ints are range-checked (`ValueError`); traced scalars are mapped through a
    constant table (`pool.num_layers` = "not in this pool").
    """
    n = geometry.num_layers
    if pool is not None:
        if isinstance(pool, bool) or not isinstance(pool, (int, np.integer)) or not 0 <= pool < len(geometry.pools):
            raise ValueError(f"{pool=} must be a pool index in [0, {len(geometry.pools)})")
        pool = int(pool)
    if _is_static_int(layer):
        layer = operator.index(layer)
        if not 0 <= layer < n:
            raise ValueError(f"{layer=} must be an int in [0, {n})")
        p, j = geometry.layer_to_pool[layer]
        if pool is not None and pool != p:
            raise ValueError(f"layer {layer} belongs to pool {p}, not pool={pool}")
        return geometry.pools[p], np.int32(j)
    if not isinstance(layer, jax.Array) or layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer must be an int or a 0-d integer array (a traced layer index), got {layer!r}")
    if pool is None:
        if len(geometry.pools) != 1:
            raise ValueError(
                f"a traced layer index needs a static pool: these pools hold {len(geometry.pools)} pools "
                f"(layers grouped by window, kv heads and head dim: {[p.layers for p in geometry.pools]}); "
                "pass pool=<index> and scan over the layers of that pool (docs/device.md, 'Scanning over layers')")
        pool = 0
    spec = geometry.pools[pool]
    table = np.full((n,), spec.num_layers, np.int32)  # [layers]: index inside `spec`, or "absent"
    table[list(spec.layers)] = np.arange(spec.num_layers, dtype=np.int32)
    layer = layer.astype(jnp.int32)
    inside = (layer >= 0) & (layer < n)
    j = jnp.where(inside, jnp.asarray(table)[jnp.clip(layer, 0, n - 1)], spec.num_layers)
    return spec, j.astype(jnp.int32)
