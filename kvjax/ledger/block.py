"""`Block`: the metadata handle of one KV block (never the bytes).

A block's id never changes; the memory slot it owns can. Offload and onboard swap slots (and
cache levels) between two block objects, so a block id from the secondary range can own
primary memory. Kernels only ever see slots.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.config import DEFAULT_PRIORITY

if TYPE_CHECKING:
    from kvjax.ledger.block_key import BlockKey
    from kvjax.ledger.radix_tree import RadixNode

PRIMARY = 0
SECONDARY = 1
ROOT_BLOCK_ID = -1
PLACEHOLDER_BLOCK_ID = -(2**31) + 1  # TensorRT-LLM's kPlaceholderBlockId
NOT_FREE = -1


class Block:
    """One block of one window manager.

    ref_count counts live users (each sequence once, plus pins); a block with ref_count 0 sits
    in exactly one free queue of its cache level (`free_level`/`free_priority` remember which).
    A block is *cached* while attached to a radix-tree node (`node`), which carries its key.
    """

    __slots__ = (
        "block_id",
        "window",
        "slot",
        "level",
        "ref_count",
        "pin_count",
        "sched_ref_count",
        "sched_epoch",
        "node",
        "priority",
        "duration",
        "expiry",
        "heap_token",
        "free_level",
        "free_priority",
        "placeholder",
    )

    def __init__(self, block_id: int, window: int, slot: int, level: int, placeholder: bool = False) -> None:
        self.block_id = block_id
        self.window = window
        self.slot = slot
        self.level = level
        self.ref_count = 0
        self.pin_count = 0
        self.sched_ref_count = 0
        self.sched_epoch = -1
        self.node: RadixNode | None = None
        self.priority = DEFAULT_PRIORITY
        self.duration: float | None = None
        self.expiry: float | None = None
        self.heap_token = 0
        self.free_level = NOT_FREE
        self.free_priority = 0
        self.placeholder = placeholder

    # ------------------------------------------------------------------ derived views
    @property
    def key(self) -> BlockKey | None:
        """Key of the tree node this block is attached to (None when not cached)."""
        return self.node.key if self.node is not None else None

    @property
    def prev_in_seq(self) -> Block | None:
        """The block before this one in its cached sequence (its tree parent's block)."""
        node = self.node
        if node is None or node.parent is None:
            return None
        return node.parent.blocks.get(self.window)

    @property
    def is_cached(self) -> bool:
        return self.node is not None

    @property
    def is_full(self) -> bool:
        node = self.node
        return node is not None and node.is_full

    @property
    def has_refs(self) -> bool:
        return self.ref_count > 0

    @property
    def is_primary(self) -> bool:
        return self.level == PRIMARY

    @property
    def is_free(self) -> bool:
        return self.free_level != NOT_FREE

    def swap_memory(self, other: Block) -> None:
        """Exchange memory slots and cache levels (offload / onboard)."""
        self.slot, other.slot = other.slot, self.slot
        self.level, other.level = other.level, self.level

    def __repr__(self) -> str:
        if self.placeholder:
            return f"Block(placeholder, window={self.window})"
        lvl = "P" if self.level == PRIMARY else "S"
        return (
            f"Block(id={self.block_id}, slot={lvl}{self.slot}, refs={self.ref_count}, prio={self.priority}, "
            f"cached={self.node is not None})"
        )
