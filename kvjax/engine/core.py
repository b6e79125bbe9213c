"""`EngineCore`: the step-wise serving loop over one ledger and one set of device pools.

Requests arrive at any time (`add_request`), each `step()` runs one iteration and returns the
tokens it produced, `abort_request` takes a request out (its blocks are stored for reuse), and
the ledger lives as long as the core, so later requests reuse what earlier ones cached.

One step:
  1. the `CapacityScheduler` picks running requests, admissions, pauses from the ledger's
     accounting (waiting requests in the queue policy's order: FCFS or LPM);
  2. ledger commits: `remove_sequence` for paused requests (blocks stored for reuse),
     `add_tokens` of the generating requests' pending tokens, `add_sequences` for admissions
     (prefix match, claims, allocation; the returned prepopulated length is what prefill
     skips), then prefill chunks are cut from the token budget;
  3. `take_transfers` -> `apply_transfers` (offload / onboard / copy) BEFORE the forward;
  4. ONE forward for the whole step (`_forward_step`): the decode rows `[Bd, 1]` and the
     prefill chunks `[Bp, T]` (oldest admission first, as many as `prefill_fits`) in one
     bucketed jitted call that reads the weights once (token-wise work on one flat batch,
     attention per row group), the LM head on each row's sampled position only, pools
     donated, sampling inside the jit (`ModelRunner.dispatch` / `fetch`);
  5. `store_new_blocks` after decode tokens, `set_context_position` after each chunk,
     `store_context_blocks` when a prompt is done; finished requests (a stop token or
     `max_new_tokens`) leave with `remove_sequence`.

`forward_shapes` (the core's `forward_shapes`, logged at start) lists every step shape its
settings can compile; `runner.num_forwards` counts one per step that has work.

The core checks as it goes that every admission's prefill computed + reused tokens equals its
prompt and that the reused count is what the ledger reported; `verify_idle()` checks that an
idle core's ledger holds no request and agrees with the core's counters. Its memory is bounded
by the pools and the live requests: nothing grows with the number of requests served, except
the per-step records kept when `record_steps` is on (for `Engine.run`'s metrics).

Overlap (`EngineConfig.async_scheduling`): the core's `OverlappedStepper` (kvjax/engine/overlap.py,
where its invariants are) schedules, commits and dispatches step n+1 while step n runs, then
reads step n's tokens, so `step()` returns the previous dispatch's tokens; each step with work
is still ONE forward. It runs the step from the core's pieces (`pause`, `commit_pending_tokens`,
`admit`, `prefill_chunks`, `apply_transfers`, `emit`, `finish`...: public for it, not for
callers, who drive the core with `add_request` / `step` / `abort_request`). Penalties /
min_tokens requests, multi-process ranks and runners without `dispatch` step synchronously.

The completions of an n > 1 request are requests of their own; all but the first are held
(`held`, outside the queue) until the first one's prompt is computed and its blocks stored,
then queued: their admission finds the prompt in the prefix cache.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Hashable, Sequence
from typing import cast

import numpy as np

from kvjax._math import ceil_div
from kvjax.capacity import max_block_requirements
from kvjax.config import CacheConfig
from kvjax.engine.batching import Row, forward_shapes, prefill_fits, table_width
from kvjax.engine.core_types import CoreCounters, CoreOutput, EngineBusyError, EngineInvariantError, StepCounts
from kvjax.engine.event_publishing import EventPublishing, KVEventsConfig, with_events
from kvjax.engine.forward_io import forward_inputs, row_logprobs
from kvjax.engine.metrics import StepRecord
from kvjax.engine.overlap import OverlappedStepper, needs_sync
from kvjax.engine.ranks import RankDigest, agree_on_cache, process_index, spans_processes
from kvjax.engine.request_state import Admission, LiveRequest, Phase, TokenLogprobs
from kvjax.engine.serving_clock import ServingClock
from kvjax.engine.store_tier_driver import KVStoreConfig, StoreTierDriver
from kvjax.engine.workloads import WorkItem
from kvjax.errors import DuplicateRequestError, InvalidRequestError, OutOfBlocksError, TransferError
from kvjax.transfer_plan import TransferKind

log = logging.getLogger("kvjax.engine.core")


class EngineCore:
    """A running engine: one ledger and pools for `cache_config`, the model and jitted runner of
    `engine` (`kvjax.engine.Engine`). Not thread-safe: one thread drives it (the server runs it
    on its engine thread)."""

    def __init__(self, engine, cache_config: CacheConfig, *, record_steps: bool = False, clock: ServingClock | None = None,
                 kv_events: KVEventsConfig | None = None, kv_transfer=None, kv_store: KVStoreConfig | None = None) -> None:
        from kvjax.compilation_cache import enable_compilation_cache
        from kvjax.engine.scheduler import CapacityScheduler
        from kvjax.ledger import KVCacheManager

        (getattr(engine.runner, "check_cache", None) or engine.model.check_cache)(cache_config)  # hybrids: the runner's
        enable_compilation_cache()  # the runner's programs persist across processes (kvjax.compilation_cache)
        if kv_events is not None:
            cache_config = with_events(cache_config)
        self.engine = engine
        self.cfg = engine.config
        # ranks of a mesh spanning processes: one ledger each, kept identical (see ranks.py)
        self.rank_digest: RankDigest | None = None
        if spans_processes(getattr(engine.runner, "mesh", None)):
            cache_config = agree_on_cache(cache_config, (repr(self.cfg), engine.model.spec))
            self.rank_digest = RankDigest(self.cfg.rank_check_interval)
        self.cache_config = cache_config
        self.ledger = KVCacheManager(cache_config)
        self.pools = engine.runner.allocate_pools(cache_config)
        # every step shape this core's one forward per step can compile (batching.forward_shapes)
        self.forward_shapes = forward_shapes(self.cfg, cache_config)
        log.info("the step's forward can take %d shapes (decode rows x prefill rows x chunk, block tables %d wide; "
                 "each compiled on first use unless warmed up)", len(self.forward_shapes), table_width(cache_config))
        self.events: EventPublishing | None = None
        if kv_events is not None and (self.rank_digest is None or process_index() == 0):  # one publisher per replica
            self.events = EventPublishing(kv_events, cache_config)
            self.events.publish(self.ledger)  # the ledger's Created events: AllBlocksCleared, batch 0
        self.scheduler = CapacityScheduler(self.cfg.scheduler, self.ledger)
        self.vocab = engine.model.spec.vocab_size
        self.clock = ServingClock() if clock is None else clock
        self.waiting: collections.deque[LiveRequest] = collections.deque()
        self.held: list[LiveRequest] = []  # waiting for another request's prompt (n > 1)
        self.running: dict[str, LiveRequest] = {}
        self._live: dict[Hashable, LiveRequest] = {}  # waiting + running, by id
        self.step_index = 0  # the next step's number (Engine.run may jump it forward when idle)
        self._order = 0
        self.counters = CoreCounters()
        self.accounting_misses = 0
        self.deferred = 0
        self.steps: list[StepRecord] | None = [] if record_steps else None
        self.last_step = StepCounts()
        # overlap (kvjax.engine.overlap): how many live requests need synchronous steps, and the
        # overlapped step's helper, which holds the dispatched step whose tokens are not read yet
        self._sync_live = 0
        self.overlap = (self.cfg.async_scheduling and self.rank_digest is None
                        and callable(getattr(engine.runner, "dispatch", None)))
        self.stepper = OverlappedStepper(self)
        # disaggregated prefill/decode (kvjax.engine.remote_kv): a KVTransferConfig's producer / consumer
        self.remote_kv = None
        if kv_transfer is not None:
            from kvjax.engine.remote_kv import RemoteKV

            self.remote_kv = RemoteKV(self, kv_transfer)
        # the third tier (a disk / Redis / memory store under the host tier; store_tier_driver.py)
        self.store_tier = None if kv_store is None else StoreTierDriver(kv_store, self)

    # ------------------------------------------------------------------ requests
    def validate(self, item: WorkItem, prompt: Sequence[int]) -> None:
        """Raise `InvalidRequestError` (a ValueError) unless the request can ever be served by
        this cache: prompt + max_new_tokens within max_seq_len, token ids in the vocabulary,
        enough primary blocks in every window. Reads only the configuration (never the
        ledger), so other threads may call it."""
        cfg = self.cache_config
        rid = item.request_id
        if not prompt:
            raise InvalidRequestError(f"request {rid!r} has an empty prompt")
        total = len(prompt) + item.max_new_tokens
        if total > cfg.max_seq_len:
            raise InvalidRequestError(
                f"request {rid!r}: {len(prompt)} prompt tokens + max_new_tokens={item.max_new_tokens} "
                f"exceed max_seq_len={cfg.max_seq_len}"
            )
        if not all(type(t) is int for t in prompt) and not all(  # the fast path: plain ints
                isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in prompt):
            raise InvalidRequestError(f"request {rid!r}: token ids must be ints")
        if max(prompt) >= self.vocab or min(prompt) < 0:
            raise InvalidRequestError(f"request {rid!r}: token ids must be in [0, {self.vocab})")
        tpb = cfg.tokens_per_block
        for w in cfg.windows:
            # SWA windows hold the whole prompt until decoding starts releasing front blocks
            if w < 0:  # recurrent states: a snapshot per interval (reuse on), plus the live and write blocks
                need = ceil_div(total, cfg.snapshot_interval or tpb) + 2 if cfg.enable_block_reuse else 1
            else:
                need = max(ceil_div(len(prompt), tpb),
                           max_block_requirements(len(prompt), item.max_new_tokens, cfg.sink_token_length, w, 1, tpb))
            have = cfg.primary_blocks_for(w)
            if need > have:
                raise InvalidRequestError(
                    f"request {rid!r} needs {need} blocks in window {w} but the cache has {have} primary blocks"
                )

    def add_request(
        self,
        item: WorkItem,
        prompt: Sequence[int] | None = None,
        *,
        seed: int,
        stop_token_ids: frozenset[int] = frozenset(),
        eos_token_ids: frozenset[int] = frozenset(),
        after: LiveRequest | None = None,
        kv_transfer_params=None,
    ) -> LiveRequest:
        """Queue a request (it is admitted by a later `step`). `item` describes it (id,
        max_new_tokens, LoRA id, cache salt, retention, sampling, eos_id); `prompt` defaults
        to `item.tokens`; `seed` is its sampling key stream; `eos_token_ids` end it like
        `item.eos_id`, `stop_token_ids` too but with the token as its `stop_reason`. A request
        that can never fit is rejected here (`validate`). With `after` (another completion of
        the same prompt, n > 1) it waits until that request's prompt is computed and cached,
        then reuses its blocks; without prefix caching, or when `after` scores its prompt
        (its blocks are salted), it is queued at once and computes its own prompt."""
        prompt = list(item.tokens if prompt is None else prompt)
        rid = item.request_id
        if rid in self._live or (self.remote_kv is not None and rid in self.remote_kv.draining):
            raise DuplicateRequestError(f"request id {rid!r} is already queued or running")
        self.validate(item, prompt)
        remote = None
        if kv_transfer_params is not None:  # disaggregated prefill/decode (remote_kv.RemoteKV.prepare)
            if self.remote_kv is None:
                raise InvalidRequestError(f"request {rid!r} carries kv_transfer_params but this engine has no "
                                          "--kv-transfer-config")
            remote = self.remote_kv.prepare(rid, kv_transfer_params, len(prompt))
        r = LiveRequest(item, [int(t) for t in prompt], self.step_index, self.clock.now(), seed, order=-1,
                        stop_ids=frozenset(stop_token_ids), eos_ids=frozenset(eos_token_ids))
        if (after is not None and after.phase in (Phase.WAITING, Phase.CONTEXT) and after.prompt_logprobs is None
                and self.cache_config.enable_block_reuse):
            r.after = after
            self.held.append(r)
        else:
            self.waiting.append(r)
        self._live[rid] = r
        if remote is not None and self.remote_kv is not None:
            self.remote_kv.attach(r, *remote)
        if needs_sync(item):
            self._sync_live += 1
        return r

    def release_held(self, parent: LiveRequest) -> None:
        """Queue the requests held for `parent`'s prompt (it is cached now, or `parent` left)."""
        if not any(r.after is parent for r in self.held):
            return
        self.waiting.extend(r for r in self.held if r.after is parent)
        self.held = [r for r in self.held if r.after is not parent]

    def abort_request(
        self, request_id: Hashable, *, reason: str = "abort", stop_reason: int | str | None = None
    ) -> CoreOutput | None:
        """Take a queued or running request out: its blocks are stored for reuse and released.
        Returns its final output (finish reason `reason`), or None if no such request is
        queued or running (already finished, or never added): aborting is idempotent."""
        r = self._live.get(request_id)
        if r is None:
            return None
        if request_id in self.running:
            self.stepper.forget_unread_chunk(r)
            if self.remote_kv is None or not self.remote_kv.hold_for_pull(r):  # a pull in flight frees it later
                self.ledger.remove_sequence(request_id, store_for_reuse=True)
            del self.running[request_id]
            self._publish_events()
        else:
            if self.remote_kv is not None:
                self.remote_kv.forget(r)
            if self.store_tier is None or not self.store_tier.drop(request_id):  # (parked: waiting on the store)
                self.waiting = collections.deque(x for x in self.waiting if x is not r)
                self.held = [x for x in self.held if x is not r]
        self._retire(r, reason, stop_reason)
        return CoreOutput(r, (), True)

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or (overlap) a dispatched step still to be read."""
        return bool(self._live) or self.stepper.inflight is not None or (self.remote_kv is not None and self.remote_kv.busy)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.held) + (0 if self.store_tier is None else self.store_tier.num_parked)

    def warm_up(self, level: str, progress=None):
        """Compile (or load from the persistent cache) the step programs of `level` ("none",
        "common", "all"; `kvjax.engine.warmup`) before any request; returns a `WarmupReport`.
        Refused with `EngineBusyError` while requests are queued or run."""
        from kvjax.engine.warmup import check_level, run_warmup

        check_level(level)
        if self._live:
            raise EngineBusyError(f"warm up an idle engine: {len(self._live)} request(s) queued or running")
        with self.clock.measuring():
            report, self.pools = run_warmup(self.engine.runner, self.pools, self.cache_config, self.forward_shapes,
                                            level, progress)
        return report

    def reset_prefix_cache(self) -> int:
        """Drop every cached block (the ledger's `reset_prefix_cache`). Refused with
        `EngineBusyError` while requests run: their blocks hold KV of the old weights (with
        overlap, a dispatched step holding only finished requests' rows is read first).
        Returns the number of blocks dropped."""
        if self.stepper.inflight is not None and not self._live:  # only wasted rows in flight: read and drop them
            self.stepper.drain([])
        if self.running or self.stepper.inflight is not None:
            raise EngineBusyError(f"cannot reset the prefix cache while {len(self.running)} request(s) run")
        dropped = self.ledger.reset_prefix_cache()
        self._publish_events()
        return dropped

    def close(self) -> None:
        """Stop publishing KV events (idempotent). The ledger and pools stay readable."""
        if self.events is not None:
            self.events.close()
        if self.remote_kv is not None:
            self.remote_kv.close()
        if self.store_tier is not None:
            self.store_tier.close()

    def _publish_events(self) -> None:
        if self.events is not None:
            self.events.publish(self.ledger)
            if self.store_tier is not None:  # tier-3 blocks (medium "STORAGE")
                self.events.publish_wire(self.store_tier.take_events())

    # ------------------------------------------------------------------ the step
    def step(self) -> list[CoreOutput]:
        """Run one iteration; returns one output per request that produced a token or finished."""
        outputs: list[CoreOutput] = []
        if self.store_tier is not None:  # poll the store; requests whose blocks it restored queue again
            self.store_tier.before_step()
        try:
            if self.remote_kv is not None:  # ended offers unpinned, arrived KV scattered (before scheduling)
                self.remote_kv.poll(outputs)
            if not self.overlap:
                self._step(outputs)
            elif self._sync_live:  # synchronous steps: first read the step in flight, if any
                if self.stepper.inflight is not None:
                    self.stepper.drain(outputs)
                else:
                    self._step(outputs)
            else:
                self.stepper.step(outputs)
        finally:
            self.step_index += 1
        self._publish_events()
        return outputs

    def _step(self, outputs: list[CoreOutput]) -> None:
        """One iteration, in the order of the module docstring's numbered steps."""
        now = self.clock.now()
        sched = self.scheduler.schedule(list(self.running.values()), self.waiting, step=self.step_index)
        self.deferred += sched.deferred
        for r in sched.pause:  # 1. pauses (MAX_UTILIZATION): blocks stored for reuse, request re-queued first
            self.pause(r)
        decode = self.commit_pending_tokens(sched.generation)  # 2.
        admitted = self.admit(sched.admit, now)  # 3. admissions (one batch: two-phase matching in the ledger)
        if self.rank_digest is not None:  # every rank, every step, before any device work
            self._rank_sync(sched.pause, decode, admitted)
        if not self.running:
            self.idle_step(len(admitted), len(sched.pause))
            return
        running = len(self.running)
        prefill = self.prefill_chunks(sched.context + admitted, len(decode))  # 4.
        # 5. data movements decided by this step's ledger calls, before any forward; what did
        #    not arrive leaves the ledger's cache and the requests that relied on it recompute
        prefill, onboarded = self.apply_transfers(prefill)
        self._forward_step(decode, prefill, outputs)  # 6. the step's one forward + sampling
        self.ledger.refresh_blocks()
        prefill_tokens = sum(n for _, n in prefill)
        self.last_step = StepCounts(running, len(decode), prefill_tokens, len(admitted), len(sched.pause), onboarded)
        if self.steps is not None:
            self.record_step(len(decode), prefill_tokens, len(admitted), len(sched.pause))

    def commit_pending_tokens(self, generation: list[LiveRequest]) -> list[LiveRequest]:
        """The pending token of every scheduled generating request enters the ledger: one batched
        call (atomic), or, when it finds no block for some request, one by one (a request that
        still finds none is paused). Returns the requests that decode this step."""
        led = self.ledger
        pending = [r.pending for r in generation]
        assert None not in pending  # a scheduled generating request holds its sampled token
        try:
            led.add_tokens([r.request_id for r in generation], cast("list[int]", pending))
            batched = True
        except OutOfBlocksError:  # nothing changed: redo it one by one below
            batched = False
        decode: list[LiveRequest] = []
        for r in generation:
            assert r.pending is not None  # a scheduled generating request holds its sampled token
            if not batched:
                try:  # a batch of one, not add_token: the tokens stay where the batched steps keep them
                    led.add_tokens([r.request_id], [r.pending])
                except OutOfBlocksError:  # the scheduler's accounting let this through: recover
                    self.accounting_misses += 1
                    self.pause(r)
                    continue
            r.pending = None
            decode.append(r)
        return decode

    def idle_step(self, admitted: int, paused: int) -> None:
        """A step that left nothing running: fine unless a waiting request can never be admitted."""
        self.last_step = StepCounts(0, 0, 0, admitted, paused, 0)
        if self.waiting and not paused:
            head = self.waiting[0]
            raise EngineInvariantError(
                f"request {head.request_id!r} cannot be admitted into an idle cache "
                f"(free blocks per window: {[self.ledger.num_free_blocks(w) for w in self.ledger.windows]})"
            )

    def prefill_chunks(self, candidates: list[LiveRequest], num_decode: int) -> list[tuple[LiveRequest, int]]:
        """Prefill chunks from what the step's token budget leaves after decoding, oldest admission
        first, as many as the one forward's prefill group holds (`prefill_fits`: at most
        `buckets.prefill_rows`, padded no wider than the token budget); the rest wait for a later step."""
        budget = self.cfg.scheduler.max_num_tokens - num_decode
        prefill: list[tuple[LiveRequest, int]] = []
        longest = 0
        for r in sorted(candidates, key=lambda r: r.order):
            if r.awaiting_kv:  # its prompt's KV is being pulled (remote_kv)
                continue
            if budget <= 0:
                break
            n = min(r.context_remaining, budget)
            if self.cache_config.has_recurrent:  # hybrids: chunks end at snapshot points (the states reuse needs)
                n = min(n, self.ledger.recurrent_next_chunk_end(r.request_id) - r.context_pos)
            if n > 0:
                if not prefill_fits(len(prefill) + 1, max(longest, n), self.cfg.buckets, self.cfg.scheduler.max_num_tokens):
                    break  # oldest first: a later candidate does not jump this one
                prefill.append((r, n))
                longest = max(longest, n)
                budget -= n
        return prefill

    def _forward_step(self, decode: list[LiveRequest], prefill: list[tuple[LiveRequest, int]],
                      outputs: list[CoreOutput]) -> None:
        """The step's ONE forward: every decoding request's last token and every prefill chunk
        (`build_step`: a decode group and a prefill group, the weights read once); then the
        decoding requests' full blocks are stored and their tokens emitted, and each chunk's
        bookkeeping runs in admission order."""
        if not decode and not prefill:
            return
        # a one-token chunk is a decode row (one token at the sequence's end): it joins the
        # decode group, so a step of decodes and such chunks is one program, not two
        single = [(r, n) for r, n in prefill if n == 1 and not r.scores_prompt()]
        chunks = [(r, n) for r, n in prefill if n != 1 or r.scores_prompt()]
        drows = [Row(r.request_id, [r.output[-1]], len(r.prompt) + len(r.output) - 1) for r in decode]
        drows += [Row(r.request_id, r.context[r.context_pos : r.context_pos + 1], r.context_pos) for r, _ in single]
        prows = [Row(r.request_id, r.context[r.context_pos : r.context_pos + n], r.context_pos) for r, n in chunks]
        prefill = single + chunks  # the rows' order after the decode rows
        toks, chosen, margins, lps = self._forward(drows, prows, decode + [r for r, _ in prefill], len(drows))
        nd = len(decode)
        if decode:
            self.ledger.store_new_blocks([r.request_id for r in decode])
        for i, r in enumerate(decode):
            outputs.append(self.emit(r, int(toks[i]), float(chosen[i]), float(margins[i]), lps[i]))
        for j in sorted(range(len(prefill)), key=lambda j: prefill[j][0].order):
            r, n = prefill[j]
            i = nd + j
            self._prefilled(r, n, int(toks[i]), float(chosen[i]), float(margins[i]), lps[i], outputs)

    def _prefilled(self, r: LiveRequest, n: int, token: int, chosen: float, margin: float, lp: TokenLogprobs | None,
                   outputs: list[CoreOutput]) -> None:
        """`n` more prompt tokens of `r` computed; at the prompt's end its blocks are stored, the
        requests held for it released, and its first token emitted."""
        led = self.ledger
        r.context_pos += n
        self.counters.computed_prompt_tokens += n
        adm = r.admissions[-1]
        r.admissions[-1] = adm = dataclasses.replace(adm, computed=adm.computed + n)
        led.set_context_position(r.request_id, r.context_pos)
        if r.context_pos < len(r.context):
            return
        if adm.computed + adm.reused + adm.transferred != adm.prompt_len:
            raise EngineInvariantError(
                f"{r.request_id}: computed {adm.computed} + reused {adm.reused} != prompt {adm.prompt_len}")
        led.store_context_blocks(r.request_id)
        r.phase = Phase.GENERATION
        self.release_held(r)
        if r.remaining_new_tokens <= 0:  # nothing to generate (max_new_tokens == 0)
            self.finish(r, "length")
            outputs.append(CoreOutput(r, (), True))
        else:
            outputs.append(self.emit(r, token, chosen, margin, lp))

    def _rank_sync(self, paused: list[LiveRequest], decode: list[LiveRequest], admitted: list[LiveRequest]) -> None:
        """Fold this step's ledger decisions into the rank digest and compare it across ranks
        at the configured interval (`RankDivergenceError` if they differ)."""
        d, led = self.rank_digest, self.ledger
        assert d is not None  # only called on multi-process ranks, which keep a digest
        d.update(
            self.step_index, len(self.waiting), len(self.running),
            [r.request_id for r in paused],
            [(r.request_id, r.output[-1]) for r in decode],
            [(r.request_id, r.admissions[-1].reused, len(r.context)) for r in admitted],
            [(w, led.num_free_blocks(w), led.num_free_secondary_blocks(w)) for w in led.windows],
        )
        # every running request's block table, one gather per window (the slots are what the
        # step's forwards write through)
        ids = [r.request_id for r in sorted(self.running.values(), key=lambda r: r.order)]
        d.update(ids)
        if ids:
            for w in led.windows:
                d.update(led.block_table(ids, w))
        d.check(self.step_index)

    def apply_transfers(self, prefill: list[tuple[LiveRequest, int]]) -> tuple[list[tuple[LiveRequest, int]], int]:
        """Carry out the ledger's transfer plan (offload / onboard / copy) on the device pools.
        Called once per step, after every ledger call of the step and before any forward. A
        `TransferError` (all or some ops did not take effect) is reported to the ledger, and
        the prefill of the requests it cut back is redone. Returns this step's prefill and the
        number of blocks onboarded."""
        plan = self.ledger.take_transfers()
        tier = self.store_tier
        if tier is not None:  # stage the host blocks this plan may overwrite that the store wants
            tier.before_transfers(self.pools)
        if not len(plan):
            if tier is not None:
                tier.after_transfers(self.pools, True)
            return prefill, 0
        if self.rank_digest is not None:
            self.rank_digest.update(plan.kind, plan.pool, plan.src, plan.dst, plan.num_tokens)
        onboard = plan.kind == TransferKind.ONBOARD  # [ops]
        with self.clock.measuring():
            try:
                self.pools = self.engine.runner.apply_transfers(self.pools, plan)
            except TransferError as e:
                if e.pools is not None:  # the ops that did apply, on the pools they consumed
                    self.pools = e.pools
                applied = np.ones(len(plan), bool) if e.op_indices is not None else np.zeros(len(plan), bool)
                if e.op_indices is not None:
                    applied[list(e.op_indices)] = False
                prefill = self._transfers_failed(self.ledger.transfers_failed(plan, e.op_indices), prefill)
                if tier is not None:
                    tier.after_transfers(self.pools, False)
                return prefill, int((onboard & applied).sum())
        if tier is not None:  # offloaded blocks are in their host slots now
            tier.after_transfers(self.pools, True)
        return prefill, int(onboard.sum())

    def _transfers_failed(self, failure, prefill: list[tuple[LiveRequest, int]]) -> list[tuple[LiveRequest, int]]:
        """Rewind the prefill of every request a failed transfer cut back (the ledger already
        dropped the lost blocks); a request that cannot recompute in place (a sliding window
        released what it would read) is admitted again. Only admissions move blocks, so only
        this step's admissions can be affected."""
        led, c = self.ledger, self.counters
        for rid, valid in failure.recompute_from.items():
            r = self.running[rid]
            if r.phase is not Phase.CONTEXT:
                raise EngineInvariantError(f"{rid}: a failed transfer hit a {r.phase.value} request")
            adm = r.admissions[-1]
            stats = led.request_stats(rid)  # the admission's block counts, as the ledger now has them
            c.reused_blocks += stats.reused_blocks - r.admission_stats.reused_blocks
            c.missed_blocks += stats.missed_blocks - r.admission_stats.missed_blocks
            r.admission_stats = stats
            if rid in failure.readmit:  # undo the admission: back to the front of the queue
                led.remove_sequence(rid, store_for_reuse=True)  # stores only what is still valid
                del self.running[rid]
                r.admissions.pop()
                r.phase = Phase.WAITING
                c.admitted_prompt_tokens -= len(r.context)
                c.reused_prompt_tokens -= adm.reused
                self.waiting.appendleft(r)
                prefill = [(x, n) for x, n in prefill if x is not r]
                continue
            c.reused_prompt_tokens -= adm.reused - valid
            r.admissions[-1] = dataclasses.replace(adm, reused=valid)
            r.context_pos = valid
        return prefill

    # ------------------------------------------------------------------ pieces (the overlapped step's too)
    def admit(self, chosen: list[LiveRequest], now: float) -> list[LiveRequest]:
        """Admit the scheduler's choice in one ledger batch (if its accounting fell short, the
        ones that fit, in order); returns the admitted requests, in CONTEXT phase."""
        if not chosen:
            return []
        led = self.ledger
        try:
            prepopulated = led.add_sequences([r.ledger_request() for r in chosen])
        except OutOfBlocksError:  # accounting short (e.g. sliding windows): admit what fits, in order
            self.accounting_misses += 1
            prepopulated = []
            for r in chosen:
                try:
                    prepopulated.append(led.add_sequence(r.ledger_request()))
                except OutOfBlocksError:
                    break
            chosen = chosen[: len(prepopulated)]
        ids = {id(r) for r in chosen}
        self.waiting = collections.deque(r for r in self.waiting if id(r) not in ids)
        c = self.counters
        for r, p in zip(chosen, prepopulated, strict=True):
            stats = led.request_stats(r.request_id)
            if stats.prepopulated_tokens != p:
                raise EngineInvariantError(
                    f"{r.request_id}: add_sequence returned {p}, request_stats says {stats.prepopulated_tokens}"
                )
            c.reused_blocks += stats.reused_blocks
            c.missed_blocks += stats.missed_blocks
            r.admission_stats = stats
            c.prefix_queries += 1
            r.context = r.prompt + r.output
            r.context_pos = p
            r.phase = Phase.CONTEXT
            r.order = self._order
            self._order += 1
            if r.admit_time is None:
                r.admit_time = now
            r.admissions.append(Admission(len(r.context), p, resumed=bool(r.admissions)))
            led.set_context_position(r.request_id, p)
            self.running[r.request_id] = r
            c.admitted_prompt_tokens += len(r.context)
            c.reused_prompt_tokens += p
        if self.remote_kv is not None:  # requests waiting for remote KV start their pulls
            self.remote_kv.admitted(chosen)
        return chosen

    def pause(self, r: LiveRequest) -> None:
        """Take a generating request out of the ledger (its blocks stay cached) and queue it first."""
        if r.phase is not Phase.GENERATION:
            raise EngineInvariantError(f"only generating requests are paused, {r.request_id} is {r.phase}")
        self.stepper.forget_unread_chunk(r)
        self.ledger.remove_sequence(r.request_id, store_for_reuse=True)
        del self.running[r.request_id]
        r.phase = Phase.WAITING
        r.pending = None  # it is output[-1]; the resumed prompt includes it
        r.pauses += 1
        # paused requests resume before new ones, oldest first
        paused = [x for x in self.waiting if x.admissions] + [r]
        fresh = [x for x in self.waiting if not x.admissions]
        self.waiting = collections.deque(sorted(paused, key=lambda x: x.order) + fresh)

    def _forward(self, decode: list[Row], prefill: list[Row], reqs: list[LiveRequest], nd: int):
        """One forward of the step's rows (`reqs`: the `nd` decode-group rows' requests, then
        the prefill rows'): sampled tokens, chosen logits, margins and, per row, the sampled
        token's logprobs (None unless the request asks). The prompt logprobs of the chunks that
        score their prompt are stored on their requests."""
        batch, args, extras, scoring = forward_inputs(self.engine.runner, self.ledger, self.cfg.buckets, self.vocab, decode,
                                                      prefill, reqs, nd)
        with self.clock.measuring():
            out, self.pools = self.engine.runner.run(self.pools, batch, *args, extras)
        return out.tokens, out.chosen, out.margins, row_logprobs(out, prefill, reqs, nd, scoring)

    def emit(self, r: LiveRequest, token: int, chosen: float, margin: float, lp: TokenLogprobs | None = None,
             committed: bool = False) -> CoreOutput:
        """Record a sampled token; finish the request or keep the token pending (`committed`:
        already in the ledger, reserved by an overlapped step)."""
        r.output.append(token)
        r.chosen_logits.append(chosen)
        r.margins.append(margin)
        if r.logprobs is not None:
            assert lp is not None  # a request asking for logprobs runs in forwards that compute them
            r.logprobs.append(lp)
        self.counters.generated_tokens += 1
        if r.first_token_time is None:
            r.first_token_time = self.clock.now()
            r.first_token_step = self.step_index
        reason = r.finish_reason_after(token)
        if reason is not None:
            if reason == "stop" and token in r.stop_ids and token not in r.eos_ids and token != r.item.eos_id:
                r.stop_reason = token
            if r.phase is Phase.WAITING:  # overlap: paused while this token was in flight
                self.waiting = collections.deque(x for x in self.waiting if x is not r)
                self._retire(r, reason, r.stop_reason)
            else:
                self.finish(r, reason)
            return CoreOutput(r, (token,), True)
        # a paused request's resumed prompt includes it; an overlapped step reserved its position
        r.pending = None if r.phase is Phase.WAITING or committed else token
        return CoreOutput(r, (token,), False)

    def finish(self, r: LiveRequest, reason: str) -> None:
        """A running request is done: it leaves the ledger (blocks stored for reuse) and retires."""
        if r.remote_decode and self.remote_kv is not None:  # offer the prompt's blocks (pinned) to a decode engine
            self.remote_kv.finishing(r)
        self.ledger.remove_sequence(r.request_id, store_for_reuse=True)
        del self.running[r.request_id]
        self._retire(r, reason, r.stop_reason)

    def _retire(self, r: LiveRequest, reason: str, stop_reason: int | str | None) -> None:
        del self._live[r.request_id]
        if needs_sync(r.item):
            self._sync_live -= 1
        self.release_held(r)
        r.phase = Phase.FINISHED
        r.pending = None
        r.finish_reason = reason
        r.stop_reason = stop_reason
        r.finish_time = self.clock.now()
        r.finish_step = self.step_index
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1

    # ------------------------------------------------------------------ metrics and checks
    def record_step(self, decode_rows: int, prefill_tokens: int, admitted: int, paused: int) -> None:
        """Append this step's `StepRecord` (with `record_steps`)."""
        it = self.ledger.iteration_stats()
        st = self.ledger.stats()
        c = self.counters
        assert self.steps is not None  # only called with record_steps
        self.steps.append(
            StepRecord(
                step=self.step_index,
                time_s=self.clock.now(),
                decode_rows=decode_rows,
                prefill_tokens=prefill_tokens,
                admitted=admitted,
                paused=paused,
                blocks_in_use=it.primary_used_blocks,
                secondary_in_use=it.secondary_used_blocks,
                offloaded=it.offloaded_blocks,
                onboarded=it.onboarded_blocks,
                copied=it.copied_blocks,
                evicted=it.evicted_blocks,
                partial_reused=it.partial_reused_blocks,
                token_hit_rate=c.reused_prompt_tokens / c.admitted_prompt_tokens if c.admitted_prompt_tokens else 0.0,
                block_hit_rate=st.cache_hit_rate,
            )
        )

    def verify_idle(self) -> None:
        """With no request queued or running: the ledger holds no request and no referenced
        block, its reuse counters equal the sums of the per-admission stats, and its integrity
        holds. Raises `EngineInvariantError` (or the ledger's `IntegrityError`)."""
        led = self.ledger
        if self._live:
            raise EngineInvariantError(f"requests still queued or running: {sorted(map(str, self._live))}")
        if self.stepper.inflight is not None:
            raise EngineInvariantError(f"step {self.stepper.inflight.step} was dispatched and never read")
        c = self.counters
        stats = led.stats()
        if c.reused_blocks != stats.reused_blocks:
            raise EngineInvariantError(f"per-request reused blocks {c.reused_blocks} != ledger {stats.reused_blocks}")
        if c.missed_blocks != stats.missed_blocks:
            raise EngineInvariantError(f"per-request missed blocks {c.missed_blocks} != ledger {stats.missed_blocks}")
        if len(led):
            raise EngineInvariantError(f"requests still in the ledger: {led.request_ids}")
        for w in led.windows:
            if led.num_allocated_blocks(w):
                raise EngineInvariantError(f"window {w}: {led.num_allocated_blocks(w)} blocks still referenced")
        led.verify_integrity()
