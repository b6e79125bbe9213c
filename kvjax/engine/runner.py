"""`ModelRunner`: the engine's device side: the pools, their transfers, and ONE jitted call per
step (`StepBatch`: the decode rows and the prefill chunks together; paged forward, LM head on
the sampled positions only, sampling).

The forward reads the weights once per step: the decode group `[Bd, 1]` and the prefill group
`[Bp, T]` are one flat token batch for everything but attention, which runs per group
(`Transformer.paged_hidden`). The LM head runs on one position per row (its last token: the one
sampled), except when a prefill row scores its prompt (`StepExtras.prompt_targets`): then on
every position of the prefill group (a separate program).

Dispatch is kept cheap: the weights are flattened once (a list of arrays; the nnx graph is
merged back inside the trace only), and a step ships three host arrays (`StepBatch.rows`,
`StepBatch.tokens`, float32 temperature / top_p [rows, 2]) plus, only when asked, the extras.
`dispatch` returns at once with a `PendingStep` (the device works on); its `fetch` is the
blocking read of the sampled tokens. `run` is both. A later dispatch may take decode rows' input
tokens straight from an earlier step's device tokens (`TokenFeed`, `PendingStep.tokens`), so an
overlapped engine (kvjax/engine/overlap.py) never waits for a step's tokens before sending the
next; the feed is a small jitted op of its own that writes those rows' `tokens[:, TOK_ID]`, so
the step program is the same with and without it.

The pools are donated (the forward writes K/V in place); only the sampled tokens and two
float32 diagnostics per row (the chosen token's logit and the top-2 margin) come back to the
host. Sampling (temperature, top-k, top-p, seeded keys) runs inside the same jit, and so do,
when a batch asks for them (`StepExtras`; separate executables, so a batch that does not pays
nothing), penalties / min_tokens masks and logprobs (of the sampled tokens, or of every prompt
position of the prefill rows). Every trace increments `num_traces`, so tests can assert that a
warmed-up engine never recompiles (the Python body runs only when jit traces a new shape), and
every dispatch `num_forwards`.

With a `mesh` (tensor parallelism, possibly spanning processes under `jax.distributed`) the
model's weights are sharded over it (`shard_model`), the pools are allocated with their kv
heads over it, every input of the step is a global replicated array built from the same host
values on every process, and the sampled tokens come back replicated, so every process reads
the same tokens.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from kvjax.engine.batching import (
    ROW_INDEX,
    ROW_SEED,
    ROW_SEQ_LEN,
    ROW_TABLES,
    ROW_TOP_K,
    TOK_ID,
    TOK_POSITION,
    TOK_SLOTS,
    Row,
    StepBatch,
    StepExtras,
    StepOutput,
    StepShape,
    TokenFeed,
    build_step,
)
from kvjax.engine.sampling import apply_penalties, sample, token_logprobs
from kvjax.hf_config import HybridModelNotServedError
from kvjax.model_spec import ModelSpec

log = logging.getLogger("kvjax.engine.runner")


class PendingStep:
    """A dispatched step: the device is computing; `fetch()` waits for it and returns the
    real rows' `StepOutput` (numpy). `tokens` (device) feeds a later dispatch (`TokenFeed`)."""

    def __init__(self, out: Any, batch: StepBatch, on_fetch=None) -> None:
        self._out = out
        self._batch = batch
        self._on_fetch = on_fetch

    def arrays(self):
        """The step's device outputs (tokens, chosen, margins, extras), not waited for."""
        return self._out

    @property
    def tokens(self):
        """The sampled tokens on the device, not waited for: int32 [Bd + Bp], padding rows
        included (real row i is at `real_rows[i]`)."""
        return self._out[0]

    @property
    def real_rows(self) -> np.ndarray:
        """int [rows]: where each real row's token sits in `tokens`."""
        return self._batch.real_rows

    def fetch(self) -> StepOutput:
        tok, chosen, margin, more = jax.device_get(self._out)
        b = self._batch
        rows = b.real_rows  # [rows]
        results = {}
        for k, v in more.items():  # prompt logprobs: [Bp, T, ...], of the prefill rows only
            take = rows if k != "prompt_logprobs" else np.arange(b.num_prefill)
            results[k] = tuple(np.asarray(a)[take] for a in v)
        out = StepOutput(np.asarray(tok)[rows], np.asarray(chosen)[rows], np.asarray(margin)[rows], results)
        if self._on_fetch is not None:
            self._on_fetch()
            self._on_fetch = None
        return out


