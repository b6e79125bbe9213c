"""Failed transfers: which plans may still be reported, and what a failure does to the ledger.

Protocol. `take_transfers()` numbers every plan it hands out (`TransferPlan.seq` = 1, 2, ...).
The newest plan stays *open* until the next `take_transfers()`: while open it may be reported
once, either as applied (`transfers_applied`, optional) or as failed, wholly or in part
(`transfers_failed`). Taking the next plan acknowledges it implicitly, unless the manager was
built with `require_transfer_acks=True`, in which case taking a new plan while a non-empty one
is still unreported raises (a skipped plan is caught). Any report about a plan that is not the
open one (older, never issued) or a second report about it raises `TransferSequenceError`.

Failure. The ledger replays the reported plan over memory slots, marking the destination of
every failed op *lost*, and propagating: an op that reads a lost slot writes a lost slot, an op
that succeeds from a good slot repairs its destination. The ops recorded since the plan was
taken (not yet handed out) are replayed after it, all successful, because they may read what the
failed plan should have written. Every block that now owns a lost slot:
  * leaves the radix tree (a `Removed` event) and so is never matched again;
  * cuts back every live sequence holding it: the sequence's materialised length, its
    prepopulated length and its context position drop to the block's first token, and the
    engine recomputes from there (`TransferFailure.recompute_from`);
  * is reported in `lost_pinned_blocks` if it is pinned (pinned content cannot be recomputed).
A sliding-window sequence whose recompute point needs positions its window already released
(placeholders) cannot recompute in place: it is listed in `readmit` (remove it and admit it
again). The report must come before any forward reads the plan's destinations: KV computed
from lost content is not tracked.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING

from kvjax.errors import TransferSequenceError
from kvjax.ledger.block_columns import PRIMARY, SECONDARY
from kvjax.transfer_plan import TransferKind

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences

_OFFLOAD, _ONBOARD = int(TransferKind.OFFLOAD), int(TransferKind.ONBOARD)

OPEN, APPLIED, FAILED = "open", "applied", "failed"


@dataclasses.dataclass(frozen=True)
class TransferFailure:
    """What `transfers_failed` did.

    `recompute_from`: live request -> number of leading tokens whose KV is still valid (its new
    prepopulated length / context position); the engine recomputes the tokens from there.
    `readmit`: requests (also in `recompute_from`) whose sliding window already released
    blocks the recompute needs: remove them and admit them again.
    `dropped_blocks`: cached blocks that left the tree. `lost_pinned_blocks`: window -> ids of
    pinned blocks whose content was lost.
    """

    seq: int
    recompute_from: dict[Hashable, int]
    readmit: frozenset
    dropped_blocks: int
    lost_pinned_blocks: dict[int, tuple[int, ...]]


class TransferLog:
    """Sequence numbers and the status of the newest plan (the only one that can be reported)."""

    __slots__ = ("issued", "status", "num_ops", "require_acks")

    def __init__(self, require_acks: bool) -> None:
        self.issued = 0  # seq of the newest plan handed out (0: none yet)
        self.status = APPLIED  # of plan `issued`
        self.num_ops = 0  # entries of plan `issued`
        self.require_acks = require_acks

    def state(self) -> tuple:
        return (self.issued, self.status, self.num_ops)

    def check_take(self) -> None:
        if self.require_acks and self.status == OPEN and self.num_ops:
            raise TransferSequenceError(
                f"plan {self.issued} ({self.num_ops} ops) was neither reported applied nor failed; "
                "report it before taking the next plan (require_transfer_acks=True)"
            )

    def issue(self, num_ops: int) -> int:
        self.issued += 1
        self.status = OPEN
        self.num_ops = num_ops
        return self.issued

    def check_report(self, seq: int) -> None:
        """Raise unless `seq` is the open plan."""
        if seq < 1 or seq > self.issued:
            raise TransferSequenceError(f"plan {seq} was never issued (the newest plan is {self.issued})")
        if seq < self.issued:
            raise TransferSequenceError(
                f"plan {seq} was acknowledged when plan {seq + 1} was taken; report a failure before taking the next plan"
            )
        if self.status == APPLIED:
            raise TransferSequenceError(f"plan {seq} was already reported applied (or reported twice)")
        if self.status == FAILED:
            raise TransferSequenceError(f"plan {seq} was already reported failed")


def _lost_slots(
    ops: list[tuple[int, int, int, int, int]], failed: set[int], pending: list[tuple[int, int, int, int, int]]
) -> set:
    """(pool, level, slot) whose content is lost after `ops` (with `failed` failing) and then
    the not-yet-taken `pending` ops, replayed in order."""
    lost: set = set()
    for i, (kind, pool, src, dst, _n) in enumerate(ops + pending):
        src_level = SECONDARY if kind == _ONBOARD else PRIMARY
        dst_level = SECONDARY if kind == _OFFLOAD else PRIMARY
        if i in failed or (pool, src_level, src) in lost:
            lost.add((pool, dst_level, dst))
        else:  # a good copy (even of a prefix: the rest is the new owner's to write) repairs it
            lost.discard((pool, dst_level, dst))
    return lost


def apply_failure(bm: BlockManager, live: LiveSequences, seq_no: int, ops: list, failed: set[int]) -> TransferFailure:
    """Drop what the failed ops did not deliver and cut back the sequences that relied on it."""
    tpb = bm.tokens_per_block
    lost = _lost_slots(ops, failed, bm.recorder.pending())
    pools = bm.config.pools
    owners: dict[int, dict] = {}
    bad: dict[int, dict] = {}  # window index -> {block: None} (ordered, deduplicated over pools)
    for pool, level, slot in sorted(lost):
        wm = bm.windows[bm.window_index[pools[pool].window]]
        table = owners.get(wm.index)
        if table is None:
            cols = wm.columns
            table = owners[wm.index] = {(cols.level[b], cols.slot[b]): b for b in range(wm.num_blocks)}
        bad.setdefault(wm.index, {})[table[(level, slot)]] = None
    dropped = 0
    pinned: dict[int, tuple[int, ...]] = {}
    for widx, blocks in bad.items():
        wm = bm.windows[widx]
        for b in blocks:
            if wm.is_cached(b):
                wm.drop_cached(b, evicted=False)
                dropped += 1
        ids = tuple(b for b in blocks if wm.refs.pin[b])
        if ids:
            pinned[wm.window] = ids
    recompute: dict[Hashable, int] = {}
    readmit = set()
    for rid, seq in live.items():
        cut = None
        for widx, blocks in bad.items():
            for beam in seq.windows[widx].blocks:
                for pos, b in enumerate(beam):
                    if b in blocks and (cut is None or pos * tpb < cut):
                        cut = pos * tpb
                        break
        # KV may exist up to the context position during a prefill, else for every token (the
        # newest one's too: after a rewind it was computed as a draft)
        computed = seq.context_position if seq.context_position < seq.prompt_len else seq.num_tokens
        if cut is None or cut >= computed:
            continue  # the lost positions were never computed: the next forward writes them
        _cut_back(bm, live, seq, cut)
        recompute[rid] = cut
        for wm in bm.windows:
            # released blocks (placeholders) the first recomputed query sees would be read as zeros
            if wm.released_visible(seq.windows[wm.index], cut):
                readmit.add(rid)
    return TransferFailure(seq_no, recompute, frozenset(readmit), dropped, pinned)


def _cut_back(bm: BlockManager, live: LiveSequences, seq, cut: int) -> None:
    """KV of `seq` is valid for its first `cut` tokens only."""
    live.cut_back(seq, cut)
    tpb = bm.tokens_per_block
    for wm in bm.windows:
        sw = seq.windows[wm.index]
        if sw.cursor is not None and sw.cursor.full_blocks > cut // tpb:  # must not skip the recomputed blocks
            wm.set_cursor(sw, None, own=False)
