"""The recurrent-state window's step API (`KVCacheManager.begin_recurrent_step` and its
queries): which state slot a hybrid model's next step reads and which it writes.

A step of a request reads the live state `S(pos)` (the state after its first `pos` tokens)
from one slot and writes `S(end)` to another (copy-forward: a kept snapshot, which other
requests may be reusing, is never written again); with block reuse off both are the same
slot (in place). The ledger counts a begun step done once the KV of every token it covered is
materialised (the next `begin_recurrent_step` settles it), and drops it when a rewind took
tokens it covered. See `RecurrentStatesWindow` and docs/semantics.md, "Recurrent states".
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from kvjax.config import RECURRENT_STATES
from kvjax.errors import DuplicateRequestError, InvalidArgumentError, OutOfBlocksError
from kvjax.validation import check_id_list, check_int

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences
    from kvjax.ledger.sequence import TrackedSequence
    from kvjax.ledger.window_kinds import RecurrentStatesWindow


class RecurrentStep(NamedTuple):
    """One step's state slots, a row per request (in the order asked): the device reads row
    i's state from `read_slots[i]` of the recurrent pool (the null slot, and
    `has_initial_state[i]` False: start from the zero state) and writes the state after its
    tokens `[starts[i], ends[i])` to `write_slots[i]`."""

    read_slots: np.ndarray  # int32 [n]
    write_slots: np.ndarray  # int32 [n]
    has_initial_state: np.ndarray  # bool [n]
    starts: np.ndarray  # int64 [n]
    ends: np.ndarray  # int64 [n]


def recurrent_window(bm: BlockManager) -> RecurrentStatesWindow:
    """The cache's recurrent-state window (`InvalidArgumentError` when it has none)."""
    index = bm.window_index.get(RECURRENT_STATES)
    if index is None:
        raise InvalidArgumentError("this cache has no RECURRENT_STATES (-1) window")
    return cast("RecurrentStatesWindow", bm.windows[index])


def state_position(bm: BlockManager, seq: TrackedSequence) -> int:
    """The token count of the state the request's next step reads (its step starts there)."""
    wm = recurrent_window(bm)
    cur = seq.windows[wm.index].state
    assert cur is not None  # set at admission
    return cur.end if cur.end and wm.committing(seq, cur) else cur.pos


def next_chunk_end(bm: BlockManager, seq: TrackedSequence) -> int:
    """Where the request's next step should end (`RecurrentStatesWindow.next_chunk_end`)."""
    return recurrent_window(bm).next_chunk_end(seq)


def begin_steps(
    bm: BlockManager, live: LiveSequences, request_ids: Sequence[Hashable], ends: Sequence[int] | None
) -> RecurrentStep:
    """Begin one step of each request (`ends[i]`: the token count its state will cover; None:
    each request's `next_chunk_end`). Every id, end and the free blocks are checked first:
    a failure changes nothing."""
    wm = recurrent_window(bm)
    ids = check_id_list("request_ids", request_ids)
    seqs = live.of(ids)
    if len(set(ids)) != len(ids):
        raise DuplicateRequestError("request_ids must be distinct")
    if ends is None:
        stops = [wm.next_chunk_end(s) for s in seqs]
    else:
        given = check_id_list("ends", ends)
        if len(given) != len(seqs):
            raise InvalidArgumentError(f"ends has {len(given)} entries for {len(seqs)} requests")
        stops = [check_int("end", e, 1, None) for e in given]
    need = sum(wm.check_step(s, e) for s, e in zip(seqs, stops, strict=True))
    if need > wm.num_free_primary:
        raise OutOfBlocksError(f"window {wm.window}: the step needs {need} free state blocks, {wm.num_free_primary} free")
    n = len(seqs)
    out = RecurrentStep(
        np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, bool), np.empty(n, np.int64), np.array(stops, np.int64)
    )
    for i, (s, e) in enumerate(zip(seqs, stops, strict=True)):
        out.starts[i] = state_position(bm, s)
        out.read_slots[i], out.write_slots[i], out.has_initial_state[i] = wm.begin_step(s, e)
    return out
