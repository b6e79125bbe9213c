"""Host/device overlap ("async scheduling", as vLLM's flag and SGLang's overlap scheduler).

With `EngineConfig.async_scheduling` one `EngineCore.step()` call (`OverlappedStepper.step`)
  1. schedules step n+1 while step n still runs on the device (its tokens are unknown);
  2. commits it to the ledger: the token each decoding request is sampling in step n gets its
     position now (`reserve_in_flight`: `KVCacheManager.add_pending_tokens`, a block when it
     opens one); admissions, prefill chunks (a chunk's context position advances at dispatch,
     so the next step's scheduler cuts the following chunk);
  3. applies the ledger's transfers and dispatches step n+1's ONE forward without waiting
     (`dispatch_step`: `ModelRunner.dispatch`, the same program as a synchronous step of that
     shape); its decode rows read their input tokens straight from step n's device token array
     (`TokenFeed`: a small jitted op of its own writes them into the packed
     `tokens[:, TOK_ID]`), so no token crosses to the host and back;
  4. only then waits for step n's tokens (`complete`: `PendingStep.fetch`), fills the
     reserved ids (`set_pending_tokens`), stores the blocks step n completed (`store_new_blocks`,
     `store_context_blocks`), emits the tokens (stop checks, streaming) and finishes requests.
So the host prepares step n+1 and digests step n while the device computes; the outputs of a
`step()` call are step n's tokens, one step behind the dispatch.

Invariants (docs/serving.md):
  * One forward per step, as synchronously: a step with work dispatches exactly one
    `StepBatch` (`runner.num_forwards` + 1) of a shape in `forward_shapes`, LM head on the
    sampled positions only; the feed is not a forward, and a step that only reads the step in
    flight (`OverlappedStepper.drain`, before synchronous steps) dispatches none.
  * Device order. Every forward and every transfer consumes the pools the previous one
    returned (donated), so the device runs them in dispatch order: a block that the ledger
    frees, hands to another request, or moves (offload / onboard / copy of the transfer plan
    applied in step n+1, before its forward) is touched by that later work only after every
    earlier dispatched step finished writing it.
  * The cache holds only what completed steps wrote and the host read. A pending position is
    its request's newest token, which the ledger never counts as materialised, so no block
    holding an unknown id is hashed, matched or published; `store_new_blocks` and
    `store_context_blocks` of step n run after step n's tokens are fetched, and a request
    paused or aborted while a prefill chunk of it is unread leaves with its ledger context
    position back at the chunk's start (`OverlappedStepper.forget_unread_chunk`), so removal stores
    nothing that chunk writes.
  * A request that stops in step n (stop token, `max_new_tokens`, a stop string LLMEngine
    finds, an abort) already has a row in step n+1: that one row is wasted (`wasted_rows`),
    never two, and its tokens are dropped. The position it reserved is the newest token, so
    removing the request stores the blocks without it (and releases its block if it opened
    one): nothing a wasted row wrote is ever cached. A request whose in-flight token is its
    last (`max_new_tokens`) is not scheduled again: it wastes nothing.
  * A request paused while its token is in flight (MAX_UTILIZATION) leaves the ledger at once;
    the token joins its output when it arrives, before its re-admission.

Synchronous fallbacks (`needs_sync`): a step waits for the previous one's tokens (one call
only drains the in-flight step, then steps serially) while any live request has penalties or
`min_tokens` (its logits need the counts of every token so far), on multi-process ranks
(their ledgers are compared before any device work), and with a runner without `dispatch`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from kvjax.engine.batching import Row, TokenFeed
from kvjax.engine.core_types import CoreOutput, EngineInvariantError, StepCounts
from kvjax.engine.forward_io import forward_inputs, row_logprobs
from kvjax.engine.request_state import LiveRequest, Phase
from kvjax.engine.workloads import WorkItem
from kvjax.errors import OutOfBlocksError


def needs_sync(item: WorkItem) -> bool:
    """Does this request's sampling need every earlier token on the host (penalties, min_tokens)?"""
    sp = item.sampling
    return sp.penalized or sp.min_tokens > 0


