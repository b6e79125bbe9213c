"""`FreeQueues`: the free blocks of one window manager, their retention, and eviction order.

Each cache level (primary, secondary) has 101 queues, one per retention priority. A free block
sits in exactly one queue; the victim is the front of the lowest non-empty queue (a bitmask
finds it in O(1)). The queues are intrusive doubly-linked lists in two int arrays (`prev`,
`next`, indexed by block id, with one sentinel per queue after the blocks), so a free block
costs a few bytes and no Python object. Each block's queue and priority are small ints held in
lists (the shared small-int objects, 8 bytes a block): the hot loops index them per block, and
CPython specialises list indexing (an int array is 2-3x slower to index; each such list adds
about 5 ms per million blocks to a full garbage collection). This module is the only one that
changes queue membership, and the only one that changes a block's priority, duration or expiry.

Blocks with a retention duration expire through a min-heap: `refresh()` moves expired free
blocks to the back of the default queue. The heap deletes lazily (claiming a block only
disarms its entry), and is compacted whenever it outgrows twice the number of blocks (each
block has at most one armed entry), so it stays bounded by the pool at O(1) amortised cost.
"""
from __future__ import annotations

import array
import heapq
import itertools
from collections.abc import Callable

from kvjax.config import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from kvjax.errors import OutOfBlocksError

PRIMARY = 0
SECONDARY = 1
NUM_LEVELS = 2
NUM_PRIORITIES = MAX_PRIORITY - MIN_PRIORITY + 1
NOT_FREE = -1


