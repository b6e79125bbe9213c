"""The scheduler's questions: how much of a prompt is cached, how many blocks the next step or
the rest of a request needs, and dry runs of removals. All read-only; they answer from
admission's own planning (`kvjax.ledger.admission`), so an answer that fits means admission
succeeds. docs/semantics.md, "Scheduling accounting", states the guarantees.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from kvjax._math import ceil_div
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
    tpb = bm.tokens_per_block
    beam = request.beam_width
    if seq is None:  # context phase
        if summary is None or len(summary.admission_blocks) != len(bm.windows):
            summary = analyze_prefix_reuse(bm, live, request)
        needed = summary.admission_blocks[wm.index]
        if request.num_draft_tokens and not bm.is_cross:  # added by the first step
            prompt_len = len(request.prompt)
            with_drafts = min(prompt_len + request.num_draft_tokens, bm.config.max_seq_len)
            needed += (ceil_div(with_drafts, tpb) - ceil_div(prompt_len, tpb)) * beam
        return needed
    if seq.is_cross or seq.context_position < seq.prompt_len:
        return 0
    curr = seq.num_tokens
    steps = 2 if two_steps_lookahead else 1
    max_add = min(steps * (seq.num_draft_tokens + 1), seq.max_new_tokens - (curr - seq.prompt_len))
    nxt = curr + max(max_add, 0)
    if nxt > wm.max_token_num:
        return 0
    return (ceil_div(nxt, tpb) - ceil_div(curr, tpb)) * beam


def remaining_blocks_to_completion(
    bm: BlockManager, live: LiveSequences, request_or_id, window: int | None, summary: PrefixReuseSummary | None
) -> int:
    check_query_args(False, summary)
    wm = window_manager(bm, window)
    request, seq = resolve(bm, live, request_or_id)
    cfg, tpb = bm.config, bm.tokens_per_block
    bubble = cfg.sink_bubble_length
    beam = request.beam_width
    if bm.is_cross:
        if seq is not None:
            return 0
        assert request.encoder_len is not None  # `resolve` validated the request for a cross cache
        return ceil_div(request.encoder_len, tpb)
    prompt_len = len(request.prompt)
    final = prompt_len + request.max_new_tokens
    alloc = 0 if seq is None else len(seq.windows[wm.index].blocks[0])
    reuse_ok = bm.reuse and not cfg.is_variable_window and alloc == 0
    if wm.is_swa:
        held = 0 if seq is None else alloc - seq.windows[wm.index].num_front_removed
        ctx = ceil_div(prompt_len + bubble, tpb)
        if reuse_ok:
            summary = summary or analyze_prefix_reuse(bm, live, request)
            ctx -= min(summary.reusable_blocks_allocated, (prompt_len - 1) // tpb)
        # held blocks peak at ceil((window + drafts) / tpb) + 1: the blocks the oldest draft
        # query sees, and a new block is allocated before the token's detach releases one
        span = wm.window + request.num_draft_tokens
        steady = min(ceil_div(final + bubble, tpb), ceil_div(span, tpb) + 1) * beam
        # until the first token is added nothing has left the window: if that token starts
        # a block, the whole context plus one block is held for a moment
        cur = prompt_len if seq is None else seq.num_tokens
        first = (ctx if seq is None else held) + beam * int(cur < final and (cur + bubble) % tpb == 0)
        peak = max(first, steady)
        return max(0, peak - held)
    span = wm.window + wm.temporary_window
    ctx = (min(prompt_len, span) + bubble) // tpb
    total = ceil_div(min(final, span) + bubble, tpb)
    gen = total - ctx
    reusable = 0
    if reuse_ok:
        summary = summary or analyze_prefix_reuse(bm, live, request)
        reusable = min(summary.reusable_blocks_allocated, ctx, (prompt_len - 1) // tpb)
    cur_tokens = prompt_len if seq is None else seq.num_tokens
    extra = int(final > wm.window and ceil_div(final, tpb) > ceil_div(cur_tokens, tpb) and ceil_div(final, tpb) > total)
    if alloc < ctx - reusable:
        return (ctx - reusable - alloc) + (gen + extra) * beam
    return max(0, (total - reusable - alloc + extra) * beam)


# ---------------------------------------------------------------------------- many live requests
# A scheduler asks these of every running request every step: one call per request costs
# several microseconds (argument checks, the lock, a dozen attribute reads), 9 ms a step at
# 1,024 requests. The batched forms read each sequence once per field and do the arithmetic
# in numpy (about 1 ms); a sliding window's or a cross cache's remaining blocks take the
# scalar form per request.


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
    if bm.is_cross or wm.is_swa or not seqs:
        return np.array([remaining_blocks_to_completion(bm, live, r, window, None) for r in ids], dtype=np.int64)
    tpb, bubble = bm.tokens_per_block, bm.config.sink_bubble_length
    widx = wm.index
    prompt = int_array([s.prompt_len for s in seqs])  # [n]
    final = prompt + int_array([s.max_new_tokens for s in seqs])  # [n]
    beam = int_array([s.beam_width for s in seqs])  # [n]
    try:
        rows = live.slot_rows(ids, wm)  # one slot-table row per request unless some request has beams
    except DuplicateRequestError:  # a block table takes each id once; a query may ask twice
        rows = None
    if rows is not None and len(rows) == len(ids):  # a row's length is its beam-0 block count: no walk
        alloc = wm.slot_table.lengths[rows].astype(np.int64)  # [n]
    else:
        alloc = int_array([len(s.windows[widx].blocks[0]) for s in seqs])  # [n]
    # a full-attention window spans `max_seq_len`, so the scalar form's clipping to the window
    # (and its extra block for a request outgrowing it) never applies here
    ctx = (prompt + bubble) // tpb  # [n]
    total = ceil_div(final + bubble, tpb)  # [n]
    # (a live request holds its prompt's blocks, never none: the scalar form's credit for
    # reusable blocks, which only a request holding none gets, does not apply)
    return np.where(alloc < ctx, ctx - alloc + (total - ctx) * beam, np.maximum(0, (total - alloc) * beam))


def needed_blocks_one_step_many(
    bm: BlockManager, live: LiveSequences, request_ids: object, two_steps_lookahead: object, window: int | None
) -> np.ndarray:
    """`needed_blocks_one_step(id, two_steps_lookahead, window)` of each live request id, int64 `[n]`."""
    two_steps_lookahead = check_flag("two_steps_lookahead", two_steps_lookahead)
    ids, seqs = _live_rows(live, request_ids)
    wm = window_manager(bm, window)
    tpb = bm.tokens_per_block
    cur = int_array([s.num_tokens for s in seqs])  # [n]
    prompt = int_array([s.prompt_len for s in seqs])  # [n]
    idle = np.array([s.is_cross or s.context_position < s.prompt_len for s in seqs], dtype=bool)  # [n]
    steps = 2 if two_steps_lookahead else 1
    drafts = int_array([s.num_draft_tokens for s in seqs])  # [n]
    left = int_array([s.max_new_tokens for s in seqs]) - (cur - prompt)  # [n] tokens still to generate
    nxt = cur + np.maximum(np.minimum(steps * (drafts + 1), left), 0)  # [n]
    need = (ceil_div(nxt, tpb) - ceil_div(cur, tpb)) * int_array([s.beam_width for s in seqs])  # [n] blocks the new tokens start
    return np.where(idle | (nxt > wm.max_token_num), 0, need)


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
