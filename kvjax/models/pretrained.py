"""`from_pretrained`: a Hugging Face checkpoint directory into a `Transformer`, weights straight from disk.

The model is built abstractly (`nnx.eval_shape`: shapes only, no random draws), then every
parameter is filled from its memory-mapped safetensors tensors: each layer's tensor is converted
to the serving dtype and laid out as kvjax stores it (`[D, N, H]` projections, `[D, F]` MLP
matrices) in one numpy assignment, straight into its row of the stacked host array of that
parameter (`[layers, ...]`, see `kvjax.models.transformer`), which then goes to the device in
one transfer; host memory holds at most one stacked parameter beside the model. With a `mesh`,
each array is placed shard by shard as `kvjax.models.parallel` lays it out for tensor parallelism:
query / KV heads, MLP columns and the vocabulary split over all mesh axes (the same kv-head split
as `allocate_pools(config, sharding=mesh)`; KV heads replicated when there are fewer than
devices, the vocabulary padded to a multiple of them), the rest replicated; the model's spec is
then `tensor_parallel_spec(spec, tp)`.

Tensor names follow transformers (`model.layers.{i}.self_attn.q_proj.weight`, ...); the
multimodal Gemma 3 checkpoints keep their text model under `language_model.model.` (as
published) or `model.language_model.` (as transformers 5 saves). Missing, unexpected or
misshapen tensors raise `CheckpointError` naming them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from kvjax.checkpoint_files import TEXT_PREFIXES, VISION_PREFIXES, CheckpointError, CheckpointTensors
from kvjax.hf_config import read_config, spec_from_checkpoint
from kvjax.model_spec import ModelSpec
from kvjax.models.hybrid import HybridModel, load_granite, load_lfm2
from kvjax.models.hybrid.qwen3_5 import MODEL_TYPES as QWEN3_5_MODEL_TYPES
from kvjax.models.hybrid.qwen3_5 import load_qwen3_5
from kvjax.models.layers import parameter_at, shapes_only
from kvjax.models.parallel import (
    adopt_tensor_parallel_spec,
    mesh_size,
    parameter_shardings,
    tensor_parallel_layout,
    tensor_parallel_spec,
)
from kvjax.models.transformer import Transformer, layer_period


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: the parameter (by attribute path), its row of a stacked
    layer parameter (`None`: not stacked), its layout change, and the checkpoint shape it must have."""

    path: tuple[Any, ...]
    hf_shape: tuple[int, ...]
    convert: Callable[[np.ndarray], np.ndarray]
    row: int | None = None


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _transpose(a: np.ndarray) -> np.ndarray:  # [out, in] -> [in, out]
    return a.T