@dataclasses.dataclass
class Forward:
    """A step's one dispatched forward: its runner handle (`PendingStep`), its prefill-group
    rows, the requests of all its rows (row order: the `nd` decode-group rows, then the prefill
    rows) and which prefill rows score their prompt."""

    pending: Any  # the runner's PendingStep: `tokens` (device), `real_rows`, `fetch()`
    prefill: list[Row]
    reqs: list[LiveRequest]
    nd: int
    scoring: list[bool]


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose tokens the host has not read: its one forward, whose first
    `generating` rows are generating requests' decode rows and whose other rows are the prefill
    chunks `chunks` (one-token chunks in the decode group first, in row order)."""

    step: int
    forward: Forward
    generating: int
    chunks: list[tuple[LiveRequest, int, bool, bool]]  # (request, tokens, completes the prompt, samples its first token)

    def token_places(self) -> dict[int, int]:
        """Per request with a row in it (by `id`), where its sampled token sits in the step's
        device tokens (`PendingStep.tokens`, padding rows included): what `TokenFeed.index`
        points at."""
        places = self.forward.pending.real_rows
        return {id(r): int(places[i]) for i, r in enumerate(self.forward.reqs)}


class OverlappedStepper:
    """The overlapped step of one `EngineCore` (the module docstring): it owns the dispatched
    step whose tokens are not read yet (`inflight`) and runs the step from the core's pieces
    (`admit`, `pause`, `prefill_chunks`, `apply_transfers`, `emit`, `finish`...). The core's
    own helper, built by it whether or not it overlaps (aborts and pauses ask it about unread
    chunks); `core` is not imported here: the core imports this module."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.inflight: InFlight | None = None  # the dispatched step whose tokens are not read yet

    def step(self, outputs: list[CoreOutput]) -> None:
        """One iteration with overlap (`EngineCore.step`): schedule, commit and dispatch this step
        while the previous one runs, then read the previous one's tokens."""
        core = self.core
        prev = self.inflight  # (kept there while this step runs: pauses and aborts look at its chunks)
        now = core.clock.now()
        # a request whose in-flight token is its last is done whatever the token: not scheduled again
        candidates = [r for r in core.running.values() if not (r.in_flight and r.remaining_new_tokens <= r.in_flight)]
        sched = core.scheduler.schedule(candidates, core.waiting, step=core.step_index)
        core.deferred += sched.deferred
        for r in sched.pause:
            core.pause(r)
        decode = core.commit_pending_tokens([r for r in sched.generation if not r.in_flight])
        reserved = self.reserve_in_flight([r for r in sched.generation if r.in_flight])
        admitted = core.admit(sched.admit, now)
        running = len(core.running)
        if not core.running and prev is None:
            self.inflight = None
            core.idle_step(len(admitted), len(sched.pause))
            return
        prefill = core.prefill_chunks(sched.context + admitted, len(decode) + len(reserved))
        prefill, onboarded = core.apply_transfers(prefill)
        step = self.dispatch_step(decode, reserved, prefill, prev)
        if step is not None:
            core.counters.overlapped_steps += prev is not None
        self.inflight = step
        if prev is not None:
            self.complete(prev, reserved, outputs)
        core.ledger.refresh_blocks()
        prefill_tokens = sum(n for _, n in prefill)
        rows = len(decode) + len(reserved)
        core.last_step = StepCounts(running, rows, prefill_tokens, len(admitted), len(sched.pause), onboarded)
        if core.steps is not None:
            core.record_step(rows, prefill_tokens, len(admitted), len(sched.pause))

    def reserve_in_flight(self, generation: list[LiveRequest]) -> list[LiveRequest]:
        """The position of each request's in-flight token enters the ledger before its id is
        known (`add_pending_tokens`): batched, or one by one when blocks run short (a request
        that finds none is paused). Returns the requests that decode this step."""
        core = self.core
        if not generation:
            return []
        led = core.ledger
        try:
            led.add_pending_tokens([r.request_id for r in generation])
            return list(generation)
        except OutOfBlocksError:  # nothing changed: one by one
            pass
        out = []
        for r in generation:
            try:
                led.add_pending_tokens([r.request_id])
            except OutOfBlocksError:
                core.accounting_misses += 1
                core.pause(r)
                continue
            out.append(r)
        return out

    def dispatch_step(self, decode: list[LiveRequest], reserved: list[LiveRequest],
                      prefill: list[tuple[LiveRequest, int]], prev: InFlight | None) -> InFlight | None:
        """Dispatch this step's ONE forward (rows as `EngineCore._forward_step` lays them out: the decode
        group, with the one-token chunks, then the prefill chunks); the reserved rows read their
        input tokens from `prev`'s device tokens (`TokenFeed`). Prefill progress is booked now
        (the next step cuts the next chunk)."""
        core = self.core
        if not decode and not reserved and not prefill:
            return None
        single = [(r, n) for r, n in prefill if n == 1 and not r.scores_prompt()]
        chunks = [(r, n) for r, n in prefill if n != 1 or r.scores_prompt()]
        drows = [Row(r.request_id, [r.output[-1]], len(r.prompt) + len(r.output) - 1) for r in decode]
        # a reserved row's token is the one `prev` is sampling: 0 here, the feed writes it on the device
        drows += [Row(r.request_id, [0], len(r.prompt) + len(r.output) + r.in_flight - 1) for r in reserved]
        drows += [Row(r.request_id, r.context[r.context_pos : r.context_pos + 1], r.context_pos) for r, _ in single]
        prows = [Row(r.request_id, r.context[r.context_pos : r.context_pos + n], r.context_pos) for r, n in chunks]
        prefill = single + chunks  # the rows' order after the generating requests' rows
        feed = None
        if reserved:
            assert prev is not None  # a token in flight was sampled by the previous step
            where = prev.token_places()
            index = np.array([-1] * len(decode) + [where[id(r)] for r in reserved], np.int32)  # [generating rows]
            feed = TokenFeed(prev.forward.pending.tokens, index)
        generating = decode + reserved
        fwd = self.dispatch(drows, prows, generating + [r for r, _ in prefill], len(drows), feed)
        for r in generating:
            r.in_flight += 1
        booked = [(r, n, *self.advance_prefill(r, n)) for r, n in prefill]
        return InFlight(core.step_index, fwd, len(generating), booked)

    def advance_prefill(self, r: LiveRequest, n: int) -> tuple[bool, bool]:
        """Book a dispatched chunk: does it complete the prompt, and is its sampled token the
        request's first (then in flight)?"""
        core = self.core
        r.context_pos += n
        core.counters.computed_prompt_tokens += n
        adm = r.admissions[-1]
        r.admissions[-1] = adm = dataclasses.replace(adm, computed=adm.computed + n)
        core.ledger.set_context_position(r.request_id, r.context_pos)
        if r.context_pos < len(r.context):
            return False, False
        if adm.computed + adm.reused + adm.transferred != adm.prompt_len:
            raise EngineInvariantError(
                f"{r.request_id}: computed {adm.computed} + reused {adm.reused} != prompt {adm.prompt_len}")
        if r.remaining_new_tokens <= 0:
            return True, False
        r.phase = Phase.GENERATION  # its first token is sampled now: it decodes from the next step
        r.in_flight += 1
        return True, True

    def complete(self, done: InFlight, reserved: list[LiveRequest], outputs: list[CoreOutput]) -> None:
        """Read a dispatched step's tokens: the reserved positions get their ids, the blocks it
        completed are stored, its tokens are emitted (a request that finished meanwhile, its row
        wasted, gets nothing), prompts it completed are stored and their held requests freed."""
        core = self.core
        led = core.ledger
        f, g = done.forward, done.generating
        rows = list(zip(f.reqs, *self.collect(f), strict=True))  # (request, token, chosen, margin, logprobs)
        sampled = rows[:g]  # the generating requests' rows, then each first token (admission order)
        sampled += sorted((row for row, (_, _, _, samples) in zip(rows[g:], done.chunks, strict=True) if samples),
                          key=lambda x: x[0].order)
        taken = {id(r) for r in reserved}
        fill = [(r.request_id, int(t)) for r, t, *_ in sampled if id(r) in taken]
        if fill:
            ids, toks = zip(*fill, strict=True)
            led.set_pending_tokens(list(ids), list(toks))
        if g:  # the blocks its generating rows completed (reserved first: the id list of this
            # step's add_pending_tokens, whose rows the ledger has at hand)
            led.store_new_blocks([r.request_id for r in reserved])
            rest = [r.request_id for r in f.reqs[:g] if id(r) not in taken and core.running.get(r.request_id) is r]
            if rest:
                led.store_new_blocks(rest)
        for r, _, last, samples in done.chunks:  # prompts completed: stored, their held requests freed
            if not last or r.phase is Phase.FINISHED:
                continue
            if core.running.get(r.request_id) is r:  # (a request paused meanwhile stored them leaving)
                led.store_context_blocks(r.request_id)
            core.release_held(r)
            if not samples:  # max_new_tokens == 0: nothing to generate
                core.finish(r, "length")
                outputs.append(CoreOutput(r, (), True))
        for r, t, c, m, lp in sampled:
            r.in_flight -= 1
            if r.phase is Phase.FINISHED:  # stopped or aborted after this row was dispatched
                r.wasted_rows += 1
                core.counters.wasted_rows += 1
                continue
            outputs.append(core.emit(r, int(t), float(c), float(m), lp, committed=id(r) in taken))

    def forget_unread_chunk(self, r: LiveRequest) -> None:
        """Before `r` leaves the ledger with its blocks stored: a prefill chunk of it that a
        dispatched step is computing and the host has not read is not stored (the ledger's
        context position goes back to the chunk's start), so the cache holds only what
        steps that were read wrote."""
        core = self.core
        fl = self.inflight
        if fl is None:
            return
        for x, n, _, _ in fl.chunks:
            if x is r:
                core.ledger.set_context_position(r.request_id, r.context_pos - n)
                return

    def drain(self, outputs: list[CoreOutput]) -> None:
        """Read the step in flight without dispatching another (before a synchronous step)."""
        core = self.core
        prev, self.inflight = self.inflight, None
        assert prev is not None
        self.complete(prev, [], outputs)
        core.last_step = StepCounts(len(core.running), 0, 0, 0, 0, 0)

    def dispatch(self, decode: list[Row], prefill: list[Row], reqs: list[LiveRequest], nd: int,
                 feed: TokenFeed | None) -> Forward:
        """`EngineCore._forward` without waiting: the step is enqueued, `collect` reads it."""
        core = self.core
        batch, args, extras, scoring = forward_inputs(core.engine.runner, core.ledger, core.cfg.buckets, core.vocab, decode,
                                                      prefill, reqs, nd)
        with core.clock.measuring():
            pending, core.pools = core.engine.runner.dispatch(core.pools, batch, *args, extras, feed)
        return Forward(pending, prefill, reqs, nd, scoring)

    def collect(self, f: Forward):
        """Wait for a dispatched step: what `EngineCore._forward` returns."""
        core = self.core
        with core.clock.measuring():
            out = f.pending.fetch()
        return out.tokens, out.chosen, out.margins, row_logprobs(out, f.prefill, f.reqs, f.nd, f.scoring)
