"""`ModelRunner`: the engine's device side: the pools, their transfers, and one jitted call per
forward batch (paged forward, last-position logits, sampling).

The pools are donated (the forward writes K/V in place); only the sampled tokens and two
float32 diagnostics per row (the chosen token's logit and the top-2 margin) come back to the
host. `dispatch` enqueues a forward and returns at once (`PendingForward.fetch` waits for its
results; `run` is both), and a later dispatch may take its decode rows' input tokens straight
from an earlier one's device tokens (`TokenFeed`), so an overlapped engine never waits for a
step's tokens before sending the next. Sampling (temperature, top-k, top-p, seeded keys) runs inside the same jit, and so do,
when a batch asks for them (`StepExtras`; separate executables, so a batch that does not pays
nothing), penalties / min_tokens masks and logprobs (of the sampled tokens, or of every prompt
position of a prefill chunk). Every
trace increments `num_traces`, so tests can assert that a warmed-up engine never recompiles
(the Python body runs only when jit traces a new shape).

With a `mesh` (tensor parallelism, possibly spanning processes under `jax.distributed`) the
model's weights are sharded over it (`shard_model`), the pools are allocated with their kv
heads over it, every input of the step is a global replicated array built from the same host
values on every process, and the sampled tokens come back replicated, so every process reads
the same tokens.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvjax.engine.batching import ForwardBatch, StepExtras, build_batch
from kvjax.engine.sampling import apply_penalties, sample, token_logprobs

log = logging.getLogger("kvjax.engine.runner")


class ModelRunner:
    def __init__(self, model: Any, *, impl: str = "auto", mesh: Mesh | None = None) -> None:
        if mesh is not None:
            from kvjax.models.parallel import shard_model

            shard_model(model, mesh)
        self.model = model
        self.impl = impl
        self.mesh = mesh
        self.num_traces = 0
        self.shapes: set[tuple] = set()  # (B, T, max_blocks) seen
        graphdef, state = nnx.split(model)
        self._state = state
        self._replicated = None if mesh is None else NamedSharding(mesh, P())

        def step(state, tokens, positions, pools, tables, seq_lens, slots, temperature, top_p, top_k, seed, index,
                 penalties=None, prompt_targets=None, *, logprobs=False):
            self.num_traces += 1
            model = nnx.merge(graphdef, state)
            logits, pools = model.paged_forward(tokens, positions, pools, tables, seq_lens, slots, impl=impl)
            last = logits[:, -1, :]  # [B, V]: rows are right-aligned, the last token is at T - 1
            processed = last if penalties is None else apply_penalties(last, *penalties)
            tok, chosen, margin = sample(processed, temperature, top_p, seed, index, top_k)
            extras = {}
            if logprobs:  # of the raw distribution, as vLLM by default
                extras["logprobs"] = token_logprobs(last, tok)
            if prompt_targets is not None:  # [B, T]: the token after each position
                extras["prompt_logprobs"] = token_logprobs(logits, prompt_targets)
            out = (tok, chosen, margin, extras)
            if self._replicated is not None:  # every process reads the same tokens
                out = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._replicated), out)
            return out, pools

        self._step = jax.jit(step, donate_argnums=(3,), static_argnames=("logprobs",))
        self._feed = jax.jit(_feed_tokens)

    # ------------------------------------------------------------------ the core's device side
    def batch(self, ledger, rows, buckets, chunk_bucket: int | None = None) -> ForwardBatch:
        """The bucketed forward inputs of `rows`, read from the ledger's block tables."""
        return build_batch(ledger, rows, buckets, chunk_bucket=chunk_bucket)

    def allocate_pools(self, config):
        """Zero pools for `config`, kv heads sharded over the mesh if there is one."""
        from kvjax.device import allocate_pools

        return allocate_pools(config, sharding=self.mesh)

    def apply_transfers(self, pools, plan):
        """Carry out a ledger transfer plan (offload / onboard / copy); returns the new pools."""
        from kvjax.device import apply_transfers

        return apply_transfers(pools, plan)

    def _global(self, x: np.ndarray):
        """A host array as the step's input: as is on one device, else a global replicated array
        (every process passes the same values and provides its own devices' copies)."""
        if self._replicated is None:
            return x
        return jax.make_array_from_callback(x.shape, self._replicated, lambda index: x[index])

    def dispatch(
        self,
        pools,
        batch: ForwardBatch,
        temperature: np.ndarray,
        top_p: np.ndarray,
        seed: np.ndarray,
        index: np.ndarray,
        top_k: np.ndarray | None = None,
        extras: StepExtras | None = None,
        feed: TokenFeed | None = None,
    ) -> tuple[PendingForward, Any]:
        """`run` without waiting: the forward is enqueued (jax dispatches asynchronously) and
        the pools it returns are handed back at once, so the host can prepare the next step
        while the device computes this one. `feed`: decode rows whose input token is still on
        the device (an earlier dispatch's sampled tokens, `PendingForward.tokens`). Returns
        (pending, pools); `pending.fetch()` waits and gives what `run` returns, minus the pools."""
        b = batch.tokens.shape[0]
        n = batch.num_rows

        def pad(a, dtype, fill):
            out = np.full((b,) + np.shape(a)[1:], fill, dtype)  # [B, ...]
            out[:n] = a
            return out

        if batch.shape not in self.shapes:  # the wait a first request of a new shape sees, said when it starts
            log.info("compiling the forward for a new shape [B=%d, T=%d, blocks=%d]", *batch.shape)
        self.shapes.add(batch.shape)
        traces, start = self.num_traces, time.perf_counter()
        g = self._global
        penalties = prompt_targets = None
        if extras is not None and extras.penalties is not None:
            counts, prompt_mask, banned, presence, frequency, repetition = extras.penalties
            penalties = (g(pad(counts, np.int32, 0)), g(pad(prompt_mask, bool, False)), g(pad(banned, bool, False)),
                         g(pad(presence, np.float32, 0.0)), g(pad(frequency, np.float32, 0.0)),
                         g(pad(repetition, np.float32, 1.0)))
        if extras is not None and extras.prompt_targets is not None:
            prompt_targets = g(pad(extras.prompt_targets, np.int32, 0))
        tokens = g(batch.tokens)  # [B, T]
        if feed is not None:
            tokens = self._feed(tokens, tuple(feed.sources), g(pad(feed.index, np.int32, -1)))
        (tok, chosen, margin, more), pools = self._step(
            self._state,
            tokens,
            g(batch.positions),
            pools,
            {w: g(t) for w, t in batch.tables.items()},
            g(batch.seq_lens),
            {w: g(s) for w, s in batch.slots.items()},
            g(pad(temperature, np.float32, 0.0)),
            g(pad(top_p, np.float32, 1.0)),
            g(pad(np.zeros(n, np.int32) if top_k is None else top_k, np.int32, 0)),
            g(pad(seed, np.int32, 0)),
            g(pad(index, np.int32, 0)),
            penalties,
            prompt_targets,
            logprobs=extras is not None and extras.logprobs,
        )
        if self.num_traces != traces:
            log.info("compiled the forward for [B=%d, T=%d, blocks=%d] in %.2f s (%d programs so far)", *batch.shape,
                     time.perf_counter() - start, self.num_traces)
        return PendingForward(tok, (tok, chosen, margin, more), n, extras is not None), pools

    def run(
        self,
        pools,
        batch: ForwardBatch,
        temperature: np.ndarray,
        top_p: np.ndarray,
        seed: np.ndarray,
        index: np.ndarray,
        top_k: np.ndarray | None = None,
        extras: StepExtras | None = None,
    ):
        """Forward `batch` and sample each real row's next token (`dispatch`, then `fetch`).

        temperature, top_p: float32 [rows]; seed, index, top_k: int32 [rows] (padded here to the
        batch; top_k <= 0 or None: no top-k).
        Returns (tokens int32 [rows], chosen logits float32 [rows], margins float32 [rows], pools),
        and with `extras` a fifth item: what it asked for (see `StepExtras.results`).
        """
        pending, pools = self.dispatch(pools, batch, temperature, top_p, seed, index, top_k, extras)
        out = pending.fetch()
        return out[:3] + (pools,) + out[3:]


