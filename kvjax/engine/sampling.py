"""Token sampling: greedy, or temperature + top-p with a seeded key per (request, output index).

The key of a request's n-th output token is `fold_in(key(request_seed), n)`: it depends on the
request and the position only, never on the batch the token was sampled in, so a run with
prefix reuse and one without draw the same tokens from the same logits.
"""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Hashable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` is greedy (argmax); otherwise sample from the top-p nucleus of
    `softmax(logits / temperature)`. `seed` seeds the request's key stream."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def request_seed(base_seed: int, request_id: Hashable) -> int:
    """A stable 31-bit seed for one request (crc32 of its id mixed with the run's seed)."""
    return (zlib.crc32(repr(request_id).encode()) ^ (base_seed * 0x9E3779B1)) & 0x7FFFFFFF


def _top_p_logits(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) the tokens outside the smallest set whose probability reaches `top_p`.
    logits: [V] float32 (already divided by the temperature); top_p: [] float32."""
    order = jnp.argsort(-logits)  # [V], most likely first
    sorted_logits = logits[order]  # [V]
    probs = jax.nn.softmax(sorted_logits)  # [V]
    before = jnp.cumsum(probs) - probs  # [V] mass strictly before each token
    keep_sorted = before < top_p  # [V]; the most likely token is always kept
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)  # [V]
    return jnp.where(keep, logits, -jnp.inf)


def sample(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seed: jax.Array, index: jax.Array):
    """Sample one token per row (traceable; the engine calls it inside its jitted step).

    logits: float32 [B, V]; temperature, top_p: float32 [B]; seed, index: int32 [B] (the
    request's seed and the index of the output token being drawn). Greedy and sampled rows
    mix freely in one batch (one executable per shape, whatever the sampling settings).
    Returns (tokens int32 [B], chosen-token logit float32 [B], top-2 logit margin float32 [B]).
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    top2 = jax.lax.top_k(logits, 2)[0]  # [B, 2]
    margin = top2[:, 0] - top2[:, 1]  # [B]

    def draw(row, t, p, s, i):
        key = jax.random.fold_in(jax.random.key(s), i)
        scaled = row / jnp.where(t > 0, t, 1.0)  # [V]
        return jax.random.categorical(key, _top_p_logits(scaled, p)).astype(jnp.int32)

    drawn = jax.vmap(draw)(logits, temperature, top_p, seed, index)  # [B]
    tokens = jnp.where(temperature > 0, drawn, greedy)  # [B]
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]  # [B]
    return tokens, chosen, margin
