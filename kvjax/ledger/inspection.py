"""Read-only views of the ledger's internals for tests, debugging and monitoring.

`KVCacheManager.block(id, window)` returns a `BlockInfo` (a snapshot of one block);
`KVCacheManager.inspector` answers the questions no scheduling API needs: eviction order, which
blocks are cached and under which token path, their event hashes, the tree's size and the
expiry heap's. Every call takes the manager's lock, so it sees whole operations only.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, NamedTuple

from kvjax.errors import UnknownBlockError
from kvjax.ledger.block_hashing import BlockHasher
from kvjax.ledger.block_key import BlockKey
from kvjax.ledger.events import BlockHash
from kvjax.ledger.validation import check_block_id, window_manager

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.window_manager import WindowBlockManager


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """One block of one window manager, as it was when asked (never updated).

    `slot`/`level`: the memory it owns (level 0 primary, 1 secondary); `ref_count`: live
    sequences holding it plus `pin_count`; `priority`, `duration` and `expiry`: its retention
    (expiry only while free with a duration armed); `key`: the key of the tree position it is
    cached at (None when not cached)."""

    block_id: int
    window: int
    slot: int
    level: int
    ref_count: int
    pin_count: int
    priority: int
    duration: float | None
    expiry: float | None
    is_free: bool
    key: BlockKey | None

    @property
    def is_cached(self) -> bool:
        return self.key is not None

    @property
    def is_primary(self) -> bool:
        return self.level == 0


class TreeSize(NamedTuple):
    """`positions`: cached block slots of token paths (shared by every window); `nodes`: runs of
    positions stored together; `node_ids`: node ids in use or free for reuse (the node table)."""

    positions: int
    nodes: int
    node_ids: int


def block_info(wm: WindowBlockManager, b: int) -> BlockInfo:
    q = wm.queues
    pos = wm.tree.position_of(wm.index, b)
    return BlockInfo(
        block_id=b,
        window=wm.window,
        slot=wm.columns.slot[b],
        level=wm.columns.level[b],
        ref_count=wm.refs.ref[b],
        pin_count=wm.refs.pin[b],
        priority=q.priority[b],
        duration=q.duration.get(b),
        expiry=q.expiry.get(b),
        is_free=q.queue[b] >= 0,
        key=None if pos is None else wm.tree.key_at(*pos),
    )


def known_block(wm: WindowBlockManager, block_id: object) -> int:
    """`block_id` as a block of `wm` (`UnknownBlockError` if it is none)."""
    return check_block_id(block_id, wm.num_blocks, wm.window, UnknownBlockError)


class LedgerInspector:
    """Inspection of one manager's blocks (see the module docstring). Obtain it as
    `manager.inspector` (a new view each time: it holds the ledger only as long as you keep it)."""

    __slots__ = ("_bm", "_lock")

    def __init__(self, bm: BlockManager, lock: threading.RLock) -> None:
        self._bm = bm
        self._lock = lock  # the manager's (kvjax/ledger/concurrency.py)

    def _wm(self, window: int | None) -> WindowBlockManager:
        return window_manager(self._bm, window)

    def free_order(self, window: int | None = None, level: int = 0) -> list[int]:
        """Free blocks of a cache level in eviction order (lowest priority first, LRU first)."""
        with self._lock:
            return self._wm(window).queues.free_blocks(level)

    def free_queue(self, priority: int, window: int | None = None, level: int = 0) -> list[int]:
        """Free blocks of one priority queue, next victim first."""
        with self._lock:
            return self._wm(window).queues.queue_ids(level, priority)

    def cached_block_ids(self, window: int | None = None) -> set[int]:
        """Blocks attached to the radix tree."""
        with self._lock:
            wm = self._wm(window)
            bnode = wm.block_node
            return {b for b in range(wm.num_blocks) if bnode[b] >= 0}

    def cached_path(self, block_id: int, window: int | None = None) -> list[BlockKey] | None:
        """Keys of every tree position from the root down to the block's (None if not cached)."""
        with self._lock:
            wm = self._wm(window)
            pos = wm.tree.position_of(wm.index, known_block(wm, block_id))
            return None if pos is None else wm.tree.path_keys(*pos)

    def block_hash(self, block_id: int, window: int | None = None) -> BlockHash | None:
        """The event hash of a cached block (None if not cached)."""
        with self._lock:
            wm = self._wm(window)
            b = known_block(wm, block_id)
            return wm.block_hash(b) if wm.is_cached(b) else None

    def pending_expiries(self, window: int | None = None) -> list[int]:
        """Free blocks whose retention expiry is armed."""
        with self._lock:
            return self._wm(window).queues.pending_expiries()

    def expiry_heap(self, window: int | None = None) -> tuple[int, int]:
        """(entries in the expiry heap, the size at which it is compacted)."""
        with self._lock:
            q = self._wm(window).queues
            return q.heap_size, q.heap_limit

    def tree_size(self) -> TreeSize:
        """How big the radix tree is (see `TreeSize`)."""
        with self._lock:
            tree = self._bm.tree
            return TreeSize(tree.num_positions, tree.num_nodes, len(tree.content) - 1)

    @property
    def event_hasher(self) -> BlockHasher:
        """The block-hash formula of this manager's events (`CacheConfig.event_hash`)."""
        return self._bm.tree.hasher


# ---------------------------------------------------------------------------- block counts
def free_primary(bm: BlockManager, window: int | None) -> int:
    """Free primary blocks of `window`; with several windows and no `window`, the minimum."""
    if window is None and len(bm.windows) > 1:
        return min(wm.num_free_primary for wm in bm.windows)
    return window_manager(bm, window).num_free_primary


def allocated_primary(bm: BlockManager, window: int | None) -> int:
    """Referenced primary blocks of `window`; with several windows and no `window`, the maximum."""
    if window is None and len(bm.windows) > 1:
        return max(wm.num_primary - wm.num_free_primary for wm in bm.windows)
    wm = window_manager(bm, window)
    return wm.num_primary - wm.num_free_primary


def free_secondary(bm: BlockManager, window: int | None) -> int:
    """Free secondary blocks of `window`; with several windows and no `window`, the minimum."""
    if window is None and len(bm.windows) > 1:
        return min(wm.num_free_secondary for wm in bm.windows)
    return window_manager(bm, window).num_free_secondary
