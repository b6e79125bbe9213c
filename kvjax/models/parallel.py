"""Tensor parallelism: which parameter axes split over a mesh, and `shard_model`.

The split (`TP_SPLIT_AXIS`, Megatron's): query / KV heads of the projections and the MLP columns
over all mesh axes, so the attention of a KV head runs where `allocate_pools(config,
sharding=mesh)` keeps that head's cache; the embedding's rows and the LM head's columns over the
vocabulary (vLLM's VocabParallelEmbedding / ParallelLMHead): each device holds `V / tp` of them,
its lookup masks the ids outside its rows and the partial rows are summed, its logits are a
`V / tp` slice gathered for sampling (XLA's sharding propagation places these collectives; the
tests check that the compiled program keeps both tables sharded). The norms are replicated.

Two layouts change on the way (vLLM's rules), so `shard_model` and `from_pretrained(mesh=)`
also replace `model.spec` with `tensor_parallel_spec(spec, tp)`:
- a model with fewer KV heads than devices (`tp % K == 0`) gets each KV head replicated
  `tp / K` times, so each device holds (and caches) the one head its query heads read; the
  spec then says `tp` KV heads, and cache configs built from it (`cache_config(model.spec,
  ...)`) give pools, block sizes and capacity sizing that count every replica;
- a vocabulary that does not divide by `tp` is padded with zero rows up to the next multiple
  (`padded_vocab_size`); the padded logits are cut off before anything reads them, so no padded
  id is ever sampled. `spec.vocab_size` stays the real size.
Query heads and the MLP width must divide by `tp` (as vLLM requires); `TensorParallelError`
otherwise.

`shard_model` works for a model built any way (random weights from a seed, a checkpoint loaded
on one device) and on a mesh that spans processes (`jax.distributed`): every process must then
hold the same values, which a seeded random model or the same checkpoint files give, and
contributes only its own shards.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.errors import KVCacheError
from kvjax.model_spec import ModelSpec

#: Axis of each parameter (kvjax layout), counted from the last, that tensor parallelism splits: query /
#: KV heads of the projections and their biases ([D, N, H], [D, K, H], [N, H, D], [N, H]), MLP columns
#: ([D, F], [F, D]), the embedding's rows ([V, D]) and the LM head's columns ([D, V]); the stacked layer
#: parameters carry a leading layer axis in front, never split.
TP_SPLIT_AXIS = {"wq": -2, "wk": -2, "wv": -2, "wo": -3, "bq": -2, "bk": -2, "bv": -2, "gate": -1, "up": -1, "down": -2,
                 "embed": -2, "lm_head": -1}
#: Parameters whose split axis holds KV heads (replicated when there are fewer than devices).
KV_HEAD_PARAMS = frozenset({"wk", "wv", "bk", "bv"})
#: Parameters whose split axis is the vocabulary (padded up to a multiple of the devices).
VOCAB_PARAMS = frozenset({"embed", "lm_head"})


class TensorParallelError(KVCacheError, ValueError):
    """A model that cannot be split over that many devices (or a mesh kvjax cannot use)."""


def mesh_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in mesh.axis_names]))


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Rows of the embedding (columns of the LM head) at `tp` devices: the vocabulary rounded up
    to a multiple of `tp`, so every device holds the same number."""
    return -(-vocab_size // tp) * tp


def kv_replicas(num_kv_heads: int, tp: int) -> int:
    """How many copies of each KV head `tp` devices hold (1 unless there are fewer heads than devices)."""
    return tp // num_kv_heads if num_kv_heads < tp else 1


def tensor_parallel_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """`spec` as it runs on `tp` devices: KV heads replicated up to `tp` where there are fewer
    (vLLM's rule), everything else unchanged. Raises `TensorParallelError` where vLLM refuses:
    query heads or the MLP width not divisible by `tp`, KV heads neither a multiple nor a
    divisor of `tp`."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"the tensor parallel size must be a positive int, got {tp!r}")
    for what, count in (("num_attention_heads", spec.num_attention_heads), ("intermediate_size", spec.intermediate_size)):
        if count % tp:
            raise TensorParallelError(f"{spec.name}: tensor parallelism over {tp} devices needs {what} ({count}) "
                                      f"divisible by {tp}")
    for k in sorted(set(spec.kv_heads_per_layer)):
        if k % tp and tp % k:
            raise TensorParallelError(
                f"{spec.name}: tensor parallelism over {tp} devices needs num_kv_heads ({k}) divisible by {tp}, or {tp} "
                f"divisible by it (each KV head then replicated on {tp} / {k} devices)")
    if all(k >= tp for k in spec.kv_heads_per_layer):
        return spec
    kv = spec.num_kv_heads
    heads: int | tuple[int, ...] = max(kv, tp) if isinstance(kv, int) else tuple(max(k, tp) for k in kv)
    return dataclasses.replace(spec, num_kv_heads=heads)


def _check_mesh(mesh: Mesh) -> None:
    auto = getattr(jax.sharding.AxisType, "Auto", None)
    if auto is not None and any(t != auto for t in getattr(mesh, "axis_types", ())):
        axes = tuple(mesh.axis_names)
        raise TensorParallelError(
            f"tensor parallelism needs a mesh with Auto axes (XLA places the collectives), got "
            f"axis_types={mesh.axis_types}; build it with jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * "
            f"{len(axes)}) and allocate the KV pools on the same mesh"
        )


def parameter_shardings(spec: ModelSpec, mesh: Mesh | None) -> Callable[[Any, int], NamedSharding | None]:
    """(parameter name, rank) -> its sharding: heads / MLP columns / vocabulary over all mesh
    axes, else replicated (None without a mesh). Checks the mesh and `spec` first
    (`TensorParallelError`)."""
    if mesh is None:
        return lambda name, ndim: None
    _check_mesh(mesh)
    tensor_parallel_spec(spec, mesh_size(mesh))
    axes = tuple(mesh.axis_names)
    entry = axes if len(axes) > 1 else axes[0]

    def sharding(name: Any, ndim: int) -> NamedSharding:
        axis = TP_SPLIT_AXIS.get(name)
        return NamedSharding(mesh, P(*[entry if axis is not None and i == ndim + axis else None for i in range(ndim)]))

    return sharding


def _layout_change(name: Any, shape: tuple[int, ...], tp: int) -> tuple[str, int, int] | None:
    """(what, axis, new size) of the change `tensor_parallel_layout` makes to a parameter of this
    name and shape; None when it keeps it."""
    axis = TP_SPLIT_AXIS.get(name)
    if axis is None:
        return None
    size = shape[axis]
    if name in KV_HEAD_PARAMS and size < tp:
        return "repeat", len(shape) + axis, size * kv_replicas(size, tp)
    if name in VOCAB_PARAMS and size % tp:
        return "pad", len(shape) + axis, padded_vocab_size(size, tp)
    return None


def layout_shape(name: Any, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape `tensor_parallel_layout` gives a parameter of this name and shape."""
    change = _layout_change(name, tuple(shape), tp)
    if change is None:
        return tuple(shape)
    _, axis, size = change
    return tuple(size if i == axis else s for i, s in enumerate(shape))


def tensor_parallel_layout(name: Any, array: np.ndarray, tp: int) -> np.ndarray:
    """Parameter `name`'s value (kvjax layout, stacked or not) as `tp` devices hold it: KV heads
    repeated `tp / K` times in place (head `k` becomes heads `k r .. k r + r - 1`, so device `d`
    gets head `d // r`, the one its query heads read), the vocabulary padded with zero rows /
    columns to `padded_vocab_size`. Already laid out (or nothing to do): returned as is."""
    change = _layout_change(name, array.shape, tp)
    if change is None:
        return array
    what, axis, size = change
    if what == "repeat":
        return np.repeat(array, size // array.shape[axis], axis=axis)
    pad = [(0, 0)] * array.ndim
    pad[axis] = (0, size - array.shape[axis])
    return np.pad(array, pad)


def adopt_tensor_parallel_spec(model: Any, spec: ModelSpec) -> None:
    """Make `model` (its weights already laid out by `tensor_parallel_layout`) say so: `model.spec`
    and every attention's KV-head count become `spec`'s (a static attribute the forward reads)."""
    for r, stack in enumerate(model.stacks):
        stack.attn.num_kv_heads = spec.kv_heads_per_layer[r]
    model.spec = spec


def _name(path) -> str | None:
    """The parameter's attribute name: the last key before the Variable's `.value`."""
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    keys = [k for k in keys if k != "value"]
    return keys[-1] if keys else None


def shard_model(model, mesh: Mesh):
    """Reshard `model`'s parameters over `mesh` in place (returns the model), replicating KV heads
    and padding the vocabulary as `tensor_parallel_spec` / `tensor_parallel_layout` say; afterwards
    `model.spec` is the spec it runs as (build cache configs from it). Parameters already placed
    as asked are left alone. `TensorParallelError` (nothing moved) when the model does not split
    over the mesh."""
    sharding_of = parameter_shardings(model.spec, mesh)  # checks the mesh and the divisibility first
    tp = mesh_size(mesh)
    spec = tensor_parallel_spec(model.spec, tp)
    graphdef, state = nnx.split(model)

    def place(path, value):
        name = _name(path)
        sharding = sharding_of(name, value.ndim)
        assert sharding is not None  # with a mesh, every parameter has a sharding
        if (isinstance(value, jax.Array) and value.shape == layout_shape(name, value.shape, tp)
                and value.sharding.is_equivalent_to(sharding, value.ndim)):
            return value
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            raise TensorParallelError(f"parameter {name!r} is spread over other processes with another sharding; "
                                      "build the model on one device (or on this mesh) before sharding it")
        host = tensor_parallel_layout(name, np.asarray(jax.device_get(value)), tp)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    nnx.update(model, jax.tree_util.tree_map_with_path(place, state))
    adopt_tensor_parallel_spec(model, spec)
    return model
