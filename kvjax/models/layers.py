"""The building blocks of the decoder: RMSNorm, rotary position embeddings, gated MLP.

Einsum letters (shared by every file of `kvjax.models`):
  B batch, T query tokens, S key tokens, D model width, N query heads, K kv heads,
  G query heads per kv head (N = K * G), H head dim, F MLP hidden width, V vocabulary.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax._math import ceil_div

# float32 models compute at full float32 precision (no TF32 / bf16 passes on GPU), so the
# paged and dense paths agree to ~1e-5 on every backend.
PRECISION = jax.lax.Precision.HIGHEST


def einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=PRECISION)


_INIT_CHUNK = 1 << 16
_SHAPES_ONLY = contextvars.ContextVar("kvjax_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Within it, `normal_init` emits one abstract op instead of its chunked sampler: for
    `nnx.eval_shape` of a model whose weights come from elsewhere (a checkpoint), where values
    never exist and tracing thousands of chunks of a billion-parameter model would take minutes."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def parameter_at(model: Any, path: tuple[Any, ...]) -> nnx.Variable:
    """The parameter at an attribute path (ints index lists), for the checkpoint loaders' tables;
    a `TypeError` when the path ends elsewhere (a bug in a table, never user input)."""
    node = model
    for step in path:
        node = node[step] if isinstance(step, int) else getattr(node, step)
    if not isinstance(node, nnx.Variable):
        raise TypeError(f"{path} is not a parameter")
    return node


def is_shapes_only() -> bool:
    """Whether a `shapes_only()` block is active (values will never exist)."""
    return _SHAPES_ONLY.get()


@jax.jit
def _normal_chunk(key: jax.Array, index: jax.Array) -> jax.Array:
    return jax.random.normal(jax.random.fold_in(key, index), (_INIT_CHUNK,), jnp.float32)  # [CHUNK]


def normal_init(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype: jnp.dtype) -> jax.Array:
    """N(0, 1 / fan_in) weights (keeps activations O(1) through every projection), deterministic in `key`.

    Drawn in fixed-size chunks so one compiled sampler serves every parameter shape: building a
    model eagerly costs milliseconds per tensor instead of one compilation per distinct shape.
    Under tracing (`nnx.eval_shape`, `jax.jit`) the same values come from jnp ops.
    """
    size = math.prod(shape)
    scale = np.float32(1.0 / math.sqrt(fan_in))
    if _SHAPES_ONLY.get():
        return jnp.zeros(shape, dtype)
    chunks = [_normal_chunk(key, np.uint32(i)) for i in range(ceil_div(size, _INIT_CHUNK))]  # n x [CHUNK]
    try:
        host = [np.asarray(c) for c in chunks]
    except jax.errors.TracerArrayConversionError:  # abstract construction: stay in jnp
        return (jnp.concatenate(chunks)[:size].reshape(shape) * scale).astype(dtype)  # shape
    values = np.concatenate(host)[:size].reshape(shape) * scale  # shape
    return jnp.asarray(values, dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm, statistics in float32, in the two published cast orders.

    `offset=0.0` (Llama, Mistral, Qwen): `w * cast(x / rms(x))` (normalise in float32, cast to the
    input dtype, then scale). `offset=1.0` (Gemma): `cast(x / rms(x) * (1 + w))` (scale in float32).
    The two agree exactly in float32.
    """

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, offset: float = 0.0):
        self.eps = eps
        self.offset = offset
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))  # [D]: the identity either way

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)  # [..., D]
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)  # [..., 1]
        shape = (1,) * (x.ndim - 1) + (-1,)
        if self.offset:
            scale = (self.scale[...].astype(jnp.float32) + self.offset).reshape(shape)  # [1.., D]
            return (x32 * inv_rms * scale).astype(x.dtype)
        normed = (x32 * inv_rms).astype(x.dtype)  # [..., D]
        return normed * self.scale[...].astype(x.dtype).reshape(shape)


def rope_frequencies(head_dim: int, theta: float, scaling: Any = None) -> np.ndarray:
    """float32 [H/2] inverse frequencies `1 / theta ** (2i / H)`, as transformers computes them,
    optionally rescaled (`kvjax.model_spec.RopeScaling`: linear or llama3)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)  # [H/2]
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)  # [H/2]
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    if scaling.kind != "llama3":
        raise ValueError(f"unknown RoPE scaling {scaling.kind!r}")
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [H/2]
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)  # [H/2]
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled  # [H/2]
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)  # [H/2]
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float | np.ndarray) -> jax.Array:
    """Rotary position embedding ("rotate half" convention of Llama / HF) at absolute `positions`.

    x: [B, T, heads, H]; positions: int [B, T] (negative positions of padding are harmless);
    `theta`: the RoPE base, or the inverse frequencies [H/2] (`rope_frequencies`).
    """
    head_dim = x.shape[-1]
    half = head_dim // 2
    inv_freq = rope_frequencies(head_dim, float(theta)) if np.ndim(theta) == 0 else np.asarray(theta, np.float32)  # [H/2]
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, H/2]
    sin = jnp.sin(angles)[:, :, None, :]  # [B, T, 1, H/2]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]  # [B, T, heads, H/2] each
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [B, T, heads, H]
    return rotated.astype(x.dtype)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}


class MLP(nnx.Module):
    """Gated feed-forward `down(act(gate(x)) * up(x))`: SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, dim: int, hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs, activation: str = "silu"):
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
        self.activation = activation
        self.gate = nnx.Param(normal_init(rngs.params(), (dim, hidden), dim, dtype))  # [D, F]
        self.up = nnx.Param(normal_init(rngs.params(), (dim, hidden), dim, dtype))  # [D, F]
        self.down = nnx.Param(normal_init(rngs.params(), (hidden, dim), hidden, dtype))  # [F, D]

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = einsum("btd,df->btf", x, self.gate[...])  # [B, T, F]
        up = einsum("btd,df->btf", x, self.up[...])  # [B, T, F]
        hidden = ACTIVATIONS[self.activation](gate) * up  # [B, T, F]
        return einsum("btf,fd->btd", hidden, self.down[...])  # [B, T, D]
