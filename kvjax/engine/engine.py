"""`Engine`: continuous batching with chunked prefill over the kvjax ledger and device pools.

One step (SPEC §2):
  1. release arrivals; the `CapacityScheduler` picks running requests, admissions, pauses
     from the ledger's accounting;
  2. ledger commits: `remove_sequence` for paused requests (blocks stored for reuse),
     `add_token` of each generating request's pending token, `add_sequences` for admissions
     (prefix match, claims, allocation; the returned prepopulated length is what prefill
     skips), then prefill chunks are cut from the token budget;
  3. `take_transfers` -> `apply_transfers` (offload / onboard / copy) BEFORE any forward;
  4. a decode forward `[B, 1]` and a prefill forward `[B, T]`, both bucketed, jitted, pools
     donated, sampling inside the jit;
  5. `set_context_position` after each chunk, `store_context_blocks` when a prompt is done,
     `store_new_block` after decode tokens; finished requests (EOS or `max_new_tokens`)
     leave with `remove_sequence` and release their follow-ups (next chat turn).

The engine checks as it goes that every admission's prefill computed + reused tokens equals
its prompt, that the reused count is what the ledger reported, and at the end of a run that
the ledger's block counters agree and its integrity holds.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from kvjax.capacity import max_block_requirements
from kvjax.config import CacheConfig
from kvjax.errors import OutOfBlocksError, TransferError
from kvjax.engine.batching import Row, build_batch
from kvjax.engine.config import EngineConfig, device_config
from kvjax.engine.metrics import RequestRecord, RunMetrics, StepRecord
from kvjax.engine.request_state import Admission, LiveRequest, Phase
from kvjax.engine.runner import ModelRunner
from kvjax.engine.sampling import request_seed
from kvjax.engine.scheduler import CapacityScheduler
from kvjax.engine.serving_clock import ServingClock
from kvjax.engine.workloads import WorkItem


class EngineInvariantError(AssertionError):
    """The engine's own bookkeeping disagrees with the ledger (a bug, never a user error)."""


@dataclasses.dataclass
class RunResult:
    outputs: dict[str, list[int]]  # request id -> generated tokens
    prompts: dict[str, list[int]]  # request id -> full prompt (follow-ups resolved)
    chosen_logits: dict[str, list[float]]  # logit of every sampled token
    margins: dict[str, list[float]]  # top-2 logit margin at every sampled token
    metrics: RunMetrics
    ledger: Any = None  # the run's KVCacheManager (empty of requests; its cache and stats remain)