def _heads_in(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """q/k/v_proj.weight [heads * H, D] -> [D, heads, H]."""
    return lambda a: a.reshape(heads, head_dim, -1).transpose(2, 0, 1)


def _heads_out(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """o_proj.weight [D, N * H] -> [N, H, D]."""
    return lambda a: a.reshape(-1, heads, head_dim).transpose(1, 2, 0)


def _bias(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """q/k/v_proj.bias [heads * H] -> [heads, H]."""
    return lambda a: a.reshape(heads, head_dim)


def _targets(spec: ModelSpec, prefix: str, head: str) -> dict[str, _Target]:
    """Checkpoint tensor name -> target, for every parameter the model has."""
    d, n, h, f, v = spec.hidden_size, spec.num_attention_heads, spec.head_dim, spec.intermediate_size, spec.vocab_size
    out = {
        f"{prefix}embed_tokens.weight": _Target(("embed",), (v, d), _same),
        f"{prefix}norm.weight": _Target(("final_norm", "scale"), (d,), _same),
    }
    if not spec.tie_embeddings:
        out[head] = _Target(("lm_head",), (v, d), _transpose)
    period = layer_period(spec)
    for i, k in enumerate(spec.kv_heads_per_layer):
        lp = f"{prefix}layers.{i}."
        blk = ("stacks", i % period)
        att = blk + ("attn",)
        layer: dict[str, tuple[tuple[Any, ...], tuple[int, ...], Callable[[np.ndarray], np.ndarray]]] = {
            "input_layernorm.weight": (blk + ("attn_norm", "scale"), (d,), _same),
        }
        if spec.sandwich_norms:  # Gemma 3 names: post_attention = attention output, pre_feedforward = MLP input
            layer["post_attention_layernorm.weight"] = (blk + ("post_attn_norm", "scale"), (d,), _same)
            layer["pre_feedforward_layernorm.weight"] = (blk + ("mlp_norm", "scale"), (d,), _same)
            layer["post_feedforward_layernorm.weight"] = (blk + ("post_mlp_norm", "scale"), (d,), _same)
        else:  # Llama names: post_attention_layernorm is the MLP's input norm
            layer["post_attention_layernorm.weight"] = (blk + ("mlp_norm", "scale"), (d,), _same)
        for proj, heads, attr in (("q", n, "wq"), ("k", k, "wk"), ("v", k, "wv")):
            layer[f"self_attn.{proj}_proj.weight"] = (att + (attr,), (heads * h, d), _heads_in(heads, h))
            if spec.qkv_bias:
                layer[f"self_attn.{proj}_proj.bias"] = (att + ("b" + proj,), (heads * h,), _bias(heads, h))
        layer["self_attn.o_proj.weight"] = (att + ("wo",), (d, n * h), _heads_out(n, h))
        if spec.out_bias:
            layer["self_attn.o_proj.bias"] = (att + ("bo",), (d,), _same)
        if spec.qk_norm:
            layer["self_attn.q_norm.weight"] = (att + ("q_norm", "scale"), (h,), _same)
            layer["self_attn.k_norm.weight"] = (att + ("k_norm", "scale"), (h,), _same)
        layer["mlp.gate_proj.weight"] = (blk + ("mlp", "gate"), (f, d), _transpose)
        layer["mlp.up_proj.weight"] = (blk + ("mlp", "up"), (f, d), _transpose)
        layer["mlp.down_proj.weight"] = (blk + ("mlp", "down"), (d, f), _transpose)
        for name, (path, shape, convert) in layer.items():
            out[lp + name] = _Target(path, shape, convert, i // period)
    return out


def _layout(tensors: CheckpointTensors) -> tuple[str, str]:
    """(text-model prefix, lm_head name) of this checkpoint's naming."""
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in tensors:
            head = "language_model.lm_head.weight" if prefix == "language_model.model." else "lm_head.weight"
            return prefix, head
    raise CheckpointError(
        f"{tensors.directory}: no embedding tensor ({' / '.join(p + 'embed_tokens.weight' for p in TEXT_PREFIXES)})"
    )


def _set(var: nnx.Variable, value: jax.Array) -> None:
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:  # pragma: no cover - older flax
        var.value = value


def _get(var: nnx.Variable) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var.value


def _dtype_name(dtype: Any) -> str:
    name = jnp.dtype(dtype).name
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return name


#: hybrid model_types (`kvjax.hf_config.HYBRID_MODEL_TYPES`) -> their loader (`kvjax.models.hybrid`)
HYBRID_LOADERS: dict[str, Callable[..., HybridModel]] = {
    "lfm2": load_lfm2,
    "granitemoehybrid": load_granite,
    **{model_type: load_qwen3_5 for model_type in QWEN3_5_MODEL_TYPES},
}


def from_pretrained(
    path: str | Path, *, dtype: Any = None, mesh: Mesh | None = None, strict_config: bool = False,
    spec: ModelSpec | None = None,
) -> Transformer | HybridModel:
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as a `Transformer`.

    `dtype` (default: the checkpoint's `torch_dtype` / `dtype`) is the dtype of the weights, the
    activations and the KV cache (`model.spec.dtype`). With `mesh` (Auto axis types; allocate
    the pools on the same mesh, from a cache config of the returned `model.spec`), heads, MLP
    columns and the vocabulary are sharded over all of its axes (`kvjax.models.parallel`); query
    heads and the MLP width must divide by its size, and KV heads must divide by it or it by
    them (`TensorParallelError`).
    Raises `UnsupportedConfigError` for a config kvjax would compute wrong, `CheckpointError`
    for missing, truncated or mismatched weight files. Config fields kvjax does not know are
    named in an `UnknownConfigFieldWarning` and ignored; `strict_config=True` refuses them.
    `spec`: this checkpoint's spec when the caller already read its config (`servable_model`),
    so the config is neither read nor warned about twice.
    A hybrid checkpoint (`HYBRID_LOADERS`: LFM2, Granite-4.0-H dense, Qwen3.5 dense text) loads as
    its `kvjax.models.hybrid` model (`dense_forward`, `forward_chunk`; no paged forward): the
    engine does not serve it yet.
    """
    path = Path(path)
    if spec is None:  # hybrid families: their own model and loader
        model_type = _model_type(path)
        if model_type in HYBRID_LOADERS:
            if mesh is not None:
                raise ValueError(f"{path}: tensor parallelism is not implemented for hybrid models ({model_type!r})")
            return HYBRID_LOADERS[model_type](path, dtype=dtype, strict_config=strict_config)

        spec = spec_from_checkpoint(path, strict=strict_config)
    if dtype is not None:
        spec = dataclasses.replace(spec, dtype=_dtype_name(dtype))
    tensors = CheckpointTensors(path)  # every header read and checked before any allocation
    prefix, head = _layout(tensors)
    targets = _targets(spec, prefix, head)
    tensors.check_names({name: t.hf_shape for name, t in targets.items()},
                        lambda name: name.startswith(VISION_PREFIXES) or (spec.tie_embeddings and name == head))
    shardings = parameter_shardings(spec, mesh)  # checks the mesh and the split first
    tp = 1 if mesh is None else mesh_size(mesh)

    with shapes_only():
        model = nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(params=0)))
    target_dtype = np.dtype(jnp.dtype(spec.dtype))
    by_param: dict[tuple[Any, ...], list[tuple[str, _Target]]] = {}
    for name, target in targets.items():
        by_param.setdefault(target.path, []).append((name, target))
    for param_path, sources in by_param.items():
        var = parameter_at(model, param_path)
        expected = tuple(_get(var).shape)
        host = np.empty(expected, target_dtype)
        for name, target in sources:
            # one pass out of the file mapping: the dtype cast and the layout change in one assignment
            converted = target.convert(tensors.array(name))
            row = host if target.row is None else host[target.row]
            if converted.shape != row.shape:  # a layout bug, not a user error: the names and shapes were checked
                raise AssertionError(f"{name}: converted to {converted.shape}, parameter row is {row.shape}")
            row[...] = converted
            del converted
        if sources[0][1].row is not None and len(sources) != expected[0]:
            raise AssertionError(f"{param_path}: {len(sources)} checkpoint tensors for {expected[0]} stacked layers")
        sharding = shardings(param_path[-1], host.ndim)
        if sharding is None:
            _set(var, jax.device_put(host))
        else:
            host = tensor_parallel_layout(param_path[-1], host, tp)
            _set(var, jax.make_array_from_callback(host.shape, sharding, host.__getitem__))
        del host  # the next parameter's host copy replaces this one
    if mesh is not None:
        adopt_tensor_parallel_spec(model, tensor_parallel_spec(spec, tp))
    return model


def _model_type(path: Path) -> Any:
    """The `model_type` of a checkpoint's config.json (None when it has none)."""
    config = read_config(path)
    return config.get("model_type") if isinstance(config, dict) else None
