"""`BlockColumns`: where each block of one window manager lives in memory (the only module
that changes a block's slot or cache level).

A block id never changes; the memory slot it owns can. Offload and onboard swap slots (and
cache levels) between two blocks, so a block id from the secondary range can own primary
memory. Kernels only ever see slots. One int column per field, indexed by block id: no Python
object per block.
"""
from __future__ import annotations

import array

PRIMARY = 0
SECONDARY = 1
PLACEHOLDER_BLOCK_ID = -(2**31) + 1  # TensorRT-LLM's kPlaceholderBlockId


class BlockColumns:
    __slots__ = ("num_primary", "num_secondary", "slot", "level")

    def __init__(self, num_primary: int, num_secondary: int) -> None:
        self.num_primary = num_primary
        self.num_secondary = num_secondary
        # ids 0..P-1 start on primary slots 0..P-1, ids P..P+S-1 on secondary slots 0..S-1
        self.slot = array.array("i", range(num_primary)) + array.array("i", range(num_secondary))
        self.level = bytearray(num_primary) + bytearray([SECONDARY]) * num_secondary

    def swap_memory(self, a: int, b: int) -> None:
        """Exchange the memory slots and cache levels of blocks `a` and `b` (offload / onboard)."""
        slot, level = self.slot, self.level
        slot[a], slot[b] = slot[b], slot[a]
        level[a], level[b] = level[b], level[a]
