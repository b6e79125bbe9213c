"""Capacity scheduling: which requests run this step, which are admitted, which are paused.

Two policies, as in TensorRT-LLM's `CapacityScheduler`:

GUARANTEED_NO_EVICT  Every running request has its blocks to completion reserved
    (`remaining_blocks_to_completion`); a waiting request is admitted only if its own
    remaining blocks fit in the free blocks left after those reservations. A running
    request therefore never runs out of blocks and is never paused. Conservative: blocks
    that a short answer never uses stay reserved.
MAX_UTILIZATION  Admit on what the next step needs (`needed_blocks_one_step`), with the
    ledger's scheduling ref counts as a dry run: running requests are visited oldest first;
    when one does not fit, the most recently started generating request is paused
    (`scheduling_remove_sequence` frees its blocks in the dry run) and the visit retried.
    A paused request leaves the ledger with its blocks stored for reuse and is re-admitted
    first, recomputing only what was evicted meanwhile.

Both count blocks per attention window and admit in queue order (below;
the first waiting request that does not fit stops admission). Free blocks include cached
blocks nobody references (they are evictable); reusable blocks are subtracted only when
already referenced by a live request, as the ledger's queries do (TensorRT-LLM PR #11731).

Token budget: a step processes at most `max_num_tokens` tokens: one per generating request,
then prefill chunks; a waiting request is admitted only while the budget has room for part of
its prefill (its cached prefix, `analyze_prefix_reuse().total_matched_tokens`, costs nothing).

Waiting-queue order (`queue_policy`): paused requests always come first (oldest first); then
FCFS keeps arrival order, while LPM (SGLang's "longest prefix match") puts the requests with
the most cached prompt tokens first (`analyze_prefix_reuse().total_matched_tokens`, one tree
walk each; ties keep arrival order), so a prefix is reused while it is still cached. LPM's
starvation guard: a request that has waited `max_wait_steps` engine steps or more moves ahead
of every request that has not (in arrival order), so a request with nothing cached is served
after a bounded wait however many cache hits keep arriving.

Prefix-aware deferral (`defer_shared_prefix`): a waiting request whose prompt shares more
full blocks with a request still in prefill than the cache holds now waits for that prefill
to be stored instead of computing the same prefix a second time in parallel.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from kvjax.engine.request_state import LiveRequest, Phase


class QueuePolicy(enum.StrEnum):
    """Order of the waiting queue: first come first served, or longest cached prefix first."""

    FCFS = "fcfs"
    LPM = "lpm"

    @classmethod
    def parse(cls, value: str | QueuePolicy) -> QueuePolicy:
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower()
        for p in cls:
            if p.value == text:
                return p
        raise ValueError(f"queue policy must be one of {[p.value for p in cls]}, got {value!r}")


class SchedulerPolicy(enum.StrEnum):
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    MAX_UTILIZATION = "max_utilization"

    @classmethod
    def parse(cls, value: str | SchedulerPolicy) -> SchedulerPolicy:
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower().replace("-", "_")
        for p in cls:
            if p.value == text:
                return p
        raise ValueError(f"scheduler policy must be one of {[p.value for p in cls]}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    policy: SchedulerPolicy = SchedulerPolicy.GUARANTEED_NO_EVICT
    max_batch_size: int = 8  # requests in the ledger at once
    max_num_tokens: int = 256  # tokens processed per step (decode tokens + prefill chunks)
    defer_shared_prefix: bool = True
    two_steps_lookahead: bool = False
    queue_policy: QueuePolicy = QueuePolicy.FCFS
    max_wait_steps: int = 64  # LPM starvation guard: steps after which a request goes first

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", SchedulerPolicy.parse(self.policy))
        object.__setattr__(self, "queue_policy", QueuePolicy.parse(self.queue_policy))
        for name in ("max_batch_size", "max_num_tokens", "max_wait_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(
                f"max_num_tokens={self.max_num_tokens} must be >= max_batch_size={self.max_batch_size} "
                "(every generating request needs one token per step)"
            )


@dataclasses.dataclass
class Schedule:
    """One step's decision. `generation` and `context` are running requests scheduled this
    step (oldest first); `admit` are waiting requests to add to the ledger (in order);
    `pause` are running requests to take out of the ledger."""

    generation: list[LiveRequest] = dataclasses.field(default_factory=list)
    context: list[LiveRequest] = dataclasses.field(default_factory=list)
    admit: list[LiveRequest] = dataclasses.field(default_factory=list)
    pause: list[LiveRequest] = dataclasses.field(default_factory=list)
    deferred: int = 0


class CapacityScheduler:
    """Decides each step from the ledger's accounting; mutates nothing but the ledger's
    scheduling dry-run counts (the engine carries the decision out)."""

    def __init__(self, config: SchedulerConfig, ledger) -> None:
        self.config = config
        self.ledger = ledger
        self.windows = tuple(ledger.windows)
        self.tpb = ledger.tokens_per_block

    # ------------------------------------------------------------------ entry point
    def schedule(self, running: Sequence[LiveRequest], waiting: Sequence[LiveRequest], step: int | None = None) -> Schedule:
        """One step's decision. `step` (the engine's step index) ages waiting requests for the
        LPM starvation guard; None: no request counts as starved."""
        running = sorted(running, key=lambda r: r.order)
        if self.config.policy is SchedulerPolicy.GUARANTEED_NO_EVICT:
            out, fits = self._guaranteed_no_evict(running)
        else:
            out, fits = self._max_utilization(running)
        if not out.pause:
            summaries: dict[int, object] = {}
            ordered = self.order_waiting(waiting, step, summaries)
            self._admit(out, running, ordered, fits, summaries)
        return out

    def order_waiting(
        self, waiting: Sequence[LiveRequest], step: int | None = None, summaries: dict | None = None
    ) -> list[LiveRequest]:
        """The waiting queue in admission order (see the module docstring). `summaries`, if
        given, receives each walked request's prefix summary (keyed by `id(request)`)."""
        waiting = list(waiting)
        if self.config.queue_policy is QueuePolicy.FCFS or len(waiting) < 2:
            return waiting
        paused = [r for r in waiting if r.admissions]
        fresh = [r for r in waiting if not r.admissions]
        limit = self.config.max_wait_steps
        starved = [r for r in fresh if step is not None and step - r.arrival_step >= limit]
        rest = [r for r in fresh if not (step is not None and step - r.arrival_step >= limit)]
        led = self.ledger
        cached = {}
        for r in rest:
            summary = led.analyze_prefix_reuse(r.ledger_request())
            cached[id(r)] = summary.total_matched_tokens
            if summaries is not None:
                summaries[id(r)] = summary
        rest.sort(key=lambda r: -cached[id(r)])  # stable: ties keep arrival order
        return paused + starved + rest

    # ------------------------------------------------------------------ policies
    def _guaranteed_no_evict(self, running: list[LiveRequest]):
        led = self.ledger
        free = {w: led.num_free_blocks(w) for w in self.windows}
        ids = [r.request_id for r in running]  # one batched query per window, not one per request
        reserved = {w: int(led.remaining_blocks_to_completion_many(ids, w).sum()) for w in self.windows}
        out = Schedule()
        for r in running:
            (out.generation if r.phase is Phase.GENERATION else out.context).append(r)

        def fits(request, summary=None) -> bool:
            need = {w: led.remaining_blocks_to_completion(request, w, summary=summary) for w in self.windows}
            if all(reserved[w] + need[w] <= free[w] for w in self.windows):
                for w in self.windows:
                    reserved[w] += need[w]
                return True
            return False

        return out, fits

    def _max_utilization(self, running: list[LiveRequest]):
        led = self.ledger
        look = self.config.two_steps_lookahead
        led.start_scheduling()
        scheduled = {w: 0 for w in self.windows}
        free = {w: led.scheduling_num_free_blocks(w) for w in self.windows}  # read again after each pause
        out = Schedule()

        def fits(need: dict[int, int]) -> bool:
            if all(scheduled[w] + need[w] <= free[w] for w in self.windows):
                for w in self.windows:
                    scheduled[w] += need[w]
                return True
            return False

        def try_fit(request_or_id, summary=None) -> bool:
            # a new request's summary (one planning pass) serves every window's query
            return fits({w: led.needed_blocks_one_step(request_or_id, look, w, summary=summary) for w in self.windows})

        # the running requests' needs, one batched query per window (a pause frees blocks but
        # changes no other request's need)
        ids = [r.request_id for r in running]
        needs = {w: dict(zip(ids, led.needed_blocks_one_step_many(ids, look, w).tolist(), strict=True)) for w in self.windows}
        candidates = list(running)
        i = 0
        while i < len(candidates):
            r = candidates[i]
            if fits({w: needs[w][r.request_id] for w in self.windows}):
                (out.generation if r.phase is Phase.GENERATION else out.context).append(r)
                i += 1
                continue
            # free the blocks of the most recently started generating request not yet scheduled
            victim = next((c for c in reversed(candidates[i:]) if c.phase is Phase.GENERATION), None)
            if victim is None:
                break
            led.scheduling_remove_sequence(victim.request_id)
            free.update({w: led.scheduling_num_free_blocks(w) for w in self.windows})
            out.pause.append(victim)
            candidates.remove(victim)
        return out, try_fit

    # ------------------------------------------------------------------ admission
    def _admit(
        self, out: Schedule, running: list[LiveRequest], waiting: Sequence[LiveRequest], fits, summaries: dict | None = None
    ) -> None:
        cfg = self.config
        led = self.ledger
        slots = cfg.max_batch_size - len(running)
        tokens_left = cfg.max_num_tokens - len(out.generation) - sum(r.context_remaining for r in out.context)
        # (tokens, lora id, cache salt) of prompts whose prefill has not been stored yet
        in_prefill: list[tuple[Sequence[int], int | None, str | None]] = [
            (r.context, r.item.lora_task_id, r.item.cache_salt) for r in out.context
        ]
        for r in waiting:
            if slots <= 0 or tokens_left <= 0:
                break
            request = r.ledger_request()
            summary = (summaries or {}).get(id(r)) or led.analyze_prefix_reuse(request)
            prompt = request.prompt
            key = (r.item.lora_task_id, r.item.cache_salt)
            if cfg.defer_shared_prefix and self._should_defer(prompt, key, summary.reusable_blocks_all, in_prefill):
                out.deferred += 1
                continue
            if not fits(request, summary):
                break
            out.admit.append(r)
            slots -= 1
            tokens_left -= len(prompt) - min(summary.total_matched_tokens, len(prompt) - 1)
            in_prefill.append((prompt, *key))

    def _should_defer(self, prompt: Sequence[int], key: tuple, cached_blocks: int, in_prefill: list[tuple]) -> bool:
        """True if a prompt still in prefill (same LoRA id and salt) will give this one more
        full blocks than the cache holds now."""
        tpb = self.tpb
        usable = len(prompt) - 1  # the last prompt token is always recomputed
        if usable < tpb:
            return False
        for other, lora, salt in in_prefill:
            if (lora, salt) != key or len(other) <= tpb or other[:tpb] != prompt[:tpb]:
                continue
            n = min(usable, len(other) - 1)
            common = tpb
            while common < n and other[common] == prompt[common]:
                common += 1
            if common // tpb > cached_blocks:
                return True
        return False
