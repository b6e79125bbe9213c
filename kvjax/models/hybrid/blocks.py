"""What the hybrid families share: attention over a contiguous cache, the causal LM around the
layers (`HybridLM`: LFM2, Granite), and the chunk checks.

Letters: B batch, T new tokens, S cached positions, D model width, N query heads, K kv heads,
H head dim, V vocabulary.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax.errors import InvalidArgumentError
from kvjax.models.attention import grouped_attention
from kvjax.models.hybrid.state import HybridState, KVState
from kvjax.models.layers import RMSNorm, apply_rope, einsum, normal_init, rope_frequencies


class HybridAttention(nnx.Module):
    """Causal GQA over everything so far: optional q/k RMSNorm (LFM2), RoPE or none (Granite's
    `nope`), softmax scale of the family, optional biases. No sliding window."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 scale: float, rope_theta: float | None, qk_norm_eps: float | None = None, bias: bool = False):
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale
        self.rope_theta = rope_theta
        self.wq = nnx.Param(normal_init(rngs.params(), (dim, heads, head_dim), dim, dtype))  # [D, N, H]
        self.wk = nnx.Param(normal_init(rngs.params(), (dim, kv_heads, head_dim), dim, dtype))  # [D, K, H]
        self.wv = nnx.Param(normal_init(rngs.params(), (dim, kv_heads, head_dim), dim, dtype))  # [D, K, H]
        self.wo = nnx.Param(normal_init(rngs.params(), (heads, head_dim, dim), heads * head_dim, dtype))  # [N, H, D]
        if bias:
            self.bq: nnx.Param | None = nnx.Param(jnp.zeros((heads, head_dim), dtype))  # [N, H]
            self.bk: nnx.Param | None = nnx.Param(jnp.zeros((kv_heads, head_dim), dtype))  # [K, H]
            self.bv: nnx.Param | None = nnx.Param(jnp.zeros((kv_heads, head_dim), dtype))  # [K, H]
            self.bo: nnx.Param | None = nnx.Param(jnp.zeros((dim,), dtype))  # [D]
        else:
            self.bq = self.bk = self.bv = self.bo = None
        if qk_norm_eps is not None:
            self.q_norm: RMSNorm | None = RMSNorm(head_dim, eps=qk_norm_eps, dtype=dtype)
            self.k_norm: RMSNorm | None = RMSNorm(head_dim, eps=qk_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"],
                 cache: KVState | None, start: Int[Array, ""] | None) -> tuple[Float[Array, "B T D"], KVState | None]:
        """Without `cache`: causal attention within `x` (the dense oracle). With it: write this
        chunk's keys / values at `[start, start + T)` and attend to positions `<= ` each query's."""
        q, k, v = self.project(x, positions)  # [B, T, N, H], [B, T, K, H] x2
        b, t = x.shape[:2]
        if cache is None:
            keys, values, k_pos = k, v, positions  # [B, T, K, H] x2, [B, T]
            new_cache = None
        else:
            assert start is not None
            zero = jnp.zeros((), jnp.int32)
            keys = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (zero, start, zero, zero))  # [B, S, K, H]
            values = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (zero, start, zero, zero))
            k_pos = jnp.broadcast_to(jnp.arange(keys.shape[1], dtype=jnp.int32), (b, keys.shape[1]))  # [B, S]
            new_cache = KVState(k=keys, v=values)
        mask = k_pos[:, None, :] <= positions[:, :, None]  # [B, T, S]: causal, unwritten slots lie beyond
        attended = grouped_attention(q, keys, values, mask, self.scale)  # [B, T, N, H]
        return self.output(attended), new_cache

    def project(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"]
                ) -> tuple[Float[Array, "B T N H"], Float[Array, "B T K H"], Float[Array, "B T K H"]]:
        """Queries, keys and values of `x` at `positions` (biases, q/k norms and RoPE applied):
        what a paged cache stores (keys, values) and attends with (queries)."""
        q = einsum("btd,dnh->btnh", x, self.wq[...])  # [B, T, N, H]
        k = einsum("btd,dkh->btkh", x, self.wk[...])  # [B, T, K, H]
        v = einsum("btd,dkh->btkh", x, self.wv[...])  # [B, T, K, H]
        if self.bq is not None and self.bk is not None and self.bv is not None:
            q, k, v = q + self.bq[...], k + self.bk[...], v + self.bv[...]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            inv_freq = rope_frequencies(self.head_dim, self.rope_theta)  # [H/2]
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        return q, k, v

    def output(self, attended: Float[Array, "B T N H"]) -> Float[Array, "B T D"]:
        """The output projection of the attended values."""
        out = einsum("btnh,nhd->btd", attended, self.wo[...])  # [B, T, D]
        return out if self.bo is None else out + self.bo[...]


