"""`shard_model`: place a built model's weights on a mesh for tensor parallelism.

The split is `from_pretrained(mesh=...)`'s (`TP_SPLIT_AXIS`): query / KV heads and MLP columns
over all mesh axes, everything else replicated, so the attention of a KV head runs where
`allocate_pools(config, sharding=mesh)` keeps that head's cache. It works for a model built
any way (random weights from a seed, a checkpoint loaded on one device) and on a mesh that
spans processes (`jax.distributed`): every process must then hold the same values, which a
seeded random model or the same checkpoint files give, and contributes only its own shards.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from kvjax.models.pretrained import parameter_shardings


def _name(path) -> str | None:
    """The parameter's attribute name: the last key before the Variable's `.value`."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    keys = [k for k in keys if k != "value"]
    return keys[-1] if keys else None


def shard_model(model, mesh: Mesh):
    """Reshard `model`'s parameters over `mesh` in place (returns the model). Parameters
    already placed as asked are left alone; query heads, KV heads and the MLP width must
    divide by the mesh size (ValueError otherwise, nothing moved)."""
    sharding_of = parameter_shardings(model.spec, mesh)  # checks the mesh and the divisibility first
    graphdef, state = nnx.split(model)

    def place(path, value):
        sharding = sharding_of(_name(path), value.ndim)
        assert sharding is not None  # with a mesh, every parameter has a sharding
        if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim):
            return value
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            raise ValueError(f"parameter {_name(path)!r} is spread over other processes with another sharding; "
                             "build the model on one device (or on this mesh) before sharding it")
        host = np.asarray(jax.device_get(value))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    nnx.update(model, jax.tree_util.tree_map_with_path(place, state))
    return model


def mesh_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in mesh.axis_names]))
