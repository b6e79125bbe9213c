"""The scheduler's questions: how much of a prompt is cached, how many blocks the next step or
the rest of a request needs, and dry runs of removals. All read-only; they answer from
admission's own planning (`kvjax.ledger.admission`), so an answer that fits means admission
succeeds. docs/semantics.md, "Scheduling accounting", states the guarantees.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from kvjax._math import ceil_div
from kvjax.errors import DuplicateRequestError, InvalidArgumentError, InvalidRequestError, SchedulingStateError
from kvjax.ledger.admission import plan_sequence, window_need
from kvjax.ledger.decode_batch import int_array
from kvjax.ledger.sequence import TrackedSequence
from kvjax.ledger.validation import check_flag, check_token_values
from kvjax.request import Request
from kvjax.validation import check_id_list, check_int

if TYPE_CHECKING:
    from kvjax.ledger.kv_cache_manager import KVCacheManager


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


def query_sequence(m: KVCacheManager, request: Request) -> TrackedSequence:
    """A Request passed to a query is checked as admission would check it (its id may be
    live); returns the sequence admission would build."""
    if not isinstance(request, Request):
        raise InvalidRequestError(f"expected a kvjax.Request, got {type(request).__name__}")
    seq = m._validate(request, None, live_ok=True)
    check_token_values(seq, 0)
    return seq


def resolve(m: KVCacheManager, request_or_id) -> tuple[Request, TrackedSequence | None]:
    if isinstance(request_or_id, Request):
        live = m._seqs.get(request_or_id.request_id) if request_or_id in m else None
        if live is None:
            query_sequence(m, request_or_id)
        return request_or_id, live
    seq = m._seq(request_or_id)
    return seq.request, seq


def check_query_args(two_steps_lookahead: object, summary: object) -> bool:
    if summary is not None and not isinstance(summary, PrefixReuseSummary):
        raise InvalidArgumentError(f"summary must be a PrefixReuseSummary or None, got {summary!r}")
    return check_flag("two_steps_lookahead", two_steps_lookahead)


def analyze_prefix_reuse(m: KVCacheManager, request: Request) -> PrefixReuseSummary:
    """Run admission's planning (tree walks, safe prefix, in-place or copy) without
    committing anything, and summarise it."""
    bm = m._bm
    plan = plan_sequence(bm, query_sequence(m, request))
    blocks = tuple(window_need(wm, [plan]).required for wm in bm.windows)
    wa = plan.windows[-1]
    ref = bm.windows[-1].refs.ref
    full = [b for b in wa.matched if b is not None]
    allocated = sum(1 for b in full if ref[b] > 0)
    return PrefixReuseSummary(len(full), allocated, plan.prepopulated, len(wa.matched), blocks)


def needed_blocks_one_step(
    m: KVCacheManager, request_or_id, two_steps_lookahead: object, window: int | None, summary: PrefixReuseSummary | None
) -> int:
    two_steps_lookahead = check_query_args(two_steps_lookahead, summary)
    wm = m._window_manager(window)
    request, seq = resolve(m, request_or_id)
    bm = m._bm
    tpb = bm.tokens_per_block
    beam = request.beam_width
    if seq is None:  # context phase
        if summary is None or len(summary.admission_blocks) != len(bm.windows):
            summary = analyze_prefix_reuse(m, request)
        needed = summary.admission_blocks[wm.index]
        if request.num_draft_tokens and not bm.is_cross:  # added by the first step
            prompt_len = len(request.prompt)
            with_drafts = min(prompt_len + request.num_draft_tokens, m.config.max_seq_len)
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
    m: KVCacheManager, request_or_id, window: int | None, summary: PrefixReuseSummary | None
) -> int:
    check_query_args(False, summary)
    wm = m._window_manager(window)
    request, seq = resolve(m, request_or_id)
    bm = m._bm
    cfg, tpb = m.config, bm.tokens_per_block
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
            summary = summary or analyze_prefix_reuse(m, request)
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
        summary = summary or analyze_prefix_reuse(m, request)
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


def _live_rows(m: KVCacheManager, request_ids: object) -> tuple[list | tuple, list[TrackedSequence]]:
    """The id list and its live sequences (an unknown id raises `UnknownRequestError`)."""
    ids = check_id_list("request_ids", request_ids)
    return ids, m._seqs_of(ids)


def remaining_blocks_to_completion_many(m: KVCacheManager, request_ids: object, window: int | None) -> np.ndarray:
    """`remaining_blocks_to_completion(id, window)` of each live request id, int64 `[n]`."""
    ids, seqs = _live_rows(m, request_ids)
    wm = m._window_manager(window)
    bm = m._bm
    if bm.is_cross or wm.is_swa or not seqs:
        return np.array([remaining_blocks_to_completion(m, r, window, None) for r in ids], dtype=np.int64)
    tpb, bubble = bm.tokens_per_block, m.config.sink_bubble_length
    widx = wm.index
    prompt = int_array([s.prompt_len for s in seqs])  # [n]
    final = prompt + int_array([s.max_new_tokens for s in seqs])  # [n]
    beam = int_array([s.beam_width for s in seqs])  # [n]
    try:
        rows = m._rows_of(ids, wm)  # one slot-table row per request unless some request has beams
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
    m: KVCacheManager, request_ids: object, two_steps_lookahead: object, window: int | None
) -> np.ndarray:
    """`needed_blocks_one_step(id, two_steps_lookahead, window)` of each live request id, int64 `[n]`."""
    two_steps_lookahead = check_flag("two_steps_lookahead", two_steps_lookahead)
    ids, seqs = _live_rows(m, request_ids)
    wm = m._window_manager(window)
    tpb = m._bm.tokens_per_block
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


def start_scheduling(m: KVCacheManager) -> DryRun:
    return DryRun(m._version, [wm.num_free_primary for wm in m._bm.windows])


def _check_dry_run(m: KVCacheManager) -> DryRun:
    run = m._dry_run
    if run is None:
        raise SchedulingStateError("call start_scheduling() first")
    if run.version != m._version:
        raise SchedulingStateError("the ledger changed since start_scheduling(); start a new dry run")
    return run


def scheduling_remove_sequence(m: KVCacheManager, request_id: Hashable) -> None:
    run = _check_dry_run(m)
    seq = m._seq(request_id)
    if request_id in run.removed:
        raise DuplicateRequestError(f"request {request_id!r} was already removed in this dry run")
    run.removed.add(request_id)
    for wm in m._bm.windows:
        shadow = run.shadow[wm.index]
        ref = wm.refs.ref
        for b in seq.windows[wm.index].unique_blocks():
            rc = shadow.get(b, ref[b]) - 1
            shadow[b] = rc
            if rc == 0:
                run.free[wm.index] += 1


def scheduling_num_free_blocks(m: KVCacheManager, window: int | None) -> int:
    run = _check_dry_run(m)
    if window is None:
        return min(run.free)
    return run.free[m._window_manager(window).index]


def scheduling_has_free_blocks(m: KVCacheManager, n: int, window: int | None) -> bool:
    run = _check_dry_run(m)
    n = check_int("n", n, 0, None)
    if window is None:
        return all(f >= n for f in run.free)
    return run.free[m._window_manager(window).index] >= n