class HybridLM(nnx.Module):
    """The causal LM around a family's layers: token embedding, final RMSNorm, output head (tied to
    the embedding or not), `init_state` and the layer loops of `dense_forward` (no state: the
    oracle) and `forward_chunk` (chunks of any size carrying `HybridState`), which give the same
    logits. One home for what LFM2 and Granite do alike; a family brings `make_layer(kind, dtype)`
    (layers called as `layer(x, positions, state, start)`, `state` None in `dense_forward`),
    `_recurrent_state`, and overrides `_embed` / `_logits` where it scales them."""

    def __init__(self, spec: Any, make_layer: Callable[[str, jnp.dtype], nnx.Module], *, rngs: nnx.Rngs):
        self.spec = spec
        dtype = jnp.dtype(spec.dtype)
        self.dtype = dtype
        self.embed = nnx.Param(normal_init(rngs.params(), (spec.vocab_size, spec.hidden_size), 1, dtype))  # [V, D]
        self.layers = nnx.List([make_layer(t, dtype) for t in spec.layer_types])
        self.final_norm = RMSNorm(spec.hidden_size, eps=spec.norm_eps, dtype=dtype)
        if spec.tie_embeddings:
            self.lm_head: nnx.Param | None = None
        else:
            self.lm_head = nnx.Param(normal_init(rngs.params(), (spec.hidden_size, spec.vocab_size),
                                                 spec.hidden_size, dtype))  # [D, V]

    def _recurrent_state(self, kind: str, batch: int) -> Any:
        """A fresh state of a `kind` layer for `batch` rows; None for an attention layer."""
        raise NotImplementedError(f"{type(self).__name__} does not say which of its layers are recurrent")

    def init_state(self, batch: int, max_len: int) -> HybridState:
        """A fresh state for `batch` rows of at most `max_len` tokens (the attention caches' size)."""
        if batch < 1 or max_len < 1:
            raise InvalidArgumentError(f"batch and max_len must be >= 1, got {batch}, {max_len}")
        s = self.spec
        layers: list[Any] = []
        for kind in s.layer_types:
            state = self._recurrent_state(kind, batch)
            if state is None:
                shape = (batch, max_len, s.num_kv_heads, s.head_dim)  # [B, S, K, H]
                state = KVState(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype))
            layers.append(state)
        return HybridState(layers=tuple(layers), length=jnp.zeros((), jnp.int32))

    def _embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        return jnp.take(self.embed[...], tokens, axis=0)  # [B, T, D]

    def embed_tokens(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        """The family's (scaled) token embedding: the paged engine's forward starts here."""
        return self._embed(tokens)

    def logits(self, hidden: Float[Array, "R D"]) -> Float[Array, "R V"]:
        """Final norm and head (the family's scaling) of chosen hidden states: float32 [R, V]."""
        return self._logits(hidden[None])[0]

    def _logits(self, x: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        x = self.final_norm(x)  # [B, T, D]
        if self.lm_head is None:
            return einsum("btd,vd->btv", x, self.embed[...]).astype(jnp.float32)  # [B, T, V]
        return einsum("btd,dv->btv", x, self.lm_head[...]).astype(jnp.float32)  # [B, T, V]

    def dense_forward(self, tokens: Int[Array, "B S"]) -> Float[Array, "B S V"]:
        """float32 logits of every position, everything recomputed (the oracle)."""
        b, s = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))  # [B, S]
        x = self._embed(tokens)  # [B, S, D]
        for layer in self.layers:
            x, _ = layer(x, positions, None, None)
        return self._logits(x)

    def forward_chunk(self, tokens: Int[Array, "B T"], state: HybridState
                      ) -> tuple[Float[Array, "B T V"], HybridState]:
        """The next T tokens of every row after `state.length` tokens: (float32 logits [B, T, V], state)."""
        check_chunk(tokens, state, self.spec.vocab_size)
        b, t = tokens.shape
        positions = state.length + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
        x = self._embed(tokens)  # [B, T, D]
        new_layers = []
        for layer, layer_state in zip(self.layers, state.layers, strict=True):
            x, new = layer(x, positions, layer_state, state.length)
            new_layers.append(new)
        return self._logits(x), HybridState(layers=tuple(new_layers), length=state.length + t)


def check_chunk(tokens: jax.Array, state: HybridState, vocab_size: int) -> None:
    """Refuse a chunk that does not fit the state: wrong shape, past the attention caches' end
    (`dynamic_update_slice` would clamp the write position silently), or token ids out of range.
    Values are checked when concrete; the jitted wrapper checks before it calls the compiled step."""
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise InvalidArgumentError(f"tokens must be [batch, T>=1], got shape {tuple(tokens.shape)}")
    rows = jax.tree.leaves(state.layers)[0].shape[0]
    if tokens.shape[0] != rows:
        raise InvalidArgumentError(f"{tokens.shape[0]} token rows for a state of {rows} rows")
    if isinstance(state.length, jax.core.Tracer) or isinstance(tokens, jax.core.Tracer):
        return
    length = int(state.length)
    cap = state.capacity
    if cap and length + tokens.shape[1] > cap:
        raise InvalidArgumentError(f"a chunk of {tokens.shape[1]} tokens after {length} does not fit the state's "
                                   f"attention cache of {cap} positions")
    lo, hi = int(jnp.min(tokens)), int(jnp.max(tokens))
    if lo < 0 or hi >= vocab_size:
        raise InvalidArgumentError(f"token ids must lie in [0, {vocab_size}), got [{lo}, {hi}]")


def jit_forward_chunk(model: Any) -> Callable[[jax.Array, HybridState], tuple[jax.Array, HybridState]]:
    """`model.forward_chunk` compiled once per chunk shape, the state donated (the caller's copy is
    gone after the call); the chunk is checked against the state before it runs (under jit a
    write past the attention caches would be clamped)."""
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def run(params, tokens, state):
        return nnx.merge(graphdef, params).forward_chunk(tokens, state)

    def step(tokens: jax.Array, state: HybridState) -> tuple[jax.Array, HybridState]:
        tokens = jnp.asarray(tokens, jnp.int32)
        check_chunk(tokens, state, model.spec.vocab_size)
        return run(params, tokens, state)

    step.run = run  # type: ignore[attr-defined]  # the compiled function, for trace counting
    return step
