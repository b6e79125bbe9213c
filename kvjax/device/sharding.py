"""Where pools live: one device, or a mesh with kv heads sharded and tables replicated.

Sharding pools over kv heads keeps every op local: a head's K/V never meets another head's,
so gather, write and attention need no collectives as long as block tables are replicated.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

#: Position of the kv-heads axis in a pool array, in both layouts.
HEAD_AXIS = 3
POOL_NDIM = 6


def resolve_placement(sharding: Any) -> tuple[Mesh | None, tuple[str, ...] | None, jax.Device | None]:
    """Normalise `allocate_pools(..., sharding=)` into (mesh, kv axis names, single device).

    Accepted: None (default device), a `jax.Device`, a `SingleDeviceSharding`, a `Mesh`
    (kv heads sharded over all its axes), or a `NamedSharding` whose spec's first entry names
    the mesh axis (or axes) that kv heads shard over, e.g. `NamedSharding(mesh, P("kv"))`.
    """
    if sharding is None:
        return None, None, jax.devices()[0]
    if isinstance(sharding, jax.Device):
        return None, None, sharding
    if isinstance(sharding, SingleDeviceSharding):
        return None, None, next(iter(sharding.device_set))
    if isinstance(sharding, Mesh):
        return sharding, tuple(sharding.axis_names), None
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if not spec or spec[0] is None:
            raise ValueError(f"NamedSharding spec must name the kv-head mesh axis first, got {sharding.spec=}")
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
        if not isinstance(sharding.mesh, Mesh):
            raise ValueError(f"NamedSharding must be over a concrete Mesh (pools live on its devices), got {sharding.mesh=}")
        return sharding.mesh, tuple(axes), None
    raise ValueError(f"sharding must be None, a Device, a Mesh or a NamedSharding, got {sharding=}")


def axis_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return functools.reduce(lambda a, b: a * b, (mesh.shape[a] for a in axes), 1)


def pool_spec(axes: tuple[str, ...] | None) -> P:
    """PartitionSpec of a 6-D pool array: kv heads over `axes`, everything else replicated."""
    head = None if axes is None else (axes if len(axes) > 1 else axes[0])
    return P(*([None] * HEAD_AXIS + [head] + [None] * (POOL_NDIM - HEAD_AXIS - 1)))


def scale_spec(axes: tuple[str, ...] | None) -> P:
    """PartitionSpec of a 4-D scale array (a pool's leading axes): kv heads over `axes`."""
    return P(*tuple(pool_spec(axes))[: HEAD_AXIS + 1])


def pool_sharding(mesh: Mesh | None, axes: tuple[str, ...] | None, device: jax.Device | None, memory_kind: str,
                  *, scales: bool = False):
    if mesh is None:
        return SingleDeviceSharding(device, memory_kind=memory_kind)
    return NamedSharding(mesh, scale_spec(axes) if scales else pool_spec(axes), memory_kind=memory_kind)


def replicated(mesh: Mesh | None, device: jax.Device | None, memory_kind: str = "device"):
    if mesh is None:
        return SingleDeviceSharding(device, memory_kind=memory_kind)
    return NamedSharding(mesh, P(), memory_kind=memory_kind)


def head_sharded_spec(ndim: int, head_axis: int, axes: tuple[str, ...] | None) -> P:
    """Spec of an array whose `head_axis` holds kv (or query) heads."""
    head = None if axes is None else (axes if len(axes) > 1 else axes[0])
    return P(*[head if i == head_axis else None for i in range(ndim)])


def shard_map(fn, mesh: Mesh, in_specs, out_specs):
    """`jax.shard_map` across jax versions (kept in one place)."""
    sm = getattr(jax, "shard_map", None)
    if sm is not None:
        return sm(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover - old jax

    return legacy(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def constrain_heads(x, mesh: Mesh | None, axes: tuple[str, ...] | None, head_axis: int):
    """Shard `x`'s head axis like the pools (a no-op without a mesh). Explicit meshes need a
    `reshard` (they refuse to mix shardings silently), auto meshes take a constraint."""
    if mesh is None:
        return x
    sharding = NamedSharding(mesh, head_sharded_spec(x.ndim, head_axis, axes))
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if explicit is not None and any(t == explicit for t in getattr(mesh, "axis_types", ())):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)
