"""Greedy generation with the dense forward: the token-level oracle for serving tests.

Every step recomputes the whole sequence (no cache), so it is slow but independent of the
paged cache, the ledger and the scheduler. Rows are right-padded to a power-of-two length
bucket (causal attention makes right padding invisible), so a run compiles a handful of shapes.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from kvjax.models.transformer import Transformer, jit_dense_forward


def _bucket(n: int, minimum: int = 1) -> int:
    return 1 << (max(n, minimum) - 1).bit_length()


def dense_greedy(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    eos_id: int | None = None,
    forward=None,
) -> list[list[int]]:
    """Greedy (argmax) continuations of `prompts`; each stops after its `max_new_tokens` or at `eos_id`
    (included). Returns the generated tokens only, one list per prompt.

    `forward`: a `jit_dense_forward(model)` to reuse across calls (its compilations are kept).
    """
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    if len(max_new_tokens) != len(prompts):
        raise ValueError(f"{len(max_new_tokens)=} must match {len(prompts)=}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    limit = model.spec.max_seq_len
    for p, n in zip(prompts, max_new_tokens, strict=True):
        if n < 0 or len(p) + n > limit:
            raise ValueError(f"prompt of {len(p)} tokens + {n} new tokens exceeds max_seq_len={limit}")
    fwd = forward or jit_dense_forward(model)
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    active = [n > 0 for n in max_new_tokens]
    while any(active):
        rows = [i for i, a in enumerate(active) if a]
        length = _bucket(max(len(seqs[i]) for i in rows), minimum=16)
        tokens = np.zeros((_bucket(len(rows)), length), np.int32)  # [B, S]
        for r, i in enumerate(rows):
            tokens[r, : len(seqs[i])] = seqs[i]
        logits = fwd(jnp.asarray(tokens))  # [B, S, V]
        last = jnp.asarray([len(seqs[i]) - 1 for i in rows] + [0] * (tokens.shape[0] - len(rows)))  # [B]
        next_tokens = np.asarray(jnp.argmax(logits[jnp.arange(tokens.shape[0]), last], axis=-1))  # [B]
        for r, i in enumerate(rows):
            token = int(next_tokens[r])
            seqs[i].append(token)
            out[i].append(token)
            if len(out[i]) >= max_new_tokens[i] or (eos_id is not None and token == eos_id):
                active[i] = False
    return out
