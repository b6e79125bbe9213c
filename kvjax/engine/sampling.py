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
    from jaxtyping import Array, Bool, Float, Int


CANDIDATES = 256  # the tokens a top-p nucleus is taken from (see `sample`)
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's and vLLM's limit)


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
    n            independent completions of the prompt (each its own key stream: with a
                 `seed`, completion i uses seed + i, as vLLM); the prompt is computed once
                 and its cached blocks shared.
    logprobs     return the logprob of each generated token and of the `logprobs` most likely
                 tokens (0..20) at its position; None: none.
    prompt_logprobs  the same for every prompt token (the first has none); None: none. Such a
                 request computes its whole prompt (it reads nothing from the prefix cache).
    presence_penalty, frequency_penalty  in [-2, 2]: subtracted once / per occurrence from
                 the logits of tokens already generated (0: off).
    repetition_penalty  > 0: divides the positive logits and multiplies the negative ones of
                 tokens seen in the prompt or the output (1: off).
    min_tokens   the end-of-sequence and stop tokens are masked, and stop strings ignored,
                 until this many tokens are generated (<= max_tokens).
    Logprobs are those of the model's raw distribution (before penalties and temperature),
    as vLLM returns them by default.
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
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

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
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:  # completion i draws with seed + i
            raise ValueError(f"seed + n - 1 must be <= {INT64_MAX} (completion i uses seed + i), got seed={self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Does any penalty change the logits?"""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def request_seed(base_seed: int, request_id: Hashable) -> int:
    """A stable 31-bit seed for one request (crc32 of its id mixed with the run's seed)."""
    return (zlib.crc32(repr(request_id).encode()) ^ (base_seed * 0x9E3779B1)) & 0x7FFFFFFF


def key_seed(params: SamplingParams, base_seed: int, request_id: Hashable) -> int:
    """The 31-bit key seed of a request: from `params.seed` alone when given (same seed, same
    draws, whatever the request id), else from the engine's seed and the request id."""
    if params.seed is not None:
        return request_seed(params.seed, "kvjax.seed")
    return request_seed(base_seed, request_id)


def _kth_largest(x: Float[Array, "B V"], k: Int[Array, " B"]) -> Float[Array, " B"]:
    """The k-th largest value of each row, exactly, without sorting: a bisection over the
    order-preserving integer images of the float32 values (32 passes of a count over [B, V]).
    x: float32 [B, V]; k: int32 [B] in [1, V]. Returns float32 [B]."""
    import jax
    import jax.numpy as jnp

    top = jnp.uint32(0x80000000)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [B, V]
    key = jnp.where(bits & top, ~bits, bits | top)  # [B, V]: unsigned, same order as x
    lo = jnp.zeros(x.shape[:1], jnp.uint32)  # [B] invariant: count(key >= lo) >= k
    hi = jnp.full(x.shape[:1], 0xFFFFFFFF, jnp.uint32)  # [B] invariant: the answer is <= hi

    def body(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)  # ceil((lo + hi) / 2) without overflow
        ok = jnp.sum(key >= mid[:, None], axis=-1) >= k  # [B]
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    back = jnp.where(lo & top, lo & ~top, ~lo)  # [B]
    return jax.lax.bitcast_convert_type(back, jnp.float32)


def _draw(logits: Float[Array, "B V"], temperature: Float[Array, " B"], top_p: Float[Array, " B"], top_k: Int[Array, " B"],
          seed: Int[Array, " B"], index: Int[Array, " B"], candidates: int) -> Int[Array, " B"]:
    """Sampled tokens of every row (the caller keeps them for the rows with temperature > 0).

    The top-k set is exact for any k (ties at the k-th value are kept, as vLLM does); the
    top-p nucleus is taken over the `candidates` most likely tokens of that set, with their
    probabilities normalised over the whole set, so it is exact whenever those tokens hold at
    least `top_p` of the mass; otherwise the row samples among them (renormalised).
    """
    import jax
    import jax.numpy as jnp

    b, v = logits.shape
    k = min(candidates, v)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]  # [B, V]
    cand, ids = jax.lax.top_k(scaled, k)  # [B, k], most likely first
    limited = (top_k > 0) & (top_k < v)  # [B]
    in_cand = limited & (top_k <= k)  # [B] the k-th value is among the candidates
    kth_cand = jnp.take_along_axis(cand, jnp.clip(top_k - 1, 0, k - 1)[:, None], axis=-1)[:, 0]  # [B]
    wide = limited & ~in_cand  # [B] top_k beyond the candidates: bisection (only if some row needs it)
    kth_wide = jax.lax.cond(
        jnp.any(wide), lambda: _kth_largest(scaled, jnp.clip(top_k, 1, v)), lambda: jnp.zeros((b,), jnp.float32)
    )
    threshold = jnp.where(in_cand, kth_cand, jnp.where(wide, kth_wide, -jnp.inf))  # [B]
    full = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)  # [B, V] the top-k set
    lse = jax.nn.logsumexp(full, axis=-1)  # [B] its normaliser
    in_set = cand >= threshold[:, None]  # [B, k]
    probs = jnp.where(in_set, jnp.exp(cand - lse[:, None]), 0.0)  # [B, k]
    before = jnp.cumsum(probs, axis=-1) - probs  # [B, k] mass strictly before each candidate

    nucleus_probs = jnp.where(in_set & (before < top_p[:, None]), probs, 0.0)  # [B, k]; the first is always kept
    u = jax.vmap(lambda s, i: jax.random.uniform(jax.random.fold_in(jax.random.key(s), i)))(seed, index)  # [B] in [0, 1)

    def inverse_cdf(p):  # the first token whose cumulative probability exceeds u * total: [B, n] -> [B]
        c = jnp.cumsum(p, axis=-1)  # [B, n]
        return jnp.argmax(c > (u * c[:, -1])[:, None], axis=-1).astype(jnp.int32)

    part = jnp.take_along_axis(ids, inverse_cdf(nucleus_probs)[:, None], axis=-1)[:, 0]  # [B]
    whole = jax.lax.cond(  # only when some row samples its whole top-k set
        jnp.any(top_p >= 1.0), lambda: inverse_cdf(jnp.exp(full - lse[:, None])), lambda: part
    )
    return jnp.where(top_p >= 1.0, whole, part).astype(jnp.int32)  # [B]


