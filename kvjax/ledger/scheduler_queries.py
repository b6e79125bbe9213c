"""The scheduler's questions: how much of a prompt is cached, how many blocks the next step or
the rest of a request needs, and dry runs of removals. All read-only; they answer from
admission's own planning (`kvjax.ledger.admission`), so an answer that fits means admission
succeeds. docs/semantics.md, "Scheduling accounting", states the guarantees.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from kvjax.errors import DuplicateRequestError, InvalidArgumentError, InvalidRequestError, SchedulingStateError
from kvjax.ledger.admission import plan_sequence, window_need
from kvjax.ledger.packing import int_array
from kvjax.ledger.sequence import TrackedSequence
from kvjax.ledger.validation import check_flag, check_token_values, validate_request, window_manager
from kvjax.request import Request
from kvjax.validation import check_id_list, check_int

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences


@dataclasses.dataclass(frozen=True)
class PrefixReuseSummary:
    """Admission's own plan, read-only: "how much of this prompt is cached, and what would
    admitting it take?" (scheduler input; one tree walk per window).

    `reusable_blocks_all`: full blocks of the prompt admission would reuse (largest window);
    `reusable_blocks_allocated`: those already referenced by live sequences (the only ones a
    block budget may subtract: free cached blocks already count as free supply);
    `total_matched_tokens`: tokens admission would prepopulate (partial matches included);
    `first_new_block`: index of the first context block admission must allocate;
    `admission_blocks`: per window (ascending), the free primary blocks that window must have
    for the admission to succeed now (what `needed_blocks_one_step` answers, drafts aside).
    """

    reusable_blocks_all: int
    reusable_blocks_allocated: int
    total_matched_tokens: int
    first_new_block: int
    admission_blocks: tuple[int, ...] = ()


def query_sequence(bm: BlockManager, live: LiveSequences, request: Request) -> TrackedSequence:
    """A Request passed to a query is checked as admission would check it (its id may be
    live); returns the sequence admission would build."""
    if not isinstance(request, Request):
        raise InvalidRequestError(f"expected a kvjax.Request, got {type(request).__name__}")
    seq = validate_request(request, bm.config, len(bm.windows), bm.is_cross, live.seqs, None, True, live.tok)
    check_token_values(seq, 0)
    return seq


def resolve(bm: BlockManager, live: LiveSequences, request_or_id) -> tuple[Request, TrackedSequence | None]:
    """A Request is asked about as a request to admit (even if its id is live); an id, as the
    live request it names."""
    if isinstance(request_or_id, Request):
        query_sequence(bm, live, request_or_id)
        return request_or_id, None
    seq = live.get(request_or_id)
    return seq.request, seq


def check_query_args(two_steps_lookahead: object, summary: object) -> bool:
    if summary is not None and not isinstance(summary, PrefixReuseSummary):
        raise InvalidArgumentError(f"summary must be a PrefixReuseSummary or None, got {summary!r}")
    return check_flag("two_steps_lookahead", two_steps_lookahead)


def analyze_prefix_reuse(bm: BlockManager, live: LiveSequences, request: Request) -> PrefixReuseSummary:
    """Run admission's planning (tree walks, safe prefix, in-place or copy) without
    committing anything, and summarise it."""
    plan = plan_sequence(bm, query_sequence(bm, live, request))
    blocks = tuple(window_need(wm, [plan]).required for wm in bm.windows)
    wa = plan.windows[-1]
    ref = bm.windows[-1].refs.ref
    full = [b for b in wa.matched if b is not None]
    allocated = sum(1 for b in full if ref[b] > 0)
    return PrefixReuseSummary(len(full), allocated, plan.prepopulated, len(wa.matched), blocks)


def needed_blocks_one_step(
    bm: BlockManager,
    live: LiveSequences,
    request_or_id,
    two_steps_lookahead: object,
    window: int | None,
    summary: PrefixReuseSummary | None,
) -> int:
    two_steps_lookahead = check_query_args(two_steps_lookahead, summary)
    wm = window_manager(bm, window)
    request, seq = resolve(bm, live, request_or_id)
    if seq is None:  # context phase
        if summary is None or len(summary.admission_blocks) != len(bm.windows):
            summary = analyze_prefix_reuse(bm, live, request)
        return summary.admission_blocks[wm.index] + wm.draft_blocks(request)  # drafts: added by the first step
    return wm.step_blocks(seq, 2 if two_steps_lookahead else 1, request.beam_width)


def remaining_blocks_to_completion(
    bm: BlockManager, live: LiveSequences, request_or_id, window: int | None, summary: PrefixReuseSummary | None
) -> int:
    check_query_args(False, summary)
    wm = window_manager(bm, window)
    request, seq = resolve(bm, live, request_or_id)

    def reusable() -> int:  # admission's own walk, only when the window's formula credits reuse
        return (summary or analyze_prefix_reuse(bm, live, request)).reusable_blocks_allocated

    return wm.remaining_blocks(request, seq, bm.reuse and not bm.config.is_variable_window, reusable)


# ---------------------------------------------------------------------------- many live requests
# A scheduler asks these of every running request every step: one call per request costs
# several microseconds (argument checks, the lock, a dozen attribute reads), 9 ms a step at
# 1,024 requests. The batched forms read each sequence once per field and do the arithmetic
# in numpy (about 1 ms), where the window's kind has a batched form (`remaining_blocks_many`:
# full attention; a sliding window's or a cross cache's take the scalar form per request).


def _live_rows(live: LiveSequences, request_ids: object) -> tuple[list | tuple, list[TrackedSequence]]:
    """The id list and its live sequences (an unknown id raises `UnknownRequestError`)."""
    ids = check_id_list("request_ids", request_ids)
    return ids, live.of(ids)


def remaining_blocks_to_completion_many(
    bm: BlockManager, live: LiveSequences, request_ids: object, window: int | None
) -> np.ndarray:
    """`remaining_blocks_to_completion(id, window)` of each live request id, int64 `[n]`."""
    ids, seqs = _live_rows(live, request_ids)
    wm = window_manager(bm, window)

    def allocated() -> np.ndarray:  # [n] each request's beam-0 block count
        try:
            rows = live.slot_rows(ids, wm)  # one slot-table row per request unless some request has beams
        except DuplicateRequestError:  # a block table takes each id once; a query may ask twice
            rows = None
        if rows is not None and len(rows) == len(ids):  # a row's length is its beam-0 block count: no walk
            return wm.slot_table.lengths[rows].astype(np.int64)  # [n]
        return int_array([len(s.windows[wm.index].blocks[0]) for s in seqs])  # [n]

    def one(i: int) -> int:
        return remaining_blocks_to_completion(bm, live, ids[i], window, None)

    return wm.remaining_blocks_many(seqs, allocated, one)


def needed_blocks_one_step_many(
    bm: BlockManager, live: LiveSequences, request_ids: object, two_steps_lookahead: object, window: int | None
) -> np.ndarray:
    """`needed_blocks_one_step(id, two_steps_lookahead, window)` of each live request id, int64 `[n]`."""
    two_steps_lookahead = check_flag("two_steps_lookahead", two_steps_lookahead)
    ids, seqs = _live_rows(live, request_ids)
    wm = window_manager(bm, window)
    return wm.step_blocks_many(seqs, 2 if two_steps_lookahead else 1)


# ---------------------------------------------------------------------------- dry runs
class DryRun:
    """A scheduling dry run: shadow reference counts of the blocks touched so far, per window,
    and the free counts they imply. Valid while the ledger's version stays `version`."""

    __slots__ = ("version", "free", "shadow", "removed")

    def __init__(self, version: int, free: list[int]) -> None:
        self.version = version
        self.free = free
        self.shadow: list[dict[int, int]] = [{} for _ in free]
        self.removed: set = set()


