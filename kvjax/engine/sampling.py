"""Token sampling: greedy, or temperature + top-k + top-p with a seeded key per (request, output index).

The key of a request's n-th output token is `fold_in(key(request_seed), n)`: it depends on the
request and the position only, never on the batch the token was sampled in, so a run with
prefix reuse and one without draw the same tokens from the same logits.

`SamplingParams` also carries what ends a request (`max_tokens`, `stop` strings,
`stop_token_ids`, `ignore_eos`): the engine checks the token-level ones after each sampled
token, `LLMEngine` the stop strings on the detokenised text.
"""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # JAX is imported where sampling runs, so `SamplingParams` stays light
    import jax


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


INT32_MAX = 2**31 - 1  # top_k, max_tokens and token ids travel to the device as int32
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds: OpenAI's (and vLLM's) range


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to draw a request's tokens and when to stop (vLLM's names and meanings).

    temperature  0 is greedy (argmax; the default here); otherwise sample from
                 `softmax(logits / temperature)` restricted to the top-k, then the top-p nucleus.
    top_p        nucleus mass in (0, 1]; 1 keeps every token.
    seed         the request's key stream: the same seed, prompt and settings draw the same
                 tokens whatever else runs; None derives one from the request id.
    max_tokens   most tokens to generate (>= 1).
    top_k        keep the k most likely tokens; 0 or -1 keeps all.
    stop         strings that end the output; the text stops before the first one found
                 (the string itself is not included).
    stop_token_ids  token ids that end the output (the token is kept in `token_ids`, its
                 text is not included).
    ignore_eos   keep generating past the model's end-of-sequence tokens.
    skip_special_tokens  leave special tokens out of the output text.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and not (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be an int in [{INT64_MIN}, {INT64_MAX}] or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise ValueError(f"max_tokens must be an int in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be an int in [1, {INT32_MAX}], or 0 / -1 for all tokens, got {self.top_k!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and 0 <= i <= INT32_MAX for i in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids in [0, {INT32_MAX}], got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def request_seed(base_seed: int, request_id: Hashable) -> int:
    """A stable 31-bit seed for one request (crc32 of its id mixed with the run's seed)."""
    return (zlib.crc32(repr(request_id).encode()) ^ (base_seed * 0x9E3779B1)) & 0x7FFFFFFF


def key_seed(params: SamplingParams, base_seed: int, request_id: Hashable) -> int:
    """The 31-bit key seed of a request: from `params.seed` alone when given (same seed, same
    draws, whatever the request id), else from the engine's seed and the request id."""
    if params.seed is not None:
        return request_seed(params.seed, "kvjax.seed")
    return request_seed(base_seed, request_id)


def _filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask (to -inf) the tokens outside the top-k, then outside the smallest set whose
    probability (renormalised over the top-k) reaches `top_p`.
    logits: [V] float32 (already divided by the temperature); top_k: [] int32 (<= 0: all);
    top_p: [] float32."""
    import jax
    import jax.numpy as jnp

    v = logits.shape[0]
    order = jnp.argsort(-logits)  # [V], most likely first
    sorted_logits = logits[order]  # [V]
    rank = jnp.arange(v, dtype=jnp.int32)  # [V]
    in_k = (top_k <= 0) | (rank < top_k)  # [V]
    probs = jax.nn.softmax(jnp.where(in_k, sorted_logits, -jnp.inf))  # [V]
    before = jnp.cumsum(probs) - probs  # [V] mass strictly before each token
    keep_sorted = in_k & (before < top_p)  # [V]; the most likely token is always kept
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)  # [V]
    return jnp.where(keep, logits, -jnp.inf)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    seed: jax.Array,
    index: jax.Array,
    top_k: jax.Array | None = None,
):
    """Sample one token per row (traceable; the engine calls it inside its jitted step).

    logits: float32 [B, V]; temperature, top_p: float32 [B]; seed, index: int32 [B] (the
    request's seed and the index of the output token being drawn); top_k: int32 [B] (<= 0 or
    None: no top-k). Greedy and sampled rows mix freely in one batch (one executable per
    shape, whatever the sampling settings).
    Returns (tokens int32 [B], chosen-token logit float32 [B], top-2 logit margin float32 [B]).
    """
    import jax
    import jax.numpy as jnp

    if top_k is None:
        top_k = jnp.zeros(logits.shape[:1], jnp.int32)  # [B]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    top2 = jax.lax.top_k(logits, 2)[0]  # [B, 2]
    margin = top2[:, 0] - top2[:, 1]  # [B]

    def draw(row, t, p, k, s, i):
        key = jax.random.fold_in(jax.random.key(s), i)
        scaled = row / jnp.where(t > 0, t, 1.0)  # [V]
        return jax.random.categorical(key, _filter_logits(scaled, k, p)).astype(jnp.int32)

    drawn = jax.vmap(draw)(logits, temperature, top_p, top_k, seed, index)  # [B]
    tokens = jnp.where(temperature > 0, drawn, greedy)  # [B]
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]  # [B]
    return tokens, chosen, margin