@dataclasses.dataclass(frozen=True)
class TokenFeed:
    """Decode rows whose input token an earlier dispatch is still sampling: row i's token is
    entry `index[i]` of the `sources` (earlier `PendingForward.tokens`, int32 [B'] each,
    concatenated in order); -1 keeps the batch's own token. `index`: int32 [rows]."""

    sources: tuple
    index: np.ndarray


def _feed_tokens(tokens, sources, index):
    """tokens int32 [B, T] with each fed row's last column taken from the device tokens."""
    prev = sources[0] if len(sources) == 1 else jnp.concatenate(sources)  # [P]
    last = jnp.where(index >= 0, prev[jnp.maximum(index, 0)], tokens[:, -1])  # [B]
    return tokens.at[:, -1].set(last)


class PendingForward:
    """A dispatched forward: `tokens` (its sampled tokens, on the device: int32 [B], padded)
    feed later dispatches; `fetch()` waits for it and returns (tokens, chosen logits, margins)
    as numpy `[rows]`, plus the extras' results when it computed some (as `run`)."""

    def __init__(self, tokens, outputs, rows: int, with_extras: bool) -> None:
        self.tokens = tokens
        self._outputs = outputs
        self._rows = rows
        self._with_extras = with_extras
        self._result: tuple | None = None

    def fetch(self) -> tuple:
        if self._result is None:
            tok, chosen, margin, more = jax.device_get(self._outputs)
            n = self._rows
            out: tuple = (np.asarray(tok)[:n], np.asarray(chosen)[:n], np.asarray(margin)[:n])
            if self._with_extras:
                out += ({k: tuple(np.asarray(a)[:n] for a in v) for k, v in more.items()},)
            self._result = out
            self._outputs = None
        return self._result