def sample(
    logits: Float[Array, "B V"],
    temperature: Float[Array, " B"],
    top_p: Float[Array, " B"],
    seed: Int[Array, " B"],
    index: Int[Array, " B"],
    top_k: Int[Array, " B"] | None = None,
    *,
    candidates: int = CANDIDATES,
) -> tuple[Int[Array, " B"], Float[Array, " B"], Float[Array, " B"]]:
    """Sample one token per row (traceable; the engine calls it inside its jitted step).

    logits: float32 [B, V]; temperature, top_p: float32 [B]; seed, index: int32 [B] (the
    request's seed and the index of the output token being drawn); top_k: int32 [B] (<= 0 or
    None: no top-k). Greedy and sampled rows mix freely in one batch, and one executable
    serves every setting: a greedy row is the argmax, and a batch without a sampled row runs
    only the argmax (`lax.cond`), never the sampling path. Nothing sorts the vocabulary:
    top-k is exact for any k (a `lax.top_k` of `candidates` tokens, and a bisection for a
    larger k); top-p takes its nucleus from the `candidates` (256) most likely tokens of the
    top-k set, exact whenever they hold at least `top_p` of its probability, else sampling
    among those 256. A row with top_p = 1 samples from its whole top-k set.
    Returns (tokens int32 [B], chosen-token logit float32 [B], top-2 logit margin float32 [B]).
    """
    import jax
    import jax.numpy as jnp

    if top_k is None:
        top_k = jnp.zeros(logits.shape[:1], jnp.int32)  # [B]
    v = logits.shape[-1]
    vocab = jnp.arange(v, dtype=jnp.int32)[None, :]  # [1, V]
    # argmax as max + first index of it (jnp.argmax's variadic reduction is ~30x slower on CPU;
    # same ties: the lowest id); the runner-up by a masked max (slicing a lax.top_k(., 2)
    # makes XLA's CPU backend sort the row)
    best = jnp.max(logits, axis=-1)  # [B]
    greedy = jnp.min(jnp.where(logits == best[:, None], vocab, v), axis=-1) % v  # [B] (a NaN row: 0)
    others = jnp.where(vocab == greedy[:, None], -jnp.inf, logits)  # [B, V]
    margin = best - jnp.max(others, axis=-1)  # [B]
    sampled = temperature > 0  # [B]

    def draw():
        drawn = _draw(logits, temperature, top_p, top_k, seed, index, candidates)
        return jnp.where(sampled, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)  # [B]
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]  # [B]
    return tokens, chosen, margin


def apply_penalties(
    logits: Float[Array, "B V"],
    counts: Int[Array, "B V"],
    prompt_mask: Bool[Array, "B V"],
    banned: Bool[Array, "B V"],
    presence: Float[Array, " B"],
    frequency: Float[Array, " B"],
    repetition: Float[Array, " B"],
) -> Float[Array, "B V"]:
    """vLLM's penalties and min_tokens mask (traceable).

    logits: float32 [B, V]; counts: int32 [B, V] (each token's count in the output so far);
    prompt_mask, banned: bool [B, V] (tokens of the prompt; tokens masked to -inf: the stop
    tokens of a row that has not generated `min_tokens` yet); presence, frequency,
    repetition: float32 [B]. Repetition divides positive logits and multiplies the others
    for every token seen in the prompt or the output; frequency subtracts `count * penalty`,
    presence `penalty` once, for output tokens only (OpenAI's definitions).
    """
    import jax.numpy as jnp

    in_output = counts > 0  # [B, V]
    rep = jnp.where(prompt_mask | in_output, repetition[:, None], 1.0)  # [B, V]
    x = jnp.where(logits > 0, logits / rep, logits * rep)
    x = x - frequency[:, None] * counts.astype(jnp.float32) - presence[:, None] * in_output.astype(jnp.float32)
    return jnp.where(banned, -jnp.inf, x)


def token_logprobs(
    logits: Float[Array, "*P V"], tokens: Int[Array, "*P"], num: int = MAX_LOGPROBS
) -> tuple[Float[Array, "*P"], Int[Array, "*P"], Int[Array, "*P N"], Float[Array, "*P N"]]:
    """Log-probabilities of the raw model distribution (before penalties and temperature, as
    vLLM returns them by default): the given tokens' logprobs and ranks (1 = most likely),
    and the `num` most likely tokens with theirs.
    logits: float32 [..., V]; tokens: int32 [...]. Returns (logprob float32 [...], rank int32
    [...], top ids int32 [..., num], top logprobs float32 [..., num])."""
    import jax
    import jax.numpy as jnp

    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [..., V]
    chosen = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]  # [...]
    rank = 1 + jnp.sum(lp > chosen[..., None], axis=-1, dtype=jnp.int32)  # [...]
    top_lp, top_ids = jax.lax.top_k(lp, min(num, lp.shape[-1]))  # [..., num]
    return chosen, rank, top_ids.astype(jnp.int32), top_lp
