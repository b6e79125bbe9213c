"""Rewinding a sequence: dropping its last generated tokens (rejected draft tokens).

Blocks left empty are released to the front of their queue. The block that keeps the new last
token but loses later positions is copied first if anyone else holds it (a pin, another
sequence), so pinned and shared KV never changes; else, if cached under a key longer than what
it keeps, it leaves the tree. Every check runs before the first edit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.errors import InvalidRequestError, OutOfBlocksError

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.sequence import TrackedSequence


def check_rewind(bm: BlockManager, seq: TrackedSequence, n: int) -> None:
    """Raise unless `seq` can drop its last `n` tokens now."""
    if seq.beam_width != 1:
        raise InvalidRequestError("rewind needs beam_width 1")
    if n > seq.num_tokens - seq.prompt_len:
        raise InvalidRequestError(
            f"cannot rewind {n} tokens: request {seq.request_id!r} has {seq.num_tokens - seq.prompt_len} generated tokens"
        )
    if n == 0:
        return
    new_n = seq.num_tokens - n
    for wm in bm.windows:
        wm.check_rewind(seq, new_n)
    query = seq.context_position if seq.context_position < seq.prompt_len else new_n - 1
    released = bm.released_blocks_visible(seq, query)
    if released:
        raise InvalidRequestError(
            f"cannot rewind {n} tokens of request {seq.request_id!r}: the next query (position {query}) would see "
            f"blocks window(s) {released} already released (rewinds up to num_draft_tokens="
            f"{seq.num_draft_tokens} are always kept)"
        )


def rewind(bm: BlockManager, seq: TrackedSequence, n: int) -> None:
    """Drop the last `n` tokens of `seq` (checked by `check_rewind`; raises `OutOfBlocksError`
    with nothing changed when a shared block needs a copy and no block is free)."""
    tpb = bm.tokens_per_block
    new_n = seq.num_tokens - n
    last = (new_n - 1) // tpb
    filled = new_n - last * tpb
    rewrites = filled < tpb  # block `last` loses positions that later tokens will rewrite
    cow = []
    chains = [wm for wm in bm.windows if not wm.grows_blocks]  # recurrent-state chains
    for wm in bm.windows:
        if wm in chains:  # a state block holds no token positions: nothing to copy
            continue
        b = seq.windows[wm.index].blocks[0][last]
        if rewrites and wm.refs.ref[b] > 1:
            cow.append(wm)
    for wm in cow:  # blocks the rewind itself frees may receive the copy
        ref = wm.refs.ref
        freed = sum(1 for b in seq.windows[wm.index].blocks[0][last + 1 :] if ref[b] == 1)
        if wm.num_free_primary + freed < 1:
            raise OutOfBlocksError(f"window {wm.window}: rewind needs a free block to copy a shared block")
    tree = bm.tree
    for wm in bm.windows:
        sw = seq.windows[wm.index]
        if wm in chains:
            wm.rewind_to(seq, sw, new_n)  # type: ignore[attr-defined]
            continue
        beam = sw.blocks[0]
        while len(beam) > last + 1:
            wm.release_block(sw.pop_block(0), to_front=True)
        wm.slot_table.truncate(sw, 0, last + 1)
        b = beam[last]
        if wm in cow:
            fresh = wm.copy_prefix(b, filled, None, None)
            wm.release_block(b)
            sw.set_block(0, last, fresh)
            wm.slot_table.set(sw, 0, last, wm.columns.slot[fresh])
        else:
            pos = tree.position_of(wm.index, b)
            if pos is not None and tree.position_tokens(*pos) > filled:
                wm.drop_cached(b, evicted=False)
        if sw.cursor is not None and sw.cursor.full_blocks > last:
            wm.set_cursor(sw, None, own=False)
    seq.truncate(new_n)
    if seq.extra_ids is not None:
        del seq.extra_ids[new_n:]
    seq.context_position = min(seq.context_position, new_n)
