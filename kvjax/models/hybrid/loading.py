"""Fill a hybrid model's parameters from a checkpoint directory (safetensors via
`kvjax.checkpoint_files`): every tensor name and shape is checked before anything is allocated;
a missing, unexpected or misshapen tensor is a `CheckpointError` naming it."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.checkpoint_files import CheckpointTensors
from kvjax.hf_config import read_config
from kvjax.models.layers import parameter_at, shapes_only


@dataclasses.dataclass(frozen=True)
class Source:
    """One checkpoint tensor (its shape there) into one parameter (attribute path), via `convert`."""

    name: str
    path: tuple[Any, ...]
    hf_shape: tuple[int, ...]
    convert: Callable[[np.ndarray], np.ndarray]


def same(a: np.ndarray) -> np.ndarray:
    return a


def transpose(a: np.ndarray) -> np.ndarray:  # torch Linear [out, in] -> [in, out]
    return a.T


def heads_in(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """q/k/v_proj.weight [heads * H, D] -> [D, heads, H]."""
    return lambda a: a.reshape(heads, head_dim, -1).transpose(2, 0, 1)


def heads_out(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """o_proj.weight [D, N * H] -> [N, H, D]."""
    return lambda a: a.reshape(-1, heads, head_dim).transpose(1, 2, 0)


def rows(start: int, stop: int, then: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    """Rows [start, stop) of a fused tensor (a split projection), then `then`."""
    return lambda a: then(a[start:stop])


def head_sources(spec: Any, final_norm: str) -> tuple[list[Source], tuple[str, ...]]:
    """The table's rows around the layers (embedding, final norm `model.<final_norm>.weight`,
    untied output head), and the tensors a checkpoint may carry unused (a tied head's stored copy)."""
    d, v = spec.hidden_size, spec.vocab_size
    out = [Source("model.embed_tokens.weight", ("embed",), (v, d), same),
           Source(f"model.{final_norm}.weight", ("final_norm", "scale"), (d,), same)]
    if not spec.tie_embeddings:
        out.append(Source("lm_head.weight", ("lm_head",), (v, d), transpose))
    return out, (("lm_head.weight",) if spec.tie_embeddings else ())


def attention_sources(prefix: str, path: tuple[Any, ...], spec: Any, out_name: str) -> list[Source]:
    """q/k/v/out projections of a `HybridAttention` at `path` (its tensors `prefix` + name)."""
    d, n, k, h = spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    return [Source(prefix + "q_proj.weight", path + ("wq",), (n * h, d), heads_in(n, h)),
            Source(prefix + "k_proj.weight", path + ("wk",), (k * h, d), heads_in(k, h)),
            Source(prefix + "v_proj.weight", path + ("wv",), (k * h, d), heads_in(k, h)),
            Source(prefix + out_name + ".weight", path + ("wo",), (d, n * h), heads_out(n, h))]


def load_into(build: Callable[[], nnx.Module], directory: str | Path, sources: list[Source], dtype: str,
              optional: tuple[str, ...] = ()) -> Any:
    """The model `build` makes (abstractly), its parameters read from `directory`.

    `optional`: tensor names a checkpoint may carry that the model does not use (a tied head)."""
    tensors = CheckpointTensors(directory)
    tensors.check_names({s.name: s.hf_shape for s in sources}, lambda name: name in optional)
    with shapes_only():
        model = nnx.eval_shape(build)
    target = np.dtype(jnp.dtype(dtype))
    filled = set()
    for s in sources:
        var = parameter_at(model, s.path)
        value = np.asarray(s.convert(tensors.array(s.name)), dtype=target)
        if value.shape != tuple(var.shape):  # a layout bug: names and shapes were checked above
            raise AssertionError(f"{s.name}: converted to {value.shape}, parameter {s.path} is {tuple(var.shape)}")
        var.set_value(jax.device_put(value))
        filled.add(s.path)
    params = nnx.state(model, nnx.Param)
    unfilled = [p for p, _ in nnx.to_flat_state(params) if tuple(p) not in filled]
    if unfilled:  # a bug in the family's table
        raise AssertionError(f"parameters without a checkpoint tensor: {unfilled}")
    return model


def load_family(path: str | Path, read_spec: Callable[..., Any], build: Callable[[Any], nnx.Module],
                table: Callable[[Any], tuple[list[Source], tuple[str, ...]]], dtype: Any, strict_config: bool) -> Any:
    """A checkpoint directory as the model `build(spec)` makes, `spec` read from its config.json
    (`read_spec`, strict or not) and `dtype` (default: the checkpoint's) replacing the spec's."""
    path = Path(path)
    spec = read_spec(read_config(path), name=path.resolve().name, source=str(path / "config.json"),
                     strict=strict_config)
    if dtype is not None:
        spec = dataclasses.replace(spec, dtype=jnp.dtype(dtype).name)
    sources, optional = table(spec)
    return load_into(lambda: build(spec), path, sources, spec.dtype, optional)
