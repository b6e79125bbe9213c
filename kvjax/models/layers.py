"""The building blocks of the decoder: RMSNorm, rotary position embeddings, SwiGLU MLP.

Einsum letters (shared by every file of `kvjax.models`):
  B batch, T query tokens, S key tokens, D model width, N query heads, K kv heads,
  G query heads per kv head (N = K * G), H head dim, F MLP hidden width, V vocabulary.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# float32 models compute at full float32 precision (no TF32 / bf16 passes on GPU), so the
# paged and dense paths agree to ~1e-5 on every backend.
PRECISION = jax.lax.Precision.HIGHEST


def einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=PRECISION)


_INIT_CHUNK = 1 << 16


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
    chunks = [_normal_chunk(key, np.uint32(i)) for i in range(-(-size // _INIT_CHUNK))]  # n x [CHUNK]
    try:
        host = [np.asarray(c) for c in chunks]
    except jax.errors.TracerArrayConversionError:  # abstract construction: stay in jnp
        return (jnp.concatenate(chunks)[:size].reshape(shape) * scale).astype(dtype)  # shape
    values = np.concatenate(host)[:size].reshape(shape) * scale  # shape
    return jnp.asarray(values, dtype)


class RMSNorm(nnx.Module):
    """`x / rms(x) * scale`, computed in float32."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))  # [D]

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)  # [..., D]
        inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)  # [..., 1]
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))  # [1.., D]
        return (x32 * inv_rms * scale).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding ("rotate half" convention of Llama / HF) at absolute `positions`.

    x: [B, T, heads, H]; positions: int [B, T] (negative positions of padding are harmless).
    """
    head_dim = x.shape[-1]
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(0, half, dtype=jnp.float32) * 2.0 / head_dim)  # [H/2]
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, H/2]
    sin = jnp.sin(angles)[:, :, None, :]  # [B, T, 1, H/2]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]  # [B, T, heads, H/2] each
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)  # [B, T, heads, H]
    return rotated.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, dim: int, hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate = nnx.Param(normal_init(rngs.params(), (dim, hidden), dim, dtype))  # [D, F]
        self.up = nnx.Param(normal_init(rngs.params(), (dim, hidden), dim, dtype))  # [D, F]
        self.down = nnx.Param(normal_init(rngs.params(), (hidden, dim), hidden, dtype))  # [F, D]

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = einsum("btd,df->btf", x, self.gate[...])  # [B, T, F]
        up = einsum("btd,df->btf", x, self.up[...])  # [B, T, F]
        hidden = jax.nn.silu(gate) * up  # [B, T, F]
        return einsum("btf,fd->btd", hidden, self.down[...])  # [B, T, D]
