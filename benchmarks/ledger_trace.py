"""The ledger benchmark's deterministic trace, shared by every process that replays it.

No kvjax import here: the peer adapters (benchmarks/peer_adapters/) run in a separate Python
3.11 venv that has vLLM and SGLang but not kvjax, and rebuild the identical trace from the same
parameters; `trace_digest` lets them prove it is identical before anything is timed.

A trace is a list of (system prompt index, prompt tokens, generated tokens): N requests, each =
one of P system prompts (S tokens, uniform or Zipf popularity) + U unique tokens, then G
generated tokens.
"""
from __future__ import annotations

import hashlib
import random
from array import array

# The parameters a trace depends on; both processes must agree on all of them.
TRACE_PARAMS = ("requests", "num_prompts", "system_tokens", "unique_tokens", "gen_tokens", "zipf", "vocab", "seed")


def make_trace(a):
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(a.vocab) for _ in range(a.system_tokens)] for _ in range(a.num_prompts)]
    if a.zipf > 0:
        weights = [1.0 / (k + 1) ** a.zipf for k in range(a.num_prompts)]
        choice = rng.choices(range(a.num_prompts), weights=weights, k=a.requests)
    else:
        choice = [rng.randrange(a.num_prompts) for _ in range(a.requests)]
    trace = []
    for i in range(a.requests):
        prompt = prompts[choice[i]] + [rng.randrange(a.vocab) for _ in range(a.unique_tokens)]
        gen = [rng.randrange(a.vocab) for _ in range(a.gen_tokens)]
        trace.append((choice[i], prompt, gen))
    return trace


def trace_digest(trace) -> str:
    """SHA-256 over every token of the trace, in order (cheap next to any replay)."""
    h = hashlib.sha256()
    for p, prompt, gen in trace:
        h.update(array("q", [p, len(prompt), len(gen)]).tobytes())
        h.update(array("q", prompt).tobytes())
        h.update(array("q", gen).tobytes())
    return h.hexdigest()


def ideal_hit_rate(trace, a) -> float:
    """Share of prompt tokens an unbounded block cache could reuse: every system prompt after
    its first appearance (the unique tails never repeat)."""
    seen, reusable, total = set(), 0, 0
    for p, prompt, _ in trace:
        total += len(prompt)
        if p in seen:
            reusable += a.system_tokens
        seen.add(p)
    return reusable / total


def waves(trace, c):
    """(index of the wave's first request, the wave's requests), C requests at a time."""
    for start in range(0, len(trace), c):
        yield start, trace[start : start + c]
