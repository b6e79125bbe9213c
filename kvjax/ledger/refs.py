"""`RefCounts`: who holds each block of one window manager (the only module that changes a
reference or pin count).

A block's ref count is the number of live sequences holding it plus its pins; a pin is an
extra reference that outlives the sequence (`pin_blocks`). The last reference going away
hands the block to the free queues, so "referenced or in exactly one free queue" holds by
construction (`verify_integrity` checks it).
"""
from __future__ import annotations

import array

from kvjax.ledger.free_queues import FreeQueues


class RefCounts:
    __slots__ = ("ref", "pin", "queues")

    def __init__(self, num_blocks: int, queues: FreeQueues) -> None:
        # a list, not an int array: counts are small ints (shared objects, so 8 bytes a block)
        # and list indexing is what CPython specialises (see `FreeQueues`)
        self.ref = [0] * num_blocks
        self.pin = array.array("i", [0]) * num_blocks  # rarely touched: 4 bytes a block
        self.queues = queues

    def acquire(self, b: int) -> None:
        """One more holder of a block already out of the free queues (claimed or held)."""
        self.ref[b] += 1

    def acquire_all(self, blocks) -> None:
        ref = self.ref
        for b in blocks:
            ref[b] += 1

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
