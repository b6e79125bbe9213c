"""`HybridRunner`: the engine's device side for hybrid models (LFM2, Granite-4.0-H dense,
Qwen3.5): KV pools for the attention layers, state pools for the recurrent layers, and ONE
jitted call per step, as `ModelRunner` (whose step inputs, sampling and fetch it shares).

What differs from the Transformer runner:
- the cache: `HybridPools` (the attention layers' `KVPools` of `kv_cache_view(config)`, the
  recurrent layers' `StatePools` of the ledger's recurrent pool); a ledger transfer plan is
  split (`split_state_plan`): state entries move whole state slots (`apply_state_transfers`),
  the rest are renumbered for the KV pools (`kv_plan`);
- the batch: `build_step` over the attention window only, plus per row the state slots of the
  ledger's `begin_recurrent_step` (called here, once per forward, with each row's chunk end:
  the read slot holds the state at the chunk's start, the write slot gets the state after it)
  and the row's real token count (`HybridStepBatch.states`, int32 [R, 3]); beginning a step
  may evict a cached snapshot to the host tier, so the ledger's transfers taken then travel
  with the batch and run before its forward (`HybridStepBatch.plan`);
- the forward: `kvjax.models.hybrid.paged.paged_hidden`.

Not supported (refused with `HybridServingError`): tensor parallelism (a mesh) and the
overlapped engine (`async_scheduling`: a step's state slots are begun from the ledger at batch
time, before the previous step's tokens are known).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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
    StepShape,
    TokenFeed,
    build_step,
)
from kvjax.engine.runner import ModelRunner, PendingStep
from kvjax.engine.sampling import apply_penalties, sample, token_logprobs
from kvjax.errors import KVCacheError
from kvjax.hf_config import UnsupportedConfigError

#: columns of `HybridStepBatch.states`
ST_READ, ST_WRITE, ST_LEN = 0, 1, 2


class HybridServingError(UnsupportedConfigError):
    """A serving option the hybrid models do not support (tensor parallelism, async scheduling)."""


class HybridStateError(KVCacheError, AssertionError):
    """The ledger's recurrent step disagrees with the engine's rows (a bug, never a user error)."""


def is_hybrid(model: Any) -> bool:
    """A model of `kvjax.models.hybrid` (served by `HybridRunner`)."""
    from kvjax.models.hybrid import Granite, Lfm2, Qwen35ForCausalLM

    return isinstance(model, (Lfm2, Granite, Qwen35ForCausalLM))


@dataclasses.dataclass(frozen=True)
class HybridStepBatch:
    """A `StepBatch` over the attention window plus the recurrent rows: `states` int32
    [R, 3]: read slot, write slot (-1: none), real tokens (0: a padding row)."""

    step: StepBatch
    states: np.ndarray
    plan: Any = None  # the ledger's transfers that beginning the steps decided (applied first)

    @property
    def shape(self) -> StepShape:
        return self.step.shape

    @property
    def num_rows(self) -> int:
        return self.step.num_rows

    @property
    def real_rows(self) -> np.ndarray:
        return self.step.real_rows


def padding_batch(batch: StepBatch, null_slot: int) -> HybridStepBatch:
    """A `padding_step` batch (every window's columns, no real row) as the hybrid step's:
    the attention window's table and slot columns only, every row reading the null state slot
    and writing none. It compiles and runs the program a real step of its shape does."""
    if batch.num_rows:
        raise HybridStateError(f"a plain StepBatch with {batch.num_rows} real rows: hybrid steps come from "
                               "HybridRunner.batch")
    windows = batch.windows
    (i,) = [k for k, w in enumerate(windows) if w >= 0]
    m = batch.shape.blocks
    rows = np.concatenate([batch.rows[:, :ROW_TABLES], batch.rows[:, ROW_TABLES + i * m:ROW_TABLES + (i + 1) * m]], 1)
    tokens = np.concatenate([batch.tokens[:, :TOK_SLOTS], batch.tokens[:, TOK_SLOTS + i:TOK_SLOTS + i + 1]], 1)
    step = StepBatch(batch.shape, (windows[i],), rows, tokens, 0, 0)
    states = np.zeros((batch.shape.rows, 3), np.int32)  # [R, 3]
    states[:, ST_READ], states[:, ST_WRITE] = null_slot, -1
    return HybridStepBatch(step, states)


class HybridRunner(ModelRunner):
    """`ModelRunner` for a hybrid model (module docstring)."""

    def __init__(self, model: Any, *, impl: str = "auto", mesh: Any = None) -> None:
        from kvjax.models.hybrid.paged import HybridGroup, hybrid_layout, paged_hidden

        if mesh is not None:
            raise HybridServingError(f"{type(model).__name__}: tensor parallelism is not implemented for hybrid models")
        self.layout = hybrid_layout(model)
        self.model = model
        self.impl = impl
        self.mesh = None
        self.num_traces = 0
        self.num_forwards = 0
        self.num_feeds = 0
        self.shapes: set[StepShape] = set()
        graphdef, state = nnx.split(model)
        weights, treedef = jax.tree.flatten(state)
        self._weights = weights
        self._replicated = None

        def step(weights, pools, rows, floats, tokens, penalties, prompt_targets, states, *, shape: StepShape,
                 windows: tuple[int, ...], logprobs: bool = False):
            self.num_traces += 1
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
            bd, bp, t, m = shape
            seq_lens = rows[:, ROW_SEQ_LEN]  # [R]
            table = rows[:, ROW_TABLES:ROW_TABLES + m]  # [R, M]: the attention window (the batch's only one)
            groups = []
            for lo, size, q_len in ((0, bd, 1), (bd, bp, t)):
                if size:
                    sl = slice(lo, lo + size)
                    groups.append(HybridGroup(size, q_len, table[sl], seq_lens[sl], states[sl, ST_READ],
                                              states[sl, ST_WRITE], states[sl, ST_LEN]))
            hidden, pools = paged_hidden(model, tokens[:, TOK_ID], tokens[:, TOK_POSITION], pools, groups,
                                         tokens[:, TOK_SLOTS], impl=impl)  # [N, D]
            last = jnp.concatenate([jnp.arange(bd, dtype=jnp.int32),
                                    bd + t * jnp.arange(bp, dtype=jnp.int32) + t - 1])  # [R]: each row's last token
            extras = {}
            if prompt_targets is None:
                logits = model.logits(hidden[last])  # [R, V]
            else:
                every = model.logits(hidden)  # [N, V]
                logits = every[last]
                extras["prompt_logprobs"] = token_logprobs(every[bd:].reshape(bp, t, -1), prompt_targets)
            processed = logits if penalties is None else apply_penalties(logits, *penalties)
            tok, chosen, margin = sample(processed, floats[:, 0], floats[:, 1], rows[:, ROW_SEED], rows[:, ROW_INDEX],
                                         rows[:, ROW_TOP_K])
            if logprobs:
                extras["logprobs"] = token_logprobs(logits, tok)
            return (tok, chosen, margin, extras), pools

        self._step = jax.jit(step, donate_argnums=(1,), static_argnames=("shape", "windows", "logprobs"))

    def check_cache(self, config) -> None:
        """`InvalidArgumentError` unless `config` is this model's hybrid cache (`hybrid_cache_config`)."""
        from kvjax.models.hybrid.paged import check_hybrid_cache

        check_hybrid_cache(self.model, config)

    # ------------------------------------------------------------------ the core's device side
    def batch(self, ledger, decode: list[Row], prefill: list[Row], buckets) -> HybridStepBatch:  # type: ignore[override]
        """The step's inputs over the attention window, and each row's recurrent step begun in
        the ledger (ends: the row's last token; every row's state starts where its chunk does)."""
        from kvjax.models.hybrid.paged import attention_window

        window = attention_window(ledger.config)
        step = build_step(ledger, decode, prefill, buckets, windows=(window,))
        rows = [*decode, *prefill]
        rec = ledger.begin_recurrent_step([r.request_id for r in rows], [r.seq_len for r in rows])
        starts = np.array([r.start for r in rows], np.int64)
        if not np.array_equal(rec.starts, starts):
            raise HybridStateError(f"recurrent states start at {rec.starts.tolist()}, the rows at {starts.tolist()}")
        states = np.zeros((step.shape.rows, 3), np.int32)  # [R, 3]
        states[:, ST_READ] = ledger.config.primary_blocks_for(-1)  # the null slot: zeros
        states[:, ST_WRITE] = -1
        place = step.real_rows
        states[place, ST_READ] = rec.read_slots
        states[place, ST_WRITE] = rec.write_slots
        states[place, ST_LEN] = [len(r.tokens) for r in rows]
        # a fresh write block may evict a cached snapshot (offloaded to the host tier): that copy
        # must run before this forward writes the slot, so it travels with the batch
        plan = ledger.take_transfers()
        return HybridStepBatch(step, states, plan if len(plan) else None)

    def allocate_pools(self, config):
        """Zero KV pools of the attention layers and state pools of the recurrent ones."""
        from kvjax.device import allocate_pools
        from kvjax.device.state_pools import allocate_state_pools
        from kvjax.models.hybrid.paged import HybridPools, kv_cache_view, state_geometry

        self.check_cache(config)
        return HybridPools(allocate_pools(kv_cache_view(config)), allocate_state_pools(state_geometry(config, self.layout)))

    def apply_transfers(self, pools, plan):
        """The ledger's plan: state-slot entries on the state pools, the rest on the KV pools."""
        from kvjax.device import apply_transfers
        from kvjax.device.state_pools import apply_state_transfers, split_state_plan
        from kvjax.models.hybrid.paged import HybridPools, kv_plan

        geo = pools.states.geometry
        mine, rest = split_state_plan(plan, geo.plan_pool)
        states = apply_state_transfers(pools.states, mine)
        kv = apply_transfers(pools.kv, kv_plan(rest, geo.plan_pool)) if len(rest) else pools.kv
        return HybridPools(kv, states)

    def dispatch(self, pools, batch, temperature, top_p, seed, index, top_k=None,
                 extras: StepExtras | None = None, feed: TokenFeed | None = None) -> tuple[PendingStep, Any]:
        """`ModelRunner.dispatch` for a `HybridStepBatch` (no token feed: no overlap)."""
        if feed is not None:
            raise HybridServingError("hybrid models are not served with async_scheduling (no token feed)")
        if isinstance(batch, StepBatch):  # an all-padding batch of the cache's windows (a warmup)
            batch = padding_batch(batch, pools.states.geometry.null_slot)
        step = batch.step
        if batch.plan is not None:
            pools = self.apply_transfers(pools, batch.plan)
        self.shapes.add(step.shape)
        args, static = self.step_inputs(step, temperature, top_p, seed, index, top_k, extras)
        self.num_forwards += 1
        out, pools = self._step(self._weights, pools, *args, self._global(batch.states), **static)
        return PendingStep(out, step), pools

    def lower(self, pools, batch, extras: StepExtras | None = None):
        z = np.zeros(batch.num_rows, np.int32)
        args, static = self.step_inputs(batch.step, z.astype(np.float32), np.ones(batch.num_rows, np.float32), z, z, z,
                                        extras)
        return self._step.lower(self._weights, pools, *args, batch.states, **static)
