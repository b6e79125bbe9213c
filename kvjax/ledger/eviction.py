"""`LRUEvictionPolicy`: priority-bucketed LRU free queues per cache level.

Each level (primary, secondary) has 101 queues, one per retention priority. Free blocks sit in
exactly one queue; the victim is the front of the lowest non-empty queue (a bitmask finds it in
O(1)). Claim and release are O(1) (`OrderedDict` keyed by the block). Blocks with a retention
duration expire through a min-heap: `refresh()` moves expired free blocks back to priority 35.

The heap deletes lazily (claiming a block only invalidates its entry), so it would gain a stale
entry per release with a duration; it is compacted whenever it outgrows twice the number of
blocks (each block has at most one live entry), which keeps it bounded by the pool size at
O(1) amortised cost per push.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable

from kvjax.config import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from kvjax.errors import OutOfBlocksError
from kvjax.ledger.block import NOT_FREE, PRIMARY, Block

NUM_PRIORITIES = MAX_PRIORITY - MIN_PRIORITY + 1
NUM_LEVELS = 2


class LRUEvictionPolicy:
    __slots__ = ("queues", "nonempty", "num_free", "offload_min_priority", "clock", "_heap", "_counter", "heap_limit")

    def __init__(self, blocks_per_level: list[list[Block]], offload_min_priority: int, clock: Callable[[], float]) -> None:
        self.queues: list[list[OrderedDict[Block, None]]] = [
            [OrderedDict() for _ in range(NUM_PRIORITIES)] for _ in range(NUM_LEVELS)
        ]
        self.nonempty = [0] * NUM_LEVELS
        self.num_free = [0] * NUM_LEVELS
        self.offload_min_priority = offload_min_priority
        self.clock = clock
        self._heap: list[tuple[float, int, int, Block]] = []
        self._counter = itertools.count()
        self.heap_limit = 2 * sum(len(b) for b in blocks_per_level) + 16  # compaction threshold
        for level, blocks in enumerate(blocks_per_level):
            for block in blocks:  # never-used blocks in id order, at the default priority
                block.priority = DEFAULT_PRIORITY
                self._push(block, level, DEFAULT_PRIORITY, False)

    # ------------------------------------------------------------------ queue primitives
    def _push(self, block: Block, level: int, priority: int, to_front: bool) -> None:
        q = self.queues[level][priority]
        q[block] = None
        if to_front:
            q.move_to_end(block, last=False)
        self.nonempty[level] |= 1 << priority
        self.num_free[level] += 1
        block.free_level = level
        block.free_priority = priority

    def _remove(self, block: Block) -> bool:
        level = block.free_level
        if level == NOT_FREE:
            return False
        priority = block.free_priority  # stored values, not current ones
        q = self.queues[level][priority]
        del q[block]
        if not q:
            self.nonempty[level] &= ~(1 << priority)
        self.num_free[level] -= 1
        block.free_level = NOT_FREE
        return True

    # ------------------------------------------------------------------ policy API
    def peek_victim(self, level: int) -> tuple[Block, bool]:
        """Front of the lowest non-empty queue of `level`, and whether it may be offloaded."""
        mask = self.nonempty[level]
        if not mask:
            raise OutOfBlocksError(f"no free block at cache level {level}")
        priority = (mask & -mask).bit_length() - 1
        block = next(iter(self.queues[level][priority]))
        return block, level == PRIMARY and priority >= self.offload_min_priority

    def pop_victim(self, level: int) -> tuple[Block, bool]:
        """Remove and return the victim (front of the lowest non-empty queue) and whether it may
        be offloaded. Its expiry entry stays armed: the caller claims or requeues it."""
        mask = self.nonempty[level]
        if not mask:
            raise OutOfBlocksError(f"no free block at cache level {level}")
        priority = (mask & -mask).bit_length() - 1
        q = self.queues[level][priority]
        block, _ = q.popitem(last=False)
        if not q:
            self.nonempty[level] = mask & ~(1 << priority)
        self.num_free[level] -= 1
        block.free_level = NOT_FREE
        return block, level == PRIMARY and priority >= self.offload_min_priority

    def push(self, block: Block) -> None:
        """Queue a free block at the back of its level and priority, keeping its expiry."""
        self._push(block, block.level, block.priority, False)

    def claim(self, block: Block, priority: int | None = None, duration: float | None = None) -> None:
        """Take `block` out of its free queue (no-op if in use); set priority if given; the
        duration is always overwritten (None clears it), as in TensorRT-LLM."""
        if self._remove(block):
            block.heap_token += 1  # invalidates a pending expiry entry
            block.expiry = None
        if priority is not None:
            block.priority = priority
        block.duration = duration

    def take(self, block: Block) -> None:
        """Take `block` out of its free queue keeping priority and duration (temporary holds)."""
        if self._remove(block):
            block.heap_token += 1
            block.expiry = None

    def release(self, block: Block, to_front: bool = False) -> None:
        """Append a block whose last reference went away to its level's queue for its priority."""
        self._push(block, block.level, block.priority, to_front)
        if block.duration is not None and block.priority != DEFAULT_PRIORITY:
            block.expiry = self.clock() + block.duration
            block.heap_token += 1
            heapq.heappush(self._heap, (block.expiry, next(self._counter), block.heap_token, block))
            if len(self._heap) > self.heap_limit:
                self._compact()

    def _compact(self) -> None:
        """Drop the entries claims and re-releases invalidated (at most one per block stays)."""
        heap = [e for e in self._heap if e[2] == e[3].heap_token and e[3].free_level != NOT_FREE]
        heapq.heapify(heap)
        self._heap = heap

    @property
    def heap_size(self) -> int:
        """Entries in the expiry heap, stale ones included (bounded by `heap_limit`)."""
        return len(self._heap)

    def requeue(self, block: Block) -> None:
        """Move a free block to the queues of its (new) cache level, keeping priority, position
        rules and any pending expiry (used when an offload swaps its memory)."""
        self._remove(block)
        self._push(block, block.level, block.priority, False)

    def release_many(self, blocks: list[Block]) -> None:
        """`release` for a run of blocks (a finished sequence), with the loop kept local."""
        queues, nonempty, num_free = self.queues, self.nonempty, self.num_free
        for block in blocks:
            level = block.level
            priority = block.priority
            queues[level][priority][block] = None
            nonempty[level] |= 1 << priority
            num_free[level] += 1
            block.free_level = level
            block.free_priority = priority
            if block.duration is not None and priority != DEFAULT_PRIORITY:
                block.expiry = self.clock() + block.duration
                block.heap_token += 1
                heapq.heappush(self._heap, (block.expiry, next(self._counter), block.heap_token, block))
        if len(self._heap) > self.heap_limit:
            self._compact()

    def refresh(self) -> int:
        """Move free blocks whose retention expired to the back of the default queue."""
        now = self.clock()
        heap = self._heap
        moved = 0
        while heap and heap[0][0] <= now:
            _, _, token, block = heapq.heappop(heap)
            if token != block.heap_token or block.free_level == NOT_FREE:
                continue
            self._remove(block)
            block.priority = DEFAULT_PRIORITY
            block.expiry = None
            self._push(block, block.level, DEFAULT_PRIORITY, False)
            moved += 1
        return moved

    def free_blocks(self, level: int) -> list[Block]:
        """Free blocks of `level` in eviction order (lowest priority first, LRU first)."""
        return [b for q in self.queues[level] for b in q]

    def pending_expiries(self) -> list[Block]:
        return [b for _, _, token, b in self._heap if token == b.heap_token and b.free_level != NOT_FREE]
