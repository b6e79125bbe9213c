"""Host/device overlap ("async scheduling", as vLLM's flag and SGLang's overlap scheduler).

With `EngineConfig.async_scheduling` one `EngineCore.step()` call
  1. schedules step n+1 while step n still runs on the device (its tokens are unknown);
  2. commits it to the ledger: the token each decoding request is sampling in step n gets its
     position now (`KVCacheManager.add_pending_tokens`, a block when it opens one); admissions,
     prefill chunks (a chunk's context position advances at dispatch, so the next step's
     scheduler cuts the following chunk);
  3. applies the ledger's transfers and dispatches step n+1's ONE forward without waiting
     (`ModelRunner.dispatch`, the same program as a synchronous step of that shape); its
     decode rows read their input tokens straight from step n's device token array
     (`TokenFeed`: a small jitted op of its own writes them into the packed
     `tokens[:, TOK_ID]`), so no token crosses to the host and back;
  4. only then waits for step n's tokens (`PendingStep.fetch`), fills the reserved ids
     (`set_pending_tokens`), stores the blocks step n completed (`store_new_blocks`,
     `store_context_blocks`), emits the tokens (stop checks, streaming) and finishes requests.
So the host prepares step n+1 and digests step n while the device computes; the outputs of a
`step()` call are step n's tokens, one step behind the dispatch.

Invariants (docs/serving.md):
  * One forward per step, as synchronously: a step with work dispatches exactly one
    `StepBatch` (`runner.num_forwards` + 1) of a shape in `forward_shapes`, LM head on the
    sampled positions only; the feed is not a forward, and a step that only reads the step in
    flight (`_drain`, before synchronous steps) dispatches none.
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
    position back at the chunk's start (`EngineCore._forget_unread_chunk`), so removal stores
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

from kvjax.engine.batching import Row
from kvjax.engine.request_state import LiveRequest
from kvjax.engine.workloads import WorkItem


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
