"""Grouped-query attention: projections, the dense (no cache) path and the paged path.

Visibility convention, shared with `kvjax.device.paged_attention`: key `j` is visible to the
query at position `p` iff `p - window < j <= p` (a global layer has `window >= max_seq_len`).
Query head `n` reads KV head `n // G` with `G = N // K`. Letters: see `kvjax.models.layers`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.device import attention as device_attention
from kvjax.models.layers import RMSNorm, apply_rope, einsum, normal_init, rope_frequencies


def visibility_mask(q_positions: jax.Array, k_positions: jax.Array, window: int) -> jax.Array:
    """bool [B, T, S]: key at `k_positions[b, s]` is visible to the query at `q_positions[b, t]`.
    The rule lives in `kvjax.device.attention`, shared with the paged ops."""
    return device_attention.visibility_mask(q_positions, k_positions, window)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Softmax attention with KV-head groups, in float32 (`kvjax.device.attention`'s formula).

    q: [B, T, N, H]; k, v: [B, S, K, H]; mask: bool [B, T, S] -> [B, T, N, H].
    A query that sees no key (padding) gets zeros, never NaN.
    """
    return device_attention.grouped_attention(q, k, v, mask, scale)


class Attention(nnx.Module):
    """GQA self-attention with RoPE; the cache plumbing lives in `Transformer.paged_forward`.

    Options around the shared attention maths: q/k/v biases (`qkv_bias`, Qwen2), an output bias
    (`out_bias`), per-head RMSNorm of queries and keys before RoPE (`qk_norm`, Qwen3 / Gemma 3,
    with `norm_offset` the norm's style), the softmax scale (`scale`, default `head_dim ** -0.5`)
    and the RoPE frequencies (`rope_theta`, optionally `rope_scaling`, see `rope_frequencies`).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        scale: float | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_offset: float = 0.0,
        rope_scaling: Any = None,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling  # a frozen `RopeScaling` or None: static under jit
        self.scale = head_dim**-0.5 if scale is None else scale
        self.wq = nnx.Param(normal_init(rngs.params(), (dim, num_heads, head_dim), dim, dtype))  # [D, N, H]
        self.wk = nnx.Param(normal_init(rngs.params(), (dim, num_kv_heads, head_dim), dim, dtype))  # [D, K, H]
        self.wv = nnx.Param(normal_init(rngs.params(), (dim, num_kv_heads, head_dim), dim, dtype))  # [D, K, H]
        fan_in = num_heads * head_dim
        self.wo = nnx.Param(normal_init(rngs.params(), (num_heads, head_dim, dim), fan_in, dtype))  # [N, H, D]
        if qkv_bias:
            self.bq = nnx.Param(jnp.zeros((num_heads, head_dim), dtype))  # [N, H]
            self.bk = nnx.Param(jnp.zeros((num_kv_heads, head_dim), dtype))  # [K, H]
            self.bv = nnx.Param(jnp.zeros((num_kv_heads, head_dim), dtype))  # [K, H]
        else:
            self.bq = self.bk = self.bv = None
        self.bo = nnx.Param(jnp.zeros((dim,), dtype)) if out_bias else None  # [D]
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, offset=norm_offset)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, dtype=dtype, offset=norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return apply_rope(x, positions, rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling))

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [B, T, D], positions: int [B, T] -> q [B, T, N, H], k, v [B, T, K, H] (RoPE applied to q, k)."""
        q = einsum("btd,dnh->btnh", x, self.wq[...])  # [B, T, N, H]
        k = einsum("btd,dkh->btkh", x, self.wk[...])  # [B, T, K, H]
        v = einsum("btd,dkh->btkh", x, self.wv[...])  # [B, T, K, H]
        if self.bq is not None:
            q = q + self.bq[...]  # [B, T, N, H]
            k = k + self.bk[...]  # [B, T, K, H]
            v = v + self.bv[...]  # [B, T, K, H]
        if self.q_norm is not None:
            q = self.q_norm(q)  # [B, T, N, H]
            k = self.k_norm(k)  # [B, T, K, H]
        q = self._rope(q, positions)  # [B, T, N, H]
        k = self._rope(k, positions)  # [B, T, K, H]
        return q, k, v

    def out(self, attended: jax.Array) -> jax.Array:
        """attended: [B, T, N, H] -> [B, T, D]."""
        out = einsum("btnh,nhd->btd", attended, self.wo[...])  # [B, T, D]
        return out if self.bo is None else out + self.bo[...]

    def dense(self, x: jax.Array, positions: jax.Array, window: int) -> jax.Array:
        """Full recompute over the whole sequence (the test oracle). x: [B, S, D] -> [B, S, D]."""
        q, k, v = self.qkv(x, positions)  # [B, S, N, H], [B, S, K, H], [B, S, K, H]
        mask = visibility_mask(positions, positions, window)  # [B, S, S]
        return self.out(grouped_attention(q, k, v, mask, self.scale))  # [B, S, D]
