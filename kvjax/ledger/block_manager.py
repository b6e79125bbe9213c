"""`BlockManager`: the window managers, the shared radix tree, events and the transfer recorder,
and the multi-window operations that span them: token growth, the detach of blocks no query
sees any more, storing and release. Each window is a manager of its attention kind
(`kvjax.ledger.window_kinds`). Admission lives in `kvjax.ledger.admission`.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvjax.config import CacheConfig
from kvjax.errors import OutOfBlocksError
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID
from kvjax.ledger.block_hashing import BlockHasher
from kvjax.ledger.events import KVCacheEventManager
from kvjax.ledger.free_queues import PRIMARY
from kvjax.ledger.radix_tree import RadixTree
from kvjax.ledger.sequence import TrackedSequence
from kvjax.ledger.transfer_recorder import TransferRecorder
from kvjax.ledger.window_kinds import window_manager_for


class BlockManager:
    def __init__(self, config: CacheConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        blocks = [config.primary_blocks_for(w) + config.secondary_blocks_for(w) for w in config.windows]
        self.tree = RadixTree(config.tokens_per_block, blocks, BlockHasher(config.event_hash))
        self.recorder = TransferRecorder()
        self.events = KVCacheEventManager(config.event_buffer_max_size) if config.event_buffer_max_size > 0 else None
        self.windows = [
            window_manager_for(i, w, config, self.tree, self.recorder, self.events, clock) for i, w in enumerate(config.windows)
        ]
        self.window_index = {wm.window: wm.index for wm in self.windows}
        # the windows that release front blocks as a sequence grows (empty: none ever does)
        self.detaching = [wm for wm in self.windows if wm.detaches]
        # sequences grow token by token (all windows agree: the kind follows the cache type)
        self.grows = all(wm.grows for wm in self.windows)
        # a request's length is its encoder's (what a request must state: validation's question)
        self.is_cross = config.cache_type == "cross"
        # TensorRT-LLM disables reuse when sink tokens leave a bubble before generation starts.
        self.reuse = config.enable_block_reuse and all(wm.stores for wm in self.windows) and config.sink_bubble_length == 0

    # ------------------------------------------------------------------ growth
    def fast_limit(self, seq: TrackedSequence) -> int:
        """The token count below which `add_token` only stores its token: the count from which
        the next token starts a block (or passes `max_seq_len`), or slides a block out of a
        window; 0 (always the slow path) for beams, caches that do not grow (cross) and extra
        ids, whose tokens take checks only the slow path makes."""
        if not self.grows or seq.beam_width != 1 or seq.extra_ids is not None:
            return 0
        tpb = self.tokens_per_block
        limit = min(len(seq.windows[0].blocks[0]) * tpb, self.config.max_seq_len)
        for wm in self.detaching:  # the count at which the next front block may leave the window
            detach = wm.detach_limit(seq.windows[wm.index], seq.num_draft_tokens)
            if detach is not None:
                limit = min(limit, detach)
        return max(limit, 0)

    def grown_limits(self, counts: np.ndarray) -> np.ndarray:
        """`fast_limit` of one-beam sequences in a ledger of one full-attention window whose
        token `counts[i]` just started a block (a batched step grows them together): they hold
        `counts // tpb + 1` blocks now."""
        tpb = self.tokens_per_block
        return np.minimum((counts // tpb + 1) * tpb, self.config.max_seq_len)

    def grow(self, seq: TrackedSequence, index: int) -> None:
        """Allocate block `index`, which the sequence's next token starts (one per beam when
        beams diverge). Capacity is checked in every window before anything is allocated."""
        per_token = seq.beam_width
        windows = self.windows
        if per_token == 1 and len(windows) == 1:  # the usual case, with the loops unrolled
            wm = windows[0]
            if not wm.queues.num_free[PRIMARY]:
                raise OutOfBlocksError(f"window {wm.window}: no free block for request {seq.request_id!r}")
            prio, dur = (None, None) if seq.retention is None else seq.block_priority(index, self.tokens_per_block)
            b = wm.get_free_block(prio, dur)
            wm.append_block(seq.windows[0], 0, b)
            wm.counters.gen_alloc += 1
            return
        for wm in windows:
            if wm.grows_blocks and wm.num_free_primary < per_token:
                raise OutOfBlocksError(f"window {wm.window}: no free block for request {seq.request_id!r}")
        prio, dur = seq.block_priority(index, self.tokens_per_block)
        for wm in windows:
            sw = seq.windows[wm.index]
            if not wm.grows_blocks:  # a placeholder (a recurrent-state chain)
                wm.extend_blocks(sw, [PLACEHOLDER_BLOCK_ID], None)
                continue
            for beam in range(per_token):
                b = wm.get_free_block(prio, dur)
                wm.append_block(sw, beam, b)
            wm.counters.gen_alloc += per_token

    @staticmethod
    def oldest_query(seq: TrackedSequence, num_tokens: int | None = None) -> int:
        """The oldest position the next forward may compute (so may query): the context
        position during a chunked prefill, else the newest token less the request's draft
        tokens (unverified drafts are computed by the next verify forward too). `num_tokens`:
        the sequence's token count to assume (a batched step plans before it appends)."""
        if seq.context_position < seq.prompt_len:
            return seq.context_position
        return (seq.num_tokens if num_tokens is None else num_tokens) - 1 - seq.num_draft_tokens

    def released_blocks_visible(self, seq: TrackedSequence, query: int) -> list[int]:
        """Windows in which a query at `query` would see a block already released."""
        return [wm.window for wm in self.detaching if wm.released_visible(seq.windows[wm.index], query)]

    def detach_out_of_window(self, seq: TrackedSequence) -> None:
        """Release front blocks that no query of the next forward (the oldest one being
        `oldest_query`) and no later one can see, in the windows that detach."""
        oldest = self.oldest_query(seq)
        for wm in self.detaching:
            wm.detach_invisible(seq.windows[wm.index], oldest)

    # ------------------------------------------------------------------ storing
    def store(self, seq: TrackedSequence, num_tokens: int, allow_partial: bool) -> int:
        """Store the blocks covering `num_tokens` tokens in every window (largest window first).
        Returns the number of blocks newly stored."""
        if num_tokens <= 0:
            return 0
        windows = self.windows
        if len(windows) == 1:
            return windows[0].store(seq, seq.windows[0], num_tokens, allow_partial)
        return sum(wm.store(seq, seq.windows[wm.index], num_tokens, allow_partial) for wm in reversed(self.windows))

    def store_new_full_blocks(self, seqs: list[TrackedSequence], counts: list[int]) -> None:
        """`store(seqs[i], counts[i], allow_partial=False)` of each, in order (a decode step's
        stores: `WindowBlockManager.store_new_full_blocks`)."""
        if len(self.windows) == 1:
            self.windows[0].store_new_full_blocks(seqs, counts)
        else:
            for seq, n in zip(seqs, counts, strict=True):
                self.store(seq, n, allow_partial=False)

    def with_unstored_blocks(self, seqs: list[TrackedSequence], counts: list[int]) -> list[int]:
        """Indices of the sequences for which `has_unstored_block(seqs[i], counts[i])` holds. A
        decode step's usual row (its newest full block is where its cursor says it was stored)
        is settled by one comparison here; any other goes to `has_unstored_block`."""
        tpb = self.tokens_per_block
        holds = self.tree.holds
        single = len(self.windows) == 1
        has_unstored = self.has_unstored_block
        out = []
        for i, (seq, n) in enumerate(zip(seqs, counts, strict=True)):
            if single:
                cur = seq.windows[0].cursor
                if cur is not None and n // tpb <= cur.full_blocks and holds(cur.node, cur.pid):
                    continue
            if has_unstored(seq, n):
                out.append(i)
        return out

    def has_unstored_block(self, seq: TrackedSequence, num_tokens: int) -> bool:
        """Has a full block within `num_tokens` completed since the last store?"""
        n_full = num_tokens // self.tokens_per_block
        if n_full <= 0:
            return False
        holds = self.tree.holds
        for wm in self.windows:
            sw = seq.windows[wm.index]
            cur = sw.cursor
            if cur is None or n_full > cur.full_blocks:
                return True
            if holds(cur.node, cur.pid):  # still where it was stored (most calls)
                continue
            if wm.cursor_position(seq, sw) is None:  # moved by a split, or pruned since
                return True
        return False

    def release(self, seq: TrackedSequence) -> None:
        for wm in self.windows:
            wm.release_sequence(seq.windows[wm.index])
