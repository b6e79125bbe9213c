"""Admission with reuse: plan every request and window read-only, check the batch's capacity,
then commit, so that admission is atomic and batch-aware.

`plan_sequence` walks the tree for every window (`match`, per the window's kind) and fixes the
prepopulated length (the minimum over windows, shortened until every window's `reuse_safe`
holds); `check_capacity` decides in-place versus copy for partial matches and counts what the
batch takes (`window_need`, the count the scheduler queries share); only then does
`commit_admission` claim, copy, onboard and allocate. A failed check raises before anything changed.
"""
from __future__ import annotations

import dataclasses
import itertools
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

from kvjax.errors import InvalidRequestError, OutOfBlocksError
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID, PRIMARY, SECONDARY
from kvjax.ledger.radix_tree import NO_BLOCK, ROOT
from kvjax.ledger.sequence import StoreCursor, TrackedSequence
from kvjax.ledger.token_path import TokenPath
from kvjax.ledger.validation import check_token_values, validate_request
from kvjax.request import Request

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences
    from kvjax.ledger.window_manager import WindowBlockManager


@dataclasses.dataclass(slots=True)
class WindowAdmission:
    """What admission will do for one request in one window.

    `matched` holds the fully matched block ids from position 0 (None: a position a window
    that detaches does not need, left as a placeholder); `partial` the (block, tokens) matched in the
    next position, if any; the remaining shared positions and per-beam blocks are allocated.
    """

    matched: list[int | None]
    partial: tuple[int, int] | None
    num_shared: int  # context blocks shared by all beams
    num_per_beam: int = 0  # 1 when the last context block is allocated once per beam
    gap_ends: list[int] = dataclasses.field(default_factory=list)  # a window that detaches: end of each missing position
    coverage: int = 0  # tokens matched
    # the matched blocks `window_need` found free (a one-request batch): committing takes
    # exactly these out of the free queues
    free: list[int] | None = None

    @property
    def num_matched_positions(self) -> int:
        return len(self.matched) + (self.partial is not None)


class WindowNeed(NamedTuple):
    """Free primary blocks an admission takes from one window, phase by phase.

    `held`: free matched primary blocks taken out of the queues first (copy sources included);
    `claims`: blocks phase A allocates (onboard targets, partial copies); `released`: held
    copy sources that go back to the queues after phase A; `fresh`: blocks phase B allocates.
    """

    held: int
    claims: int
    released: int
    fresh: int
    in_place: dict

    @property
    def required(self) -> int:
        """Free primary blocks the window must have: phase A draws on the unheld ones, phase B
        on what is left plus the released copy sources."""
        return self.held + max(self.claims, self.claims + self.fresh - self.released)

    @property
    def taken(self) -> int:
        """How far `num_free_blocks` drops once the admission is committed."""
        return self.held - self.released + self.claims + self.fresh


@dataclasses.dataclass(slots=True)
class AdmissionPlan:
    """One request's admission: its sequence, per-window plans and prepopulated length."""

    seq: TrackedSequence
    windows: list[WindowAdmission]
    prepopulated: int = 0
    path: TokenPath | None = None  # the prompt as the walk encoded it (None: no walk)
    # per-request deltas: reused, missed, alloc_total, alloc_new
    deltas: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0, 0])


# ---------------------------------------------------------------------------- planning
def prompt_path(bm: BlockManager, seq: TrackedSequence, usable: int) -> TokenPath:
    """The prompt's first `usable` tokens encoded once for every window's walk."""
    try:
        return seq.token_path(0, usable, bm.tokens_per_block)
    except (OverflowError, struct.error):  # a token id beyond int32 matches nothing
        raise InvalidRequestError(f"request {seq.request_id!r}: prompt tokens must be ints in [0, 2**31)") from None


