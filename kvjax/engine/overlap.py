"""Host/device overlap ("async scheduling", as vLLM's flag and SGLang's overlap scheduler).

With `EngineConfig.async_scheduling` one `EngineCore.step()` call
  1. schedules step n+1 while step n still runs on the device (its tokens are unknown);
  2. commits it to the ledger: the token each decoding request is sampling in step n gets its
     position now (`KVCacheManager.add_pending_tokens`, a block when it opens one); admissions,
     prefill chunks (a chunk's context position advances at dispatch, so the next step's
     scheduler cuts the following chunk);
  3. applies the ledger's transfers and dispatches step n+1's forwards without waiting
     (`ModelRunner.dispatch`); its decode rows read their input tokens straight from step n's
     device token arrays (`TokenFeed`), so no token crosses to the host and back;
  4. only then waits for step n's tokens (`PendingForward.fetch`), fills the reserved ids
     (`set_pending_tokens`), stores the blocks step n completed (`store_new_blocks`,
     `store_context_blocks`), emits the tokens (stop checks, streaming) and finishes requests.
So the host prepares step n+1 and digests step n while the device computes; the outputs of a
`step()` call are step n's tokens, one step behind the dispatch.

Invariants (docs/serving.md):
  * Device order. Every forward and every transfer consumes the pools the previous one
    returned (donated), so the device runs them in dispatch order: a block that the ledger
    frees, hands to another request, or moves (offload / onboard / copy of the transfer plan
    applied in step n+1, before its forwards) is touched by that later work only after every
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
    """One dispatched forward: its runner handle, rows and requests (in row order)."""

    pending: Any  # the runner's PendingForward
    rows: list[Row]
    reqs: list[LiveRequest]
    scores_prompt: bool


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose tokens the host has not read: its decode forward (if any) and
    prefill forwards, and the prefill chunks in forward order."""

    step: int
    decode: Forward | None
    prefill: list[Forward]
    chunks: list[tuple[LiveRequest, int, bool, bool]]  # (request, tokens, completes the prompt, samples its first token)

    def sources(self) -> tuple[tuple, dict[int, int]]:
        """The device token arrays of its forwards (in order) and, per request that samples a
        token, its entry in their concatenation (what `TokenFeed.index` points at)."""
        arrays, where, offset = [], {}, 0
        for f in ([self.decode] if self.decode is not None else []) + self.prefill:
            toks = f.pending.tokens
            arrays.append(toks)
            for i, r in enumerate(f.reqs):
                where[id(r)] = offset + i
            offset += int(toks.shape[0])
        return tuple(arrays), where