class Engine:
    """Serves workloads with one model; `run` builds a fresh ledger and pools per call, and
    runs share compiled executables (see `device_config`)."""

    def __init__(self, model: Any, config: EngineConfig = EngineConfig(), *, impl: str = "auto", runner: ModelRunner | None = None) -> None:
        if runner is not None and runner.model is not model:
            raise ValueError("runner serves a different model")
        self.model = model
        self.config = config
        self.runner = ModelRunner(model, impl=impl) if runner is None else runner  # engines may share one

    def run(
        self,
        items: Sequence[WorkItem],
        cache_config: CacheConfig,
        *,
        label: str = "run",
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> RunResult:
        """Serve `items` to completion. `progress(n)` is called with the number of requests
        finished in each step (e.g. `tqdm.update`)."""
        return _Session(self, items, cache_config, label, seed, progress).run()


class _Session:
    """The state of one run: ledger, pools, request queues, metrics."""

    def __init__(self, engine: Engine, items, cache_config: CacheConfig, label: str, seed: int, progress) -> None:
        from kvjax.device import allocate_pools
        from kvjax.ledger import KVCacheManager

        engine.model.check_cache(cache_config)
        cfg = engine.config
        self.engine = engine
        self.cfg = cfg
        self.cache_config = cache_config
        self.ledger = KVCacheManager(cache_config)
        self.pools = allocate_pools(device_config(cache_config))
        self.scheduler = CapacityScheduler(cfg.scheduler, self.ledger)
        self.label = label
        self.seed = seed
        self.progress = progress
        self.items = {it.request_id: it for it in items}
        if len(self.items) != len(items):
            raise ValueError("work item ids must be unique")
        self.children: dict[str, list[WorkItem]] = collections.defaultdict(list)
        self.future: list[tuple[int, int, str, list[int]]] = []  # heap of (arrival step, seq, id, prompt)
        for n, it in enumerate(items):
            if it.parent is None:
                heapq.heappush(self.future, (it.arrival_step, n, it.request_id, list(it.tokens)))
            elif it.parent not in self.items:
                raise ValueError(f"work item {it.request_id!r}: unknown parent {it.parent!r}")
            else:
                self.children[it.parent].append(it)
        self._seq = len(items)
        self.waiting: collections.deque[LiveRequest] = collections.deque()
        self.running: dict[str, LiveRequest] = {}
        self.done: list[LiveRequest] = []
        self.step = 0
        self._order = 0
        self.accounting_misses = 0
        self.deferred = 0
        self.admitted_stats: list = []  # ledger RequestStats of every admission
        self._stats_index: dict[str, int] = {}  # request -> index of its latest admission's stats
        self.steps: list[StepRecord] = []
        self._admitted_tokens = 0
        self._reused_tokens = 0
        self.vocab = engine.model.spec.vocab_size

    # ------------------------------------------------------------------ the loop
    def run(self) -> RunResult:
        self.clock = ServingClock()
        traces0 = self.engine.runner.num_traces
        while self.future or self.waiting or self.running:
            if self.step >= self.cfg.max_steps:
                raise RuntimeError(f"run {self.label!r} did not finish within max_steps={self.cfg.max_steps}")
            if not self.waiting and not self.running:  # idle: jump to the next arrival
                self.step = max(self.step, self.future[0][0])
            self._one_step()
            self.step += 1
        wall = self.clock.now()
        self._final_checks()
        metrics = RunMetrics(
            label=self.label,
            requests=[self._record(r) for r in sorted(self.done, key=lambda r: r.request_id)],
            steps=self.steps,
            ledger=dataclasses.asdict(self.ledger.stats()),
            wall_s=wall,
            compile_s=self.clock.compile_s,
            compilations=self.engine.runner.num_traces - traces0,
            accounting_misses=self.accounting_misses,
            deferred=self.deferred,
        )
        by_id = {r.request_id: r for r in self.done}
        return RunResult(
            outputs={k: list(r.output) for k, r in by_id.items()},
            prompts={k: list(r.prompt) for k, r in by_id.items()},
            chosen_logits={k: list(r.chosen_logits) for k, r in by_id.items()},
            margins={k: list(r.margins) for k, r in by_id.items()},
            metrics=metrics,
            ledger=self.ledger,
        )

    def _one_step(self) -> None:
        now = self.clock.now()
        self._release(now)
        sched = self.scheduler.schedule(list(self.running.values()), self.waiting)
        self.deferred += sched.deferred
        led = self.ledger

        # 1. pauses (MAX_UTILIZATION): blocks stored for reuse, request re-queued first
        for r in sched.pause:
            self._pause(r)
        # 2. the pending token of every scheduled generating request enters the ledger
        decode: list[LiveRequest] = []
        for r in sched.generation:
            try:
                led.add_token(r.request_id, r.pending)
            except OutOfBlocksError:  # the scheduler's accounting let this through: recover
                self.accounting_misses += 1
                self._pause(r)
                continue
            r.pending = None
            decode.append(r)
        # 3. admissions (one batch: two-phase matching in the ledger)
        admitted = self._admit(sched.admit, now)
        if not self.running:
            if self.waiting and not sched.pause:
                head = self.waiting[0]
                raise RuntimeError(
                    f"request {head.request_id!r} cannot be admitted into an idle cache "
                    f"(free blocks per window: {[led.num_free_blocks(w) for w in led.windows]})"
                )
            return
        # 4. prefill chunks from the token budget, oldest admission first
        budget = self.cfg.scheduler.max_num_tokens - len(decode)
        prefill: list[tuple[LiveRequest, int]] = []
        for r in sorted(sched.context + admitted, key=lambda r: r.order):
            if budget <= 0:
                break
            n = min(r.context_remaining, budget)
            if n > 0:
                prefill.append((r, n))
                budget -= n
        # 5. data movements decided by this step's ledger calls, before any forward; what did
        #    not arrive leaves the ledger's cache and the requests that relied on it recompute
        plan = led.take_transfers()
        if len(plan):
            from kvjax.device import apply_transfers

            with self.clock.measuring():
                try:
                    self.pools = apply_transfers(self.pools, plan)
                except TransferError as e:
                    self.pools = self.pools if e.pools is None else e.pools
                    prefill = self._transfers_failed(led.transfers_failed(plan, e.op_indices), prefill)
        # 6. forwards + sampling
        finished = 0
        if decode:
            rows = [Row(r.request_id, [r.output[-1]], len(r.prompt) + len(r.output) - 1) for r in decode]
            toks, chosen, margins = self._forward(rows, decode, chunk_bucket=1)
            for r, t, c, m in zip(decode, toks, chosen, margins):
                led.store_new_block(r.request_id)
                finished += self._emit(r, int(t), float(c), float(m))
        sampled = []
        group = self.cfg.buckets.prefill_rows
        for g in range(0, len(prefill), group):
            part = prefill[g : g + group]
            rows = [Row(r.request_id, r.context[r.context_pos : r.context_pos + n], r.context_pos) for r, n in part]
            sampled.extend(zip(part, *self._forward(rows, [r for r, _ in part])))
        if sampled:
            for (r, n), t, c, m in sampled:
                r.context_pos += n
                adm = r.admissions[-1]
                r.admissions[-1] = adm = dataclasses.replace(adm, computed=adm.computed + n)
                led.set_context_position(r.request_id, r.context_pos)
                if r.context_pos < len(r.context):
                    continue
                if adm.computed + adm.reused != adm.prompt_len:
                    raise EngineInvariantError(
                        f"{r.request_id}: computed {adm.computed} + reused {adm.reused} != prompt {adm.prompt_len}"
                    )
                led.store_context_blocks(r.request_id)
                r.phase = Phase.GENERATION
                if r.remaining_new_tokens <= 0:  # nothing to generate (max_new_tokens == 0)
                    finished += self._finish(r)
                else:
                    finished += self._emit(r, int(t), float(c), float(m))
        led.refresh_blocks()
        self._record_step(len(decode), sum(n for _, n in prefill), len(admitted), len(sched.pause))
        if self.progress is not None and finished:
            self.progress(finished)

    # ------------------------------------------------------------------ pieces
    def _transfers_failed(self, failure, prefill: list) -> list:
        """Rewind the prefill of every request a failed transfer cut back (the ledger already
        dropped the lost blocks); a request that cannot recompute in place is admitted again.
        Only admissions move blocks, so only this step's admissions can be affected."""
        led = self.ledger
        for rid, valid in failure.recompute_from.items():
            r = self.running[rid]
            if r.phase is not Phase.CONTEXT:
                raise EngineInvariantError(f"{rid}: a failed transfer hit a {r.phase.value} request")
            adm = r.admissions[-1]
            lost = adm.reused - valid
            self._reused_tokens -= lost
            i = self._stats_index[rid]
            if rid in failure.readmit:  # undo the admission: back to the front of the queue
                self.admitted_stats[i] = dataclasses.replace(led.request_stats(rid), prepopulated_tokens=0)
                led.remove_sequence(rid, store_for_reuse=True)  # stores only what is still valid
                del self.running[rid]
                r.admissions.pop()
                r.phase = Phase.WAITING
                self._admitted_tokens -= len(r.context)
                self._reused_tokens -= valid
                self.waiting.appendleft(r)
                prefill = [(x, n) for x, n in prefill if x is not r]
                continue
            self.admitted_stats[i] = led.request_stats(rid)
            r.admissions[-1] = dataclasses.replace(adm, reused=valid)
            r.context_pos = valid
        return prefill

    def _release(self, now: float) -> None:
        """Move arrived requests (arrival step reached) to the back of the waiting queue."""
        while self.future and self.future[0][0] <= self.step:
            _, _, rid, prompt = heapq.heappop(self.future)
            item = self.items[rid]
            self._validate(item, prompt)
            self.waiting.append(
                LiveRequest(item, prompt, self.step, now, request_seed(item.sampling.seed ^ self.seed, rid), order=-1)
            )

    def _validate(self, item: WorkItem, prompt: list[int]) -> None:
        cfg = self.cache_config
        total = len(prompt) + item.max_new_tokens
        if total > cfg.max_seq_len:
            raise ValueError(
                f"request {item.request_id!r}: {len(prompt)} prompt tokens + max_new_tokens={item.max_new_tokens} "
                f"exceed max_seq_len={cfg.max_seq_len}"
            )
        if max(prompt) >= self.vocab or min(prompt) < 0:
            raise ValueError(f"request {item.request_id!r}: token ids must be in [0, {self.vocab})")
        tpb = cfg.tokens_per_block
        for w in cfg.windows:
            # SWA windows hold the whole prompt until decoding starts releasing front blocks
            need = max(-(-len(prompt) // tpb), max_block_requirements(len(prompt), item.max_new_tokens, cfg.sink_token_length, w, 1, tpb))
            have = cfg.primary_blocks_for(w)
            if need > have:
                raise ValueError(
                    f"request {item.request_id!r} needs {need} blocks in window {w} but the cache has {have} primary blocks"
                )

    def _admit(self, chosen: list[LiveRequest], now: float) -> list[LiveRequest]:
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
        for r, p in zip(chosen, prepopulated):
            stats = led.request_stats(r.request_id)
            if stats.prepopulated_tokens != p:
                raise EngineInvariantError(f"{r.request_id}: add_sequence returned {p}, request_stats says {stats.prepopulated_tokens}")
            self._stats_index[r.request_id] = len(self.admitted_stats)
            self.admitted_stats.append(stats)
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
            self._admitted_tokens += len(r.context)
            self._reused_tokens += p
        return chosen

    def _pause(self, r: LiveRequest) -> None:
        """Take a generating request out of the ledger (its blocks stay cached) and queue it first."""
        if r.phase is not Phase.GENERATION:
            raise EngineInvariantError(f"only generating requests are paused, {r.request_id} is {r.phase}")
        self.ledger.remove_sequence(r.request_id, store_for_reuse=True)
        del self.running[r.request_id]
        r.phase = Phase.WAITING
        r.pending = None  # it is output[-1]; the resumed prompt includes it
        r.pauses += 1
        # paused requests resume before new ones, oldest first
        paused = [x for x in self.waiting if x.admissions] + [r]
        fresh = [x for x in self.waiting if not x.admissions]
        self.waiting = collections.deque(sorted(paused, key=lambda x: x.order) + fresh)

    def _forward(self, rows: list[Row], reqs: list[LiveRequest], chunk_bucket: int | None = None):
        batch = build_batch(self.ledger, rows, self.cfg.buckets, chunk_bucket=chunk_bucket)
        temperature = np.array([r.item.sampling.temperature for r in reqs], np.float32)
        top_p = np.array([r.item.sampling.top_p for r in reqs], np.float32)
        seed = np.array([r.seed for r in reqs], np.int32)
        index = np.array([len(r.output) for r in reqs], np.int32)
        with self.clock.measuring():
            toks, chosen, margins, self.pools = self.engine.runner.run(self.pools, batch, temperature, top_p, seed, index)
        return toks, chosen, margins

    def _emit(self, r: LiveRequest, token: int, chosen: float, margin: float) -> int:
        """Record a sampled token; finish the request or keep it pending. Returns 1 if finished."""
        r.output.append(token)
        r.chosen_logits.append(chosen)
        r.margins.append(margin)
        if r.first_token_time is None:
            r.first_token_time = self.clock.now()
            r.first_token_step = self.step
        if r.finished_by(token):
            return self._finish(r)
        r.pending = token
        return 0

    def _finish(self, r: LiveRequest) -> int:
        self.ledger.remove_sequence(r.request_id, store_for_reuse=True)
        del self.running[r.request_id]
        r.phase = Phase.FINISHED
        r.pending = None
        r.finish_time = self.clock.now()
        r.finish_step = self.step
        self.done.append(r)
        for child in self.children.pop(r.request_id, ()):
            prompt = r.prompt + r.output + list(child.tokens)
            heapq.heappush(self.future, (self.step + 1 + child.arrival_step, self._seq, child.request_id, prompt))
            self._seq += 1
        return 1

    # ------------------------------------------------------------------ metrics and checks
    def _record_step(self, decode_rows: int, prefill_tokens: int, admitted: int, paused: int) -> None:
        it = self.ledger.iteration_stats()
        st = self.ledger.stats()
        self.steps.append(
            StepRecord(
                step=self.step,
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
                token_hit_rate=self._reused_tokens / self._admitted_tokens if self._admitted_tokens else 0.0,
                block_hit_rate=st.cache_hit_rate,
            )
        )

    def _record(self, r: LiveRequest) -> RequestRecord:
        ttft = None if r.first_token_time is None else r.first_token_time - r.arrival_time
        tpot = None
        if r.first_token_time is not None and len(r.output) > 1:
            tpot = (r.finish_time - r.first_token_time) / (len(r.output) - 1)
        return RequestRecord(
            request_id=r.request_id,
            prompt_tokens=len(r.prompt),
            admitted_tokens=sum(a.prompt_len for a in r.admissions),
            reused_tokens=sum(a.reused for a in r.admissions),
            computed_tokens=sum(a.computed for a in r.admissions),
            output_tokens=len(r.output),
            pauses=r.pauses,
            arrival_step=r.arrival_step,
            first_token_step=r.first_token_step,
            finish_step=r.finish_step,
            ttft_s=ttft,
            tpot_s=tpot,
            latency_s=None if r.finish_time is None else r.finish_time - r.arrival_time,
        )

    def _final_checks(self) -> None:
        led = self.ledger
        admitted = sum(a.prompt_len for r in self.done for a in r.admissions)
        reused = sum(a.reused for r in self.done for a in r.admissions)
        computed = sum(a.computed for r in self.done for a in r.admissions)
        if computed + reused != admitted:
            raise EngineInvariantError(f"prefill computed {computed} + reused {reused} != admitted prompt tokens {admitted}")
        if reused != sum(s.prepopulated_tokens for s in self.admitted_stats):
            raise EngineInvariantError("reused tokens differ from the ledger's per-request prepopulated counts")
        stats = led.stats()
        if sum(s.reused_blocks for s in self.admitted_stats) != stats.reused_blocks:
            raise EngineInvariantError(
                f"per-request reused blocks {sum(s.reused_blocks for s in self.admitted_stats)} != ledger {stats.reused_blocks}"
            )
        if sum(s.missed_blocks for s in self.admitted_stats) != stats.missed_blocks:
            raise EngineInvariantError("per-request missed blocks differ from the ledger's")
        if len(led):
            raise EngineInvariantError(f"requests still in the ledger after the run: {led.request_ids}")
        for w in led.windows:
            if led.num_allocated_blocks(w):
                raise EngineInvariantError(f"window {w}: {led.num_allocated_blocks(w)} blocks still referenced")
        led.verify_integrity()


def identical_outputs(a: RunResult, b: RunResult) -> bool:
    """Same request ids, same generated tokens."""
    return a.outputs == b.outputs


def max_logit_difference(a: RunResult, b: RunResult) -> float:
    """Largest |difference| between the chosen-token logits of two runs (same ids and tokens)."""
    worst = 0.0
    for k, la in a.chosen_logits.items():
        lb = b.chosen_logits.get(k, [])
        for x, y in zip(la, lb):
            worst = max(worst, abs(x - y))
    return worst


def min_margin(results: Iterable[RunResult]) -> float:
    """Smallest top-2 logit margin of any sampled token (how close greedy came to a tie)."""
    return min((m for res in results for ms in res.margins.values() for m in ms), default=float("inf"))
