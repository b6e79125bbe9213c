"""`RefCounts`: who holds each block of one window manager (the only module that changes a
reference or pin count).

A block's ref count is the number of live sequences holding it plus its pins; a pin is an
extra reference that outlives the sequence (`pin_blocks`). Taking a block out of its free
queue and referencing it are one call here (`claim`, `claim_many`, `claim_victim`,
`claim_victims`, as vLLM's `BlockPool` does), and the last reference going away hands the
block back to the free queues (`release`, `release_run`; `requeue` for a victim claimed and
not used), so "referenced or in exactly one free queue" holds by construction
(`verify_integrity` checks it).
"""
from __future__ import annotations

import array

from kvjax.ledger.free_queues import PRIMARY, FreeQueues


class RefCounts:
    __slots__ = ("ref", "pin", "queues")

    def __init__(self, num_blocks: int, queues: FreeQueues) -> None:
        # a list, not an int array: counts are small ints (shared objects, so 8 bytes a block)
        # and list indexing is what CPython specialises (see `FreeQueues`)
        self.ref = [0] * num_blocks
        self.pin = array.array("i", [0]) * num_blocks  # rarely touched: 4 bytes a block
        self.queues = queues

    def claim(self, b: int) -> None:
        """Reference a cached block a sequence reuses, taking it out of its free queue if it is
        there (its priority and duration kept)."""
        self.queues.take(b)
        self.ref[b] += 1

    def claim_many(self, blocks, free=None) -> None:
        """`claim` each of `blocks` (distinct ids; None entries skipped). `free`: those of them
        the caller found free a moment ago (the rest are in use), so the queues are not asked."""
        if free is None:
            self.queues.take_many(blocks)
        else:
            self.queues.take_many(free, all_free=True)
        ref = self.ref
        for b in blocks:
            if b is not None:
                ref[b] += 1

    def claim_victim(self, level: int) -> tuple[int, bool]:
        """The victim of `level` (`FreeQueues.pop_victim`: raises `OutOfBlocksError` when none
        is free), out of the queues and referenced once, and whether it may be offloaded."""
        b, can_offload = self.queues.pop_victim(level)
        self.ref[b] += 1
        return b, can_offload

    def requeue(self, b: int) -> None:
        """Give back a block claimed a moment ago and not used (an offloaded victim, on
        secondary memory now): unreferenced, at the back of its queue, its pending retention
        expiry kept (`FreeQueues.push`)."""
        self.ref[b] -= 1
        self.queues.push(b)

    def claim_victims(self, count: int) -> list[int]:
        """The next `count` primary victims in eviction order, out of the queues, referenced
        once each (default priority, no duration: `FreeQueues.claim_victims`). Their cached
        content is the caller's to evict."""
        out = self.queues.claim_victims(PRIMARY, count)
        ref = self.ref
        for b in out:
            ref[b] += 1
        return out

    def release(self, b: int, to_front: bool = False) -> None:
        """One holder fewer; the last one queues the block (at the front: `rewind`)."""
        ref = self.ref
        rc = ref[b] - 1
        ref[b] = rc
        if rc == 0:
            self.queues.release(b, to_front)

    def release_run(self, blocks) -> None:
        """Drop one reference of each block, in the order given (queue order of the freed)."""
        ref = self.ref
        freed = []
        for b in blocks:
            rc = ref[b] - 1
            ref[b] = rc
            if rc == 0:
                freed.append(b)
        if freed:
            self.queues.release_many(freed)

    def pin_block(self, b: int) -> None:
        self.ref[b] += 1
        self.pin[b] += 1

    def unpin_block(self, b: int) -> None:
        self.pin[b] -= 1
        self.release(b)