class ModelRunner:
    def __init__(self, model: Any, *, impl: str = "auto", mesh: Mesh | None = None) -> None:
        spec = getattr(model, "spec", None)
        if spec is not None and not isinstance(spec, ModelSpec):  # a hybrid model: no paged forward, no KV-only cache
            raise HybridModelNotServedError(
                f"{type(model).__name__} ({getattr(spec, 'name', '?')}) is a hybrid model: its runner is "
                "kvjax.engine.hybrid_runner.HybridRunner (Engine(model) picks it)"
            )
        if mesh is not None:
            from kvjax.models.parallel import shard_model

            shard_model(model, mesh)
        self.model = model
        self.impl = impl
        self.mesh = mesh
        self.num_traces = 0
        self.num_forwards = 0  # dispatched steps (one per engine step that has work)
        self.shapes: set[StepShape] = set()  # step shapes seen
        graphdef, state = nnx.split(model)
        weights, treedef = jax.tree.flatten(state)
        self._weights = weights  # the flat leaves, split once: no per-call pytree walk of the nnx State
        self._replicated = None if mesh is None else NamedSharding(mesh, P())

        def step(weights, pools, rows, floats, tokens, penalties=None, prompt_targets=None, *, shape: StepShape,
                 windows: tuple[int, ...], logprobs: bool = False):
            from kvjax.models.transformer import RowGroup

            self.num_traces += 1
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
            bd, bp, t, m = shape
            seq_lens = rows[:, ROW_SEQ_LEN]  # [R]
            tables = {w: rows[:, ROW_TABLES + i * m : ROW_TABLES + (i + 1) * m] for i, w in enumerate(windows)}  # [R, M]
            slots = {w: tokens[:, TOK_SLOTS + i] for i, w in enumerate(windows)}  # [N]
            groups = []
            if bd:
                groups.append(RowGroup(bd, 1, {w: a[:bd] for w, a in tables.items()}, seq_lens[:bd]))
            if bp:
                groups.append(RowGroup(bp, t, {w: a[bd:] for w, a in tables.items()}, seq_lens[bd:]))
            hidden, pools = model.paged_hidden(tokens[:, TOK_ID], tokens[:, TOK_POSITION], pools, groups, slots,
                                               impl=impl)  # [N, D]
            last = jnp.concatenate([jnp.arange(bd, dtype=jnp.int32),
                                    bd + t * jnp.arange(bp, dtype=jnp.int32) + t - 1])  # [R]: each row's last token
            extras = {}
            if prompt_targets is None:
                logits = model.logits(hidden[last])  # [R, V]: the LM head on the sampled positions only
            else:  # every prefill position's logits (prompt logprobs), the decode rows' own
                every = model.logits(hidden)  # [N, V]
                logits = every[last]  # [R, V]
                per_position = every[bd:].reshape(bp, t, -1)  # [Bp, T, V]
                extras["prompt_logprobs"] = token_logprobs(per_position, prompt_targets)
            processed = logits if penalties is None else apply_penalties(logits, *penalties)
            tok, chosen, margin = sample(processed, floats[:, 0], floats[:, 1], rows[:, ROW_SEED], rows[:, ROW_INDEX],
                                         rows[:, ROW_TOP_K])
            if logprobs:  # of the raw distribution, as vLLM by default
                extras["logprobs"] = token_logprobs(logits, tok)
            out = (tok, chosen, margin, extras)
            if self._replicated is not None:  # every process reads the same tokens
                out = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self._replicated), out)
            return out, pools

        self._step = jax.jit(step, donate_argnums=(1,), static_argnames=("shape", "windows", "logprobs"))
        self._feed = jax.jit(_feed_tokens)
        self.num_feeds = 0  # dispatches whose decode rows took tokens from an earlier step's device tokens

    # ------------------------------------------------------------------ the core's device side
    def batch(self, ledger, decode: list[Row], prefill: list[Row], buckets) -> StepBatch:
        """The step's bucketed forward inputs (`build_step`), read from the ledger's block tables."""
        return build_step(ledger, decode, prefill, buckets)

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

    @property
    def weights(self) -> list:
        """The model's weights as the flat list of arrays the step program takes first."""
        return self._weights

    @property
    def step_program(self):
        """The jitted step: `step_program(weights, pools, *arrays, **static)` with `step_inputs`'
        arrays and static arguments; returns ((tokens, chosen, margins, extras), pools), the
        pools donated. For tools (benchmarks, warmups); the engine calls `dispatch`."""
        return self._step

    def step_inputs(self, batch: StepBatch, temperature, top_p, seed, index, top_k, extras: StepExtras | None):
        """The jitted step's array inputs and static arguments for `batch` (see `dispatch`)."""
        shape = batch.shape
        place = batch.real_rows  # [rows]
        r = shape.rows

        def spread(a, dtype, fill):  # real rows -> their places among the batch's R rows
            out = np.full((r,) + np.shape(a)[1:], fill, dtype)  # [R, ...]
            out[place] = a
            return out

        rows = batch.rows  # [R, 4 + W * M]
        rows[place, ROW_TOP_K] = 0 if top_k is None else top_k
        rows[place, ROW_SEED] = seed
        rows[place, ROW_INDEX] = index
        floats = np.zeros((r, 2), np.float32)  # [R, 2]: temperature, top_p
        floats[:, 1] = 1.0
        floats[place, 0] = temperature
        floats[place, 1] = top_p
        g = self._global
        penalties = prompt_targets = None
        if extras is not None and extras.penalties is not None:
            counts, prompt_mask, banned, presence, frequency, repetition = extras.penalties
            penalties = (g(spread(counts, np.int32, 0)), g(spread(prompt_mask, bool, False)),
                         g(spread(banned, bool, False)), g(spread(presence, np.float32, 0.0)),
                         g(spread(frequency, np.float32, 0.0)), g(spread(repetition, np.float32, 1.0)))
        if extras is not None and extras.prompt_targets is not None:
            targets = np.zeros((shape.prefill_rows, shape.chunk), np.int32)  # [Bp, T]
            targets[: batch.num_prefill] = extras.prompt_targets
            prompt_targets = g(targets)
        args = (g(rows), g(floats), g(batch.tokens), penalties, prompt_targets)
        static = dict(shape=shape, windows=batch.windows, logprobs=extras is not None and extras.logprobs)
        return args, static

    def dispatch(
        self,
        pools,
        batch: StepBatch,
        temperature: np.ndarray,
        top_p: np.ndarray,
        seed: np.ndarray,
        index: np.ndarray,
        top_k: np.ndarray | None = None,
        extras: StepExtras | None = None,
        feed: TokenFeed | None = None,
    ) -> tuple[PendingStep, Any]:
        """Start the step's forward and sampling of `batch`; returns at once with
        (`PendingStep`, the new pools) (the old pools are donated).

        temperature, top_p: float32 [rows]; seed, index, top_k: int32 [rows] (rows: the batch's
        real rows, decode then prefill; top_k <= 0 or None: no top-k). `extras` rows likewise,
        except `prompt_targets`: int32 [prefill rows, T]. Fills `batch.rows`' sampling columns.
        `feed`: decode rows whose input token an earlier, unread dispatch is sampling.
        """
        shape = batch.shape
        if shape not in self.shapes:  # the wait a first request of a new shape sees, said when it starts
            log.info("compiling the forward for a new step shape %s", shape)
        self.shapes.add(shape)
        traces, start = self.num_traces, time.perf_counter()
        args, static = self.step_inputs(batch, temperature, top_p, seed, index, top_k, extras)
        if feed is not None:  # [N, 2 + W]: the fed decode rows' ids from the device, not the host
            index_d = feed.device_index(batch)  # [Bd]
            args = (args[0], args[1], self._feed(args[2], feed.tokens, self._global(index_d)), *args[3:])
            self.num_feeds += 1
        self.num_forwards += 1
        out, pools = self._step(self._weights, pools, *args, **static)
        on_fetch = None
        if self.num_traces != traces:
            def on_fetch():
                log.info("compiled the forward for %s in %.2f s (%d programs so far)", shape,
                         time.perf_counter() - start, self.num_traces)
        return PendingStep(out, batch, on_fetch), pools

    def lower(self, pools, batch: StepBatch, extras: StepExtras | None = None):
        """The step's program for `batch`'s shape, lowered (`jax.stages.Lowered`: its text,
        cost analysis), without running it; sampling inputs are zeros."""
        z = np.zeros(batch.num_rows, np.int32)
        args, static = self.step_inputs(batch, z.astype(np.float32), np.ones(batch.num_rows, np.float32), z, z, z, extras)
        return self._step.lower(self._weights, pools, *args, **static)

    def run(self, pools, batch: StepBatch, temperature: np.ndarray, top_p: np.ndarray, seed: np.ndarray,
            index: np.ndarray, top_k: np.ndarray | None = None,
            extras: StepExtras | None = None) -> tuple[StepOutput, Any]:
        """`dispatch` then `fetch`: (the real rows' `StepOutput`, the new pools)."""
        pending, pools = self.dispatch(pools, batch, temperature, top_p, seed, index, top_k, extras)
        return pending.fetch(), pools


def _feed_tokens(tokens: Int[Array, "N C"], prev: Int[Array, " P"], index: Int[Array, " Bd"]) -> Int[Array, "N C"]:
    """tokens with each fed decode row's id (`TOK_ID` of the first `Bd` tokens: the decode
    group, one token per row) taken from `prev` (an earlier step's sampled tokens)."""
    bd = index.shape[0]
    own = tokens[:bd, TOK_ID]  # [Bd]
    fed = jnp.where(index >= 0, prev[jnp.maximum(index, 0)], own)  # [Bd]
    return tokens.at[:bd, TOK_ID].set(fed)
