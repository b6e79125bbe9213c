"""`ModelRunner`: one jitted call per forward batch: paged forward, last-position logits, sampling.

The pools are donated (the forward writes K/V in place); only the sampled tokens and two
float32 diagnostics per row (the chosen token's logit and the top-2 margin) come back to the
host. Sampling (temperature, top-k, top-p, seeded keys) runs inside the same jit. Every
trace increments `num_traces`, so tests can assert that a warmed-up engine never recompiles
(the Python body runs only when jit traces a new shape).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from kvjax.engine.batching import ForwardBatch
from kvjax.engine.sampling import sample


class ModelRunner:
    def __init__(self, model: Any, *, impl: str = "auto") -> None:
        self.model = model
        self.impl = impl
        self.num_traces = 0
        self.shapes: set[tuple] = set()  # (B, T, max_blocks) seen
        graphdef, state = nnx.split(model)
        self._state = state

        def step(state, tokens, positions, pools, tables, seq_lens, slots, temperature, top_p, top_k, seed, index):
            self.num_traces += 1
            model = nnx.merge(graphdef, state)
            logits, pools = model.paged_forward(tokens, positions, pools, tables, seq_lens, slots, impl=impl)
            last = logits[:, -1, :]  # [B, V]: rows are right-aligned, the last token is at T - 1
            tok, chosen, margin = sample(last, temperature, top_p, seed, index, top_k)
            return tok, chosen, margin, pools

        self._step = jax.jit(step, donate_argnums=(3,))

    def run(
        self,
        pools,
        batch: ForwardBatch,
        temperature: np.ndarray,
        top_p: np.ndarray,
        seed: np.ndarray,
        index: np.ndarray,
        top_k: np.ndarray | None = None,
    ):
        """Forward `batch` and sample each real row's next token.

        temperature, top_p: float32 [rows]; seed, index, top_k: int32 [rows] (padded here to the
        batch; top_k <= 0 or None: no top-k).
        Returns (tokens int32 [rows], chosen logits float32 [rows], margins float32 [rows], pools).
        """
        b = batch.tokens.shape[0]
        n = batch.num_rows

        def pad(a, dtype, fill):
            out = np.full((b,), fill, dtype)  # [B]
            out[:n] = a
            return out

        self.shapes.add(batch.shape)
        tok, chosen, margin, pools = self._step(
            self._state,
            batch.tokens,
            batch.positions,
            pools,
            batch.tables,
            batch.seq_lens,
            batch.slots,
            pad(temperature, np.float32, 0.0),
            pad(top_p, np.float32, 1.0),
            pad(np.zeros(n, np.int32) if top_k is None else top_k, np.int32, 0),
            pad(seed, np.int32, 0),
            pad(index, np.int32, 0),
        )
        tok, chosen, margin = jax.device_get((tok, chosen, margin))
        return np.asarray(tok)[:n], np.asarray(chosen)[:n], np.asarray(margin)[:n], pools
