"""`Sequence`: the ledger's record of one live request (TensorRT-LLM's `GenerationRequest`).

Holds the tokens (beam 0: what keys are built from), and per window the block list of every
beam plus a mirror of their primary slots. A referenced block never changes slot (only free
blocks are offloaded, onboards happen before a block joins a sequence), so the slot rows are
maintained incrementally and block tables are copied out without touching block objects.
"""
from __future__ import annotations

import array
from collections.abc import Hashable
from typing import TYPE_CHECKING

from kvjax.ledger.block_key import BlockKey, MmKey, cache_salt_id
from kvjax.request import Request

if TYPE_CHECKING:
    from kvjax.ledger.block import Block
    from kvjax.ledger.radix_tree import RadixNode

_new_key = tuple.__new__  # BlockKey(...) without NamedTuple's Python-level __new__


class SequenceWindow:
    """One sequence's blocks in one window manager."""

    __slots__ = ("beams", "slots", "num_front_removed", "store_node", "store_depth")

    def __init__(self, beam_width: int) -> None:
        self.beams: list[list[Block]] = [[] for _ in range(beam_width)]
        self.slots: list[array.array] = [array.array("i") for _ in range(beam_width)]
        self.num_front_removed = 0  # leading placeholders (sliding-window detach)
        self.store_node: RadixNode | None = None  # tree node of the last full block known stored
        self.store_depth = 0

    def unique_blocks(self) -> list[Block]:
        """Real blocks this sequence references, in allocation order (shared blocks once)."""
        out: list[Block] = []
        beams = self.beams
        for pos in range(len(beams[0])):
            first = None
            for beam in beams:
                blk = beam[pos]
                if blk.placeholder or blk is first:
                    continue
                if first is None:
                    first = blk
                out.append(blk)
        return out


class Sequence:
    __slots__ = (
        "request_id",
        "request",
        "prompt_len",
        "num_tokens",
        "tokens",
        "extra_ids",
        "beam_width",
        "lora_task_id",
        "salt_id",
        "mm_items",
        "retention",
        "max_new_tokens",
        "num_draft_tokens",
        "context_position",
        "context_retention",
        "prepopulated",
        "is_cross",
        "windows",
        "stats",
        "slow_at",
    )

    def __init__(self, request: Request, num_windows: int, is_cross: bool, tokens: list[int] | None = None) -> None:
        self.request_id: Hashable = request.request_id
        self.request = request
        self.is_cross = is_cross
        self.tokens: list[int] = list(request.prompt if tokens is None else tokens)
        self.extra_ids: list[int] | None = None if request.extra_ids is None else list(request.extra_ids)
        self.prompt_len = request.encoder_len if is_cross else len(self.tokens)
        self.num_tokens = self.prompt_len
        self.beam_width = request.beam_width
        self.lora_task_id = request.lora_task_id
        self.salt_id = cache_salt_id(request.cache_salt)
        self.mm_items = request.mm_items
        self.retention = request.retention
        self.max_new_tokens = request.max_new_tokens
        self.num_draft_tokens = request.num_draft_tokens
        self.context_position = self.prompt_len
        self.prepopulated = 0
        self.windows = [SequenceWindow(self.beam_width) for _ in range(num_windows)]
        self.stats = None
        self.context_retention: list | None = None
        # `add_token` takes its fast path (append only) while the new token count stays below
        # this; 0 forces the slow path (beams, cross caches, extra ids). Set by the manager.
        self.slow_at = 0

    # ------------------------------------------------------------------ keys
    def key(self, start: int, end: int) -> BlockKey:
        """Key of tokens [start, end) (one block or a prefix of one)."""
        extra = self.extra_ids
        mm: tuple[MmKey, ...] = ()
        if self.mm_items:
            mm = tuple(
                MmKey(it.hash, max(start, it.start) - it.start)
                for it in self.mm_items
                if it.start < end and start < it.start + it.length
            )
        return _new_key(
            BlockKey,
            (
                tuple(self.tokens[start:end]),
                None if extra is None else tuple(extra[start:end]),
                self.lora_task_id,
                self.salt_id,
                mm,
            ),
        )

    def block_priority(self, block_index: int, tokens_per_block: int) -> tuple[int | None, float | None]:
        """Retention (priority, duration) of block `block_index`: its range's for context blocks,
        the decode retention for blocks starting at or after the prompt end."""
        r = self.retention
        if r is None:
            return None, None
        if block_index * tokens_per_block >= self.prompt_len:
            return r.decode_priority, r.decode_duration_s
        table = self.context_retention
        if table is None:
            table = self.context_retention = self._retention_table(tokens_per_block)
        return table[block_index]

    def _retention_table(self, tpb: int) -> list[tuple[int | None, float | None]]:
        """Per context block (priority, duration): the range holding the block's first token."""
        n = -(-self.prompt_len // tpb)
        table: list[tuple[int | None, float | None]] = [(None, None)] * n
        for r in self.retention.ranges:
            lo = -(-r.start // tpb)
            hi = n if r.end is None else min(n, -(-r.end // tpb))
            if hi > lo:
                table[lo:hi] = [(r.priority, r.duration_s)] * (hi - lo)
        return table
