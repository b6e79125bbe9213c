"""Storing for reuse and pinning, as the facade's calls ask for them: which tokens of a live
sequence have KV to store (`LiveSequences.materialised`), which requests a decode step may
have completed a block for, and the pins that keep a finished request's blocks alive.
The block work itself is the block manager's (`BlockManager.store`, `RefCounts`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from kvjax.errors import InvalidArgumentError
from kvjax.ledger import decode_batch
from kvjax.ledger.validation import check_block_id, check_unpin_ids, window_manager

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences
    from kvjax.ledger.sequence import SequenceWindow, TrackedSequence


def store_context(bm: BlockManager, live: LiveSequences, seq: TrackedSequence) -> None:
    """The materialised full context blocks ("early reuse")."""
    if bm.reuse:  # (never in a cache whose windows do not store: cross)
        bm.store(seq, min(live.materialised(seq), seq.prompt_len), allow_partial=False)


def store_all(bm: BlockManager, live: LiveSequences, seq: TrackedSequence) -> None:
    """Every materialised block, the trailing partial one included (one beam only)."""
    if bm.reuse and seq.beam_width == 1:
        bm.store(seq, live.materialised(seq), allow_partial=True)


def store_new_blocks(bm: BlockManager, live: LiveSequences, ids: list | tuple) -> None:
    """`KVCacheManager.store_new_blocks` of a checked id list (see its docstring)."""
    maybe = decode_batch.store_candidates(bm, live, ids) if bm.reuse else None
    if maybe is not None:  # the ids of the cached `add_tokens` batch: only rows that may store
        seqs = maybe
    else:
        seqs = live.of(ids)
        if not bm.reuse:
            return
        seqs = [s for s in seqs if s.beam_width == 1]
    counts = live.materialised_many(seqs)
    rows = bm.with_unstored_blocks(seqs, counts)
    if rows:
        bm.store_new_full_blocks([seqs[i] for i in rows], [counts[i] for i in rows])


# ---------------------------------------------------------------------------- pins
def _held(sw: SequenceWindow) -> list[int]:
    """The blocks of a sequence's row that hold its data: a recurrent chain's off-chain write
    block holds nothing yet (the next step writes it), so it is neither pinned nor listed."""
    blocks = sw.unique_blocks()
    write = sw.state.off_chain() if sw.state is not None else -1
    return [b for b in blocks if b != write] if write >= 0 else blocks


def own_block_ids(bm: BlockManager, seq: TrackedSequence) -> list[int] | dict[int, list[int]]:
    """The sequence's real blocks (a dict window -> ids with several windows)."""
    ids = {wm.window: _held(seq.windows[wm.index]) for wm in bm.windows}
    return next(iter(ids.values())) if len(ids) == 1 else ids


def pin(bm: BlockManager, seq: TrackedSequence) -> None:
    for wm in bm.windows:
        for b in _held(seq.windows[wm.index]):
            wm.refs.pin_block(b)


def unpin(bm: BlockManager, block_ids: Iterable[int] | Mapping[int, Iterable[int]]) -> None:
    """Drop one pin per listed id (any collection of ids for one window, or a mapping window ->
    ids); every id and count is checked before the first pin is dropped."""
    items = [(window_manager(bm, w), ids) for w, ids in check_unpin_ids(block_ids)]
    checked = []
    for wm, ids in items:
        counts: dict[int, int] = {}
        for i in ids:
            b = check_block_id(i, wm.num_blocks, wm.window, InvalidArgumentError)
            counts[b] = counts.get(b, 0) + 1
        pins = wm.refs.pin
        for b, k in counts.items():
            if pins[b] < k:
                raise InvalidArgumentError(f"block {b} of window {wm.window} is not pinned {k} time(s)")
        checked.append((wm, [int(i) for i in ids]))
    for wm, ids in checked:
        for b in ids:
            wm.refs.unpin_block(b)
