"""Resetting the prefix cache: forget every cached block that no live request references.

Needed when the KV a cached block holds is no longer valid (new model weights, e.g. between
RL steps). A block that a live sequence references keeps its tree node: its owner still reads
it, and it becomes an ordinary cached block when released (callers that need a clean cache
reset only while no request runs). Each dropped block leaves the tree with a Removed event,
keeps its memory, and moves to the front of the lowest-priority free queue of its cache level,
so empty blocks are allocated before any block still cached is evicted.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.config import MIN_PRIORITY

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager


def reset_prefix_cache(bm: BlockManager) -> int:
    """Drop every unreferenced cached block of every window (primary and secondary memory).
    Returns the number of blocks dropped."""
    dropped = 0
    for wm in bm.windows:
        queues, ref, bnode = wm.queues, wm.refs.ref, wm.block_node
        for b in range(wm.num_blocks):
            if bnode[b] < 0 or ref[b] > 0:
                continue
            wm.drop_cached(b, evicted=False)
            queues.claim(b, MIN_PRIORITY, None)  # out of its queue, retention cleared
            queues.release(b, to_front=True)
            dropped += 1
    return dropped