def start_scheduling(bm: BlockManager, version: int) -> DryRun:
    """A dry run of the ledger at `version` (the facade's count of completed mutations)."""
    return DryRun(version, [wm.num_free_primary for wm in bm.windows])


def check_dry_run(run: DryRun | None, version: int) -> DryRun:
    """`run`, if it is still valid at the ledger's `version`."""
    if run is None:
        raise SchedulingStateError("call start_scheduling() first")
    if run.version != version:
        raise SchedulingStateError("the ledger changed since start_scheduling(); start a new dry run")
    return run


def scheduling_remove_sequence(bm: BlockManager, run: DryRun, seq: TrackedSequence) -> None:
    rid = seq.request_id
    if rid in run.removed:
        raise DuplicateRequestError(f"request {rid!r} was already removed in this dry run")
    run.removed.add(rid)
    for wm in bm.windows:
        shadow = run.shadow[wm.index]
        ref = wm.refs.ref
        for b in seq.windows[wm.index].unique_blocks():
            rc = shadow.get(b, ref[b]) - 1
            shadow[b] = rc
            if rc == 0:
                run.free[wm.index] += 1


def scheduling_num_free_blocks(bm: BlockManager, run: DryRun, window: int | None) -> int:
    if window is None:
        return min(run.free)
    return run.free[window_manager(bm, window).index]


def scheduling_has_free_blocks(bm: BlockManager, run: DryRun, n: int, window: int | None) -> bool:
    n = check_int("n", n, 0, None)
    if window is None:
        return all(f >= n for f in run.free)
    return run.free[window_manager(bm, window).index] >= n