class FreeQueues:
    """Free queues, retention and the expiry heap of `num_blocks` blocks whose cache level is
    read from `level` (a column owned by `BlockColumns`)."""

    __slots__ = (
        "num_blocks",
        "level",
        "prev",
        "next",
        "queue",
        "nonempty",
        "num_free",
        "priority",
        "duration",
        "expiry",
        "armed",
        "offload_min_priority",
        "clock",
        "_heap",
        "_counter",
        "heap_limit",
    )

    def __init__(self, level: bytearray, num_primary: int, offload_min_priority: int, clock: Callable[[], float]) -> None:
        n = len(level)
        self.num_blocks = n
        self.level = level
        sentinels = NUM_LEVELS * NUM_PRIORITIES
        # queue q = level * NUM_PRIORITIES + priority has its sentinel at n + q
        self.prev = array.array("i", [0]) * (n + sentinels)
        self.next = array.array("i", [0]) * (n + sentinels)
        self.queue = [NOT_FREE] * n  # the queue a free block sits in
        self.nonempty = [0] * NUM_LEVELS
        self.num_free = [0] * NUM_LEVELS
        self.priority = [DEFAULT_PRIORITY] * n
        self.duration: dict[int, float] = {}  # block -> retention duration (absent: none)
        self.expiry: dict[int, float] = {}  # free block -> when its retention ends
        self.armed: dict[int, int] = {}  # free block -> counter of its live heap entry
        self.offload_min_priority = offload_min_priority
        self.clock = clock
        self._heap: list[tuple[float, int, int]] = []  # (expiry, counter, block)
        self._counter = itertools.count()
        self.heap_limit = 2 * n + 16  # compaction threshold
        prev, nxt = self.prev, self.next
        for q in range(sentinels):
            s = n + q
            prev[s] = nxt[s] = s
        # never-used blocks in id order, at the default priority
        for lvl, ids in ((PRIMARY, range(num_primary)), (SECONDARY, range(num_primary, n))):
            if len(ids):
                s = n + lvl * NUM_PRIORITIES + DEFAULT_PRIORITY
                first, last = ids[0], ids[-1]
                prev[first] = s
                nxt[last] = s
                for b in ids[1:]:
                    prev[b] = b - 1
                for b in ids[:-1]:
                    nxt[b] = b + 1
                nxt[s] = first
                prev[s] = last
                for b in ids:
                    self.queue[b] = lvl * NUM_PRIORITIES + DEFAULT_PRIORITY
                self.nonempty[lvl] = 1 << DEFAULT_PRIORITY
                self.num_free[lvl] = len(ids)

    # ------------------------------------------------------------------ queue primitives
    def _push(self, b: int, level: int, priority: int, to_front: bool) -> None:
        q = level * NUM_PRIORITIES + priority
        s = self.num_blocks + q
        prev, nxt = self.prev, self.next
        if to_front:
            f = nxt[s]
            nxt[s] = b
            prev[b] = s
            nxt[b] = f
            prev[f] = b
        else:
            t = prev[s]
            prev[s] = b
            nxt[b] = s
            prev[b] = t
            nxt[t] = b
        self.queue[b] = q
        self.nonempty[level] |= 1 << priority
        self.num_free[level] += 1

    def _unlink(self, b: int) -> bool:
        q = self.queue[b]
        if q < 0:
            return False
        prev, nxt = self.prev, self.next
        p, f = prev[b], nxt[b]
        nxt[p] = f
        prev[f] = p
        level, priority = divmod(q, NUM_PRIORITIES)
        if p == f:  # both are the sentinel: the queue is empty now
            self.nonempty[level] &= ~(1 << priority)
        self.num_free[level] -= 1
        self.queue[b] = NOT_FREE
        return True

    def _disarm(self, b: int) -> None:
        if self.armed:
            self.armed.pop(b, None)
            self.expiry.pop(b, None)

    def _arm(self, b: int, priority: int) -> None:
        d = self.duration.get(b)
        if d is not None and priority != DEFAULT_PRIORITY:
            when = self.clock() + d
            c = next(self._counter)
            self.expiry[b] = when
            self.armed[b] = c
            heapq.heappush(self._heap, (when, c, b))

    # ------------------------------------------------------------------ policy API
    def pop_victim(self, level: int) -> tuple[int, bool]:
        """Remove and return the victim (front of the lowest non-empty queue) and whether it may
        be offloaded. Its expiry stays armed: the caller claims or requeues it."""
        mask = self.nonempty[level]
        if not mask:
            raise OutOfBlocksError(f"no free block at cache level {level}")
        priority = (mask & -mask).bit_length() - 1
        s = self.num_blocks + level * NUM_PRIORITIES + priority
        prev, nxt = self.prev, self.next
        b = nxt[s]
        f = nxt[b]
        nxt[s] = f
        prev[f] = s
        if f == s:
            self.nonempty[level] = mask & ~(1 << priority)
        self.num_free[level] -= 1
        self.queue[b] = NOT_FREE
        return b, level == PRIMARY and priority >= self.offload_min_priority

    def claim_victims(self, level: int, count: int) -> list[int]:
        """`count` successive victims of `level` (what `count` calls of `pop_victim` return,
        in order), each claimed with the default priority and no duration (`set_retention(b,
        DEFAULT_PRIORITY, None)`). The caller has checked that `count` blocks are free."""
        if count > self.num_free[level]:
            raise OutOfBlocksError(f"{count} blocks asked, {self.num_free[level]} free at cache level {level}")
        n = self.num_blocks
        prev, nxt, queue, prio = self.prev, self.next, self.queue, self.priority
        mask = self.nonempty[level]
        out: list[int] = []
        while len(out) < count:
            priority = (mask & -mask).bit_length() - 1
            s = n + level * NUM_PRIORITIES + priority
            b = nxt[s]
            while b != s and len(out) < count:  # the front of this queue, then the next ones
                out.append(b)
                queue[b] = NOT_FREE
                prio[b] = DEFAULT_PRIORITY
                b = nxt[b]
            nxt[s] = b
            prev[b] = s
            if b == s:
                mask &= ~(1 << priority)
        self.nonempty[level] = mask
        self.num_free[level] -= count
        if self.armed or self.duration:
            for b in out:
                self.set_retention(b, DEFAULT_PRIORITY, None)
        return out

    def push(self, b: int) -> None:
        """Queue a free block at the back of its level and priority, keeping its expiry."""
        self._push(b, self.level[b], self.priority[b], False)

    def set_retention(self, b: int, priority: int | None, duration: float | None) -> None:
        """A claimed block's retention: priority if given (None keeps it), the duration always
        (None clears it), and any pending expiry cancelled."""
        if self.armed:
            self.armed.pop(b, None)
            self.expiry.pop(b, None)
        if priority is not None:
            self.priority[b] = priority
        if duration is None:
            if self.duration:
                self.duration.pop(b, None)
        else:
            self.duration[b] = duration

    def set_retention_each(self, blocks, retention) -> None:
        """`set_retention(b, DEFAULT_PRIORITY if p is None else p, d)` for each block and its
        `(p, d)` in `retention` (blocks just claimed or stored, with the loop kept local)."""
        if self.armed:
            armed, expiry = self.armed, self.expiry
            for b in blocks:
                armed.pop(b, None)
                expiry.pop(b, None)
        priority, duration = self.priority, self.duration
        for b, (p, d) in zip(blocks, retention, strict=True):
            priority[b] = DEFAULT_PRIORITY if p is None else p
            if d is None:
                if duration:
                    duration.pop(b, None)
            else:
                duration[b] = d

    def set_default_retention(self, blocks) -> None:
        """`set_retention(b, DEFAULT_PRIORITY, None)` for blocks in use."""
        priority = self.priority
        for b in blocks:
            priority[b] = DEFAULT_PRIORITY
        if self.duration:
            for b in blocks:
                self.duration.pop(b, None)

    def clear_durations(self, blocks) -> None:
        """Blocks in use lose their retention durations."""
        if self.duration:
            for b in blocks:
                self.duration.pop(b, None)

    def set_priority(self, b: int, priority: int) -> None:
        """Re-prioritise a block that is in use (not queued)."""
        self.priority[b] = priority

    def set_duration(self, b: int, duration: float | None) -> None:
        if duration is None:
            if self.duration:
                self.duration.pop(b, None)
        else:
            self.duration[b] = duration

    def claim(self, b: int, priority: int | None = None, duration: float | None = None) -> None:
        """Take `b` out of its free queue (no-op if in use); set priority if given; the
        duration is always overwritten (None clears it), as in TensorRT-LLM."""
        if self._unlink(b):
            self._disarm(b)
        if priority is not None:
            self.priority[b] = priority
        self.set_duration(b, duration)

    def take(self, b: int) -> None:
        """Take `b` out of its free queue keeping priority and duration (temporary holds)."""
        if self._unlink(b):
            self._disarm(b)

    def take_many(self, blocks, all_free: bool = False) -> None:
        """`take` for each of `blocks` (distinct ids; None entries skipped). `all_free`: the
        caller found every one of them free (no None) a moment ago."""
        queue, prev, nxt = self.queue, self.prev, self.next
        if all_free:
            free = blocks
        else:
            if None in blocks:
                blocks = [b for b in blocks if b is not None]
            free = [b for b in blocks if queue[b] >= 0]  # blocks in use are skipped
        if not free:
            return
        nonempty, num_free = self.nonempty, self.num_free
        for b in free:
            q = queue[b]
            p, f = prev[b], nxt[b]
            nxt[p] = f
            prev[f] = p
            if p == f:  # both are the sentinel: the queue is empty now
                level, priority = divmod(q, NUM_PRIORITIES)
                nonempty[level] &= ~(1 << priority)
            num_free[q >= NUM_PRIORITIES] -= 1  # level of queue q
            queue[b] = NOT_FREE
        if self.armed:
            armed, expiry = self.armed, self.expiry
            for b in free:
                armed.pop(b, None)
                expiry.pop(b, None)

    def release(self, b: int, to_front: bool = False) -> None:
        """Append a block whose last reference went away to its level's queue for its priority."""
        priority = self.priority[b]
        self._push(b, self.level[b], priority, to_front)
        if self.duration:
            self._arm(b, priority)
            if len(self._heap) > self.heap_limit:
                self._compact()

    def release_many(self, blocks: list[int]) -> None:
        """`release` for a run of blocks (a finished sequence), with the loop kept local."""
        if self.duration:
            for b in blocks:
                self.release(b)
            return
        n = self.num_blocks
        prev, nxt, queue, level, prio = self.prev, self.next, self.queue, self.level, self.priority
        # consecutive blocks bound for one queue are chained after its tail, then the chain is
        # closed on the queue's sentinel
        cur_q = -1
        tail = count = 0
        for b in blocks:
            q = level[b] * NUM_PRIORITIES + prio[b]
            if q != cur_q:
                if count:
                    self._close_chain(cur_q, tail, count)
                cur_q = q
                tail = prev[n + q]
                count = 0
            nxt[tail] = b
            prev[b] = tail
            queue[b] = q
            tail = b
            count += 1
        if count:
            self._close_chain(cur_q, tail, count)

    def _close_chain(self, q: int, tail: int, count: int) -> None:
        """End queue `q` at `tail`, after `count` blocks were linked in behind its old tail."""
        s = self.num_blocks + q
        self.next[tail] = s
        self.prev[s] = tail
        level, priority = divmod(q, NUM_PRIORITIES)
        self.nonempty[level] |= 1 << priority
        self.num_free[level] += count

    def _compact(self) -> None:
        """Drop the entries claims and re-releases disarmed (at most one per block stays)."""
        armed = self.armed
        heap = [e for e in self._heap if armed.get(e[2]) == e[1]]
        heapq.heapify(heap)
        self._heap = heap

    @property
    def heap_size(self) -> int:
        """Entries in the expiry heap, disarmed ones included (bounded by `heap_limit`)."""
        return len(self._heap)

    def heap_entries(self) -> tuple[tuple[float, int, int], ...]:
        """The expiry heap's (expiry, counter, block) entries, disarmed ones included, as a copy:
        the integrity checks need every armed expiry to still have its entry (else it never fires)."""
        return tuple(self._heap)

    def refresh(self) -> int:
        """Move free blocks whose retention expired to the back of the default queue."""
        heap = self._heap
        if not heap:
            return 0
        now = self.clock()
        armed = self.armed
        moved = 0
        while heap and heap[0][0] <= now:
            _, c, b = heapq.heappop(heap)
            if armed.get(b) != c:
                continue
            del armed[b]
            del self.expiry[b]
            self._unlink(b)
            self.priority[b] = DEFAULT_PRIORITY
            self._push(b, self.level[b], DEFAULT_PRIORITY, False)
            moved += 1
        return moved

    # ------------------------------------------------------------------ inspection
    def queue_ids(self, level: int, priority: int) -> list[int]:
        """Blocks of one queue, front (next victim) first."""
        s = self.num_blocks + level * NUM_PRIORITIES + priority
        nxt = self.next
        out = []
        b = nxt[s]
        while b != s:
            out.append(b)
            b = nxt[b]
        return out

    def free_blocks(self, level: int) -> list[int]:
        """Free blocks of `level` in eviction order (lowest priority first, LRU first)."""
        out: list[int] = []
        mask = self.nonempty[level]
        for priority in range(NUM_PRIORITIES):
            if mask >> priority & 1:
                out.extend(self.queue_ids(level, priority))
        return out

    def pending_expiries(self) -> list[int]:
        """Free blocks whose retention expiry is armed."""
        return sorted(self.armed)