def walk(bm: BlockManager, wm: WindowBlockManager, path: TokenPath, usable: int, num_shared: int) -> WindowAdmission:
    """One read-only tree walk matching the prompt's first `usable` tokens in one window."""
    tpb = bm.tokens_per_block
    tree = bm.tree
    n_full = min(usable // tpb, num_shared)
    matched, gaps = wm.match(path, n_full)
    while matched and matched[-1] is None:  # a walk cannot end on a gap
        matched.pop()
        gaps.pop()
    partial = None
    d = len(matched)
    start = d * tpb
    end = min(start + tpb, usable)
    if d < num_shared and end > start and bm.config.partial_reuse:
        after = (ROOT, -1) if not matched else tree.position_of(wm.index, matched[-1])
        assert after is not None  # a matched block is in the tree
        query = path.prefix(d, end - start)
        b, n = tree.best_partial(
            wm.index, after, query, path.signature, path.mm_keys(d), wm.refs.ref, not bm.config.copy_on_partial_reuse
        )
        if b != NO_BLOCK:
            partial = (b, n)
    coverage = len(matched) * tpb + (partial[1] if partial else 0)
    return WindowAdmission(matched, partial, num_shared, 0, gaps, coverage, None)


def _safe(wm: WindowBlockManager, wa: WindowAdmission, length: int) -> bool:
    """Can `length` prepopulated tokens be reused in this window? (`reuse_safe`: a window
    that detaches needs every position its first new queries see to be real.)"""
    return length <= wa.coverage and wm.reuse_safe(wa.gap_ends, length)


def plan_sequence(bm: BlockManager, seq: TrackedSequence) -> AdmissionPlan:
    tpb = bm.tokens_per_block
    plan = AdmissionPlan(seq, [], 0, None, [0, 0, 0, 0])
    windows = bm.windows
    if not bm.reuse:
        plan.windows = [WindowAdmission([], None, *wm.context_blocks(seq, False)) for wm in windows]
        return plan
    usable = seq.prompt_len - 1  # the last prompt token is always recomputed (its logits)
    path = plan.path = prompt_path(bm, seq, usable)
    if len(windows) == 1 and not windows[0].detaches:  # the usual case: every match kept, nothing to reconcile
        shared, per_beam = windows[0].context_blocks(seq, True)
        wa = walk(bm, windows[0], path, usable, shared)
        wa.num_per_beam = per_beam
        plan.windows = [wa]
        plan.prepopulated = wa.coverage
        return plan
    splits = [wm.context_blocks(seq, True) for wm in windows]
    was = [walk(bm, wm, path, usable, shared) for wm, (shared, _) in zip(windows, splits, strict=True)]
    length = min(wa.coverage for wa in was)
    while length > 0 and not all(_safe(wm, wa, length) for wm, wa in zip(windows, was, strict=True)):
        length = (length - 1) // tpb * tpb
    for wm, wa, (_, per_beam) in zip(windows, was, splits, strict=True):
        wa.num_per_beam = per_beam
        if length < wa.coverage or wm.detaches:
            _truncate(bm, wm, wa, length)
    plan.windows = was
    plan.prepopulated = length
    return plan


def _truncate(bm: BlockManager, wm: WindowBlockManager, wa: WindowAdmission, length: int) -> None:
    """Keep the matches inside the first `length` tokens (a straddled full block becomes a
    partial match); a window that detaches leaves positions no query from `length` on reads
    as placeholders."""
    tpb = bm.tokens_per_block
    full, rest = divmod(length, tpb)
    if full < len(wa.matched):
        b = wa.matched[full]
        wa.partial = (b, rest) if rest and b is not None else None
        del wa.matched[full:]
    elif wa.partial is not None and rest < wa.partial[1]:
        wa.partial = (wa.partial[0], rest) if rest else None
    for d in range(min(wm.detach_end(length), len(wa.matched))):
        wa.matched[d] = None
    wa.coverage = length


def window_need(wm: WindowBlockManager, plans: list[AdmissionPlan]) -> WindowNeed:
    """What committing `plans` takes from `wm`'s free primary blocks, phase by phase (see
    `commit_admission`): the one count both admission and the scheduler queries use."""
    idx = wm.index
    ref = wm.refs.ref
    level = wm.columns.level
    fresh = 0
    partial: dict[int, list[int]] = {}
    for i, adm in enumerate(plans):
        wa = adm.windows[idx]
        if wa.partial is not None:
            partial.setdefault(wa.partial[0], []).append(i)
        fresh += wm.fresh_need(wa.num_shared - wa.num_matched_positions + wa.num_per_beam * adm.seq.beam_width)
    # Matched blocks that are free leave the free pool: primary ones are held, secondary
    # ones need an onboard target (referenced blocks are primary, but for host-pinned ones).
    if len(plans) == 1:
        wa = plans[0].windows[idx]
        free_matched = wa.free = [b for b in wm.real_blocks(wa.matched) if not ref[b]]  # unreferenced = queued
    else:
        free_matched = list(dict.fromkeys(b for adm in plans for b in adm.windows[idx].matched if b is not None and not ref[b]))
    held = sum(1 for b in free_matched if level[b] == PRIMARY) if wm.num_secondary else len(free_matched)
    claims = len(free_matched) - held  # onboard targets
    if wm.tier3 is not None:  # host-pinned blocks are referenced and secondary: onboarded too
        pinned = {b for adm in plans for b in adm.windows[idx].matched if b is not None and ref[b] and level[b] == SECONDARY}
        claims += len(pinned)
    released = 0
    in_place: dict[int, int | None] = {}
    if partial:
        full = {b for adm in plans for b in adm.windows[idx].matched} if len(plans) > 1 else ()
        for b, claimers in partial.items():
            ok = b not in full and ref[b] == 0 and wm.is_leaf(b)
            in_place[b] = claimers[-1] if ok else None
            claims += len(claimers) - ok  # copies
            claims += ok and level[b] == SECONDARY  # onboard target
            free_source = b not in full and not ref[b] and level[b] == PRIMARY
            held += free_source
            released += free_source and not ok  # a copy source only: free again once copied
    return WindowNeed(held, claims, released, fresh, in_place)


def check_capacity(bm: BlockManager, plans: list[AdmissionPlan]) -> dict[int, dict[int, int | None]]:
    """Raise `OutOfBlocksError` unless every window can serve the whole batch; returns, per
    window, each partially matched block -> index of the request reusing it in place."""
    in_place_by_window: dict[int, dict[int, int | None]] = {}
    for wm in bm.windows:
        need = window_need(wm, plans)
        free = wm.num_free_primary
        if need.required > free:
            raise OutOfBlocksError(f"window {wm.window}: admission needs {need.required} free primary blocks, {free} available")
        in_place_by_window[wm.index] = need.in_place
    return in_place_by_window


# ---------------------------------------------------------------------------- admitting
def admit(bm: BlockManager, live: LiveSequences, requests: Sequence[Request]) -> list[int]:
    """Admit `requests` as one atomic batch: check each (ids distinct from the live ones and
    from each other), plan every window, check the batch's capacity, and only then commit and
    file the sequences as live. Returns each request's prepopulated length."""
    ids: set = set()
    seqs = []
    config, num_windows, is_cross = bm.config, len(bm.windows), bm.is_cross
    for r in requests:
        seqs.append(validate_request(r, config, num_windows, is_cross, live.seqs, ids, False, live.tok))
        ids.add(r.request_id)
    plans = [plan_sequence(bm, s) for s in seqs]
    for plan in plans:
        check_token_values(plan.seq, plan.prepopulated, plan.path)
    in_place = check_capacity(bm, plans)  # raises before any change
    commit_admission(bm, plans, in_place)
    out = []
    for plan in plans:
        seq = plan.seq
        seq.admit_counts = plan.deltas
        seq.prompt_path = plan.path
        live.add(seq)
        out.append(plan.prepopulated)
    return out


# ---------------------------------------------------------------------------- commit
def commit_admission(bm: BlockManager, plans: list[AdmissionPlan], in_place_by_window: dict) -> None:
    """Per window, in two phases over the whole batch: (A) claim every match, onboard
    secondary ones, copy or claim partial matches; then copy sources nobody claimed go back
    to the free queues, their content read by the copies the plan already holds; (B) allocate
    every fresh block. So a copy source may be recycled by the same batch, and what a batch
    takes is what `window_need` counted."""
    for wm in bm.windows:
        in_place = in_place_by_window[wm.index]
        sources = _hold_matches(wm, plans)
        rows = [_claim_matches(bm, wm, adm, i, in_place) for i, adm in enumerate(plans)]  # phase A
        _release_copy_sources(wm, sources)
        for adm, row in zip(plans, rows, strict=True):  # phase B
            _allocate_fresh(bm, wm, adm, row)
    for adm in plans:
        adm.seq.prepopulated = adm.prepopulated


def _hold_matches(wm: WindowBlockManager, plans: list[AdmissionPlan]) -> list[int]:
    """Claim every full match first (out of the queues and referenced), so no allocation (an
    onboard target, a copy, a fresh block, another request's) can evict a block the batch is
    about to reuse or copy. A partial match's source is only held out of the queues: it may be
    copied and go back; returns those sources."""
    widx = wm.index
    queues, refs = wm.queues, wm.refs
    queue = queues.queue
    sources: list[int] = []
    for adm in plans:
        wa = adm.windows[widx]
        if wa.free is not None and len(plans) == 1:  # found free by `check_capacity` just now
            refs.claim_many(wa.matched, free=wa.free)
        else:
            refs.claim_many(wa.matched)
        if wa.partial is not None and queue[wa.partial[0]] >= 0:
            queues.take(wa.partial[0])
            sources.append(wa.partial[0])
    return sources


def _claim_matches(bm: BlockManager, wm: WindowBlockManager, adm: AdmissionPlan, i: int, in_place: dict) -> list[int]:
    """Phase A for request `i` of the batch: claim its full matches and its partial one (in
    place or as a copy); returns its row so far (placeholders for the gaps of a window that detaches)."""
    tpb = bm.tokens_per_block
    seq = adm.seq
    wa = adm.windows[wm.index]
    sw = seq.windows[wm.index]
    c = wm.counters
    alloc_total, alloc_new = c.alloc_total, c.alloc_new
    matched = wa.matched
    real = wm.real_blocks(matched)  # only a window that detaches leaves gaps (None) in `matched`
    gaps = len(matched) - len(real)
    _onboard_full(wm, real)
    if seq.retention is not None and matched:
        _apply_retention(wm, seq, matched, tpb)
    c.reused_full += len(matched) - gaps
    row = cast("list[int]", matched)  # no gaps: every entry is a block
    if gaps:
        row = [PLACEHOLDER_BLOCK_ID if b is None else b for b in matched]
        sw.num_front_removed = max(d + 1 for d, b in enumerate(matched) if b is None)
    if matched and matched[-1] is not None and wm.block_node[matched[-1]] >= 0:
        # storing resumes after the matched chain
        tree = bm.tree
        n = wm.block_node[matched[-1]]
        wm.set_cursor(sw, StoreCursor(n, tree.pid[n] + tree.block_offset[wm.index][matched[-1]], len(matched)), own=True)
    if wa.partial is not None:
        row = [*row, _claim_partial(wm, seq, wa.partial, len(matched), in_place.get(wa.partial[0]) == i, tpb)]
        c.reused_partial += 1
    deltas = adm.deltas
    deltas[0] += len(matched) - gaps + (wa.partial is not None)
    deltas[2] += c.alloc_total - alloc_total
    deltas[3] += c.alloc_new - alloc_new
    return row


def _onboard_full(wm: WindowBlockManager, blocks: list[int]) -> None:
    """The claimed full matches: their retention durations end, secondary ones are onboarded."""
    wm.queues.clear_durations(blocks)
    if wm.num_secondary > 0:
        level = wm.columns.level
        for b in blocks:
            if level[b]:
                wm.onboard(b)


def _apply_retention(wm: WindowBlockManager, seq: TrackedSequence, matched: list[int | None], tpb: int) -> None:
    """The request's retention on its matched blocks: a cached block keeps its priority unless
    the request states one for its token range."""
    queues = wm.queues
    seq.block_priority(0, tpb)  # builds the per-block retention table
    priority = queues.priority
    table = seq.context_retention
    assert table is not None  # built by the call above
    # `matched` is the first context blocks (never the last one); the table has them
    # all, in runs of equal retention (one per token range)
    lo = 0
    for (prio, dur), run in itertools.groupby(table[: len(matched)]):
        hi = lo + len(list(run))
        blocks = matched[lo:hi]
        lo = hi
        if dur is not None:
            for mb in blocks:
                if mb is not None:
                    queues.set_duration(mb, dur)
        # most matched blocks already have the range's priority: one C-level compare
        if prio is not None and (
            None in blocks or bytes([priority[b] for b in cast("list[int]", blocks)]) != bytes((prio,)) * len(blocks)
        ):
            for mb in blocks:
                if mb is not None and prio != priority[mb]:
                    wm.set_priority(mb, prio)


def _claim_partial(
    wm: WindowBlockManager, seq: TrackedSequence, partial: tuple[int, int], index: int, in_place: bool, tpb: int
) -> int:
    """The block holding the partially matched position `index`: the matched block itself,
    leaving the tree (`in_place`), or a copy of its first tokens; returns it, referenced."""
    b, n_tok = partial
    queues, refs = wm.queues, wm.refs
    prio, dur = seq.block_priority(index, tpb)
    if in_place:
        wm.drop_cached(b, evicted=False)
        if prio is not None:  # else the block keeps its own, as a full match does
            queues.set_priority(b, prio)
        queues.set_duration(b, dur)
        refs.claim(b)  # held out of the queues by `_hold_matches`, as a copy source
        if wm.columns.level[b]:
            wm.onboard(b)
        return b
    if prio is None:  # the copy inherits the source's retention unless the request states one
        prio, dur = queues.priority[b], queues.duration.get(b)
    return wm.copy_prefix(b, n_tok, prio, dur)


def _release_copy_sources(wm: WindowBlockManager, sources: list[int]) -> None:
    """Copy sources nobody claimed are free again (the copies come first)."""
    ref, queue, queues = wm.refs.ref, wm.queues.queue, wm.queues
    for b in sources:
        if ref[b] == 0 and queue[b] < 0:
            queues.release(b)


def _allocate_fresh(bm: BlockManager, wm: WindowBlockManager, adm: AdmissionPlan, row: list[int]) -> None:
    """Phase B for one request: its fresh shared blocks, then one write of its whole row
    (matches, the partial one, fresh blocks), then its per-beam last blocks."""
    tpb = bm.tokens_per_block
    seq = adm.seq
    wa = adm.windows[wm.index]
    sw = seq.windows[wm.index]
    c = wm.counters
    alloc_total, alloc_new = c.alloc_total, c.alloc_new
    first, stop = wa.num_matched_positions, wa.num_shared
    if stop > first:
        retention = None if seq.retention is None else seq.block_priorities(first, stop, tpb)
        fresh = wm.take_fresh(stop - first, retention) if wm.grows_blocks else [PLACEHOLDER_BLOCK_ID] * (stop - first)
        row = [*row, *fresh] if row else fresh
    if row:  # one write of the shared row: matches, the partial one, fresh blocks
        wm.extend_blocks(sw, row)
        if sw.cursor is not None:  # phase A's cursor (on the matched chain): its row exists now
            wm.set_cursor(sw, sw.cursor, own=True)
    wm.admitted(seq, sw, adm.prepopulated)
    deltas = adm.deltas
    if bm.reuse:
        missed = wa.num_shared - wa.num_matched_positions + wa.num_per_beam
        c.missed += missed
        deltas[1] += missed
    if wa.num_per_beam:
        prio, dur = seq.block_priority(wa.num_shared, tpb)
        for beam in range(seq.beam_width):
            b = wm.get_free_block(prio, dur)
            wm.append_block(sw, beam, b)
    deltas[2] += c.alloc_total - alloc_total
    deltas[3] += c.alloc_new - alloc_new
