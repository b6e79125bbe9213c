"""The kinds of a window: `FullAttentionWindow`, `SlidingWindow`, `CrossAttentionWindow`,
`RecurrentStatesWindow`.

Each is a `WindowBlockManager` (the shared per-window machinery) stating the rules in which
its kind differs, as vLLM's `FullAttentionManager` / `SlidingWindowManager` and TensorRT-LLM's
per-window managers do; the rest of the ledger asks the window and never tests its kind. The
visibility rule `query - window + 1` lives here only (`SlidingWindow.first_visible`, and its
inverse in `SlidingWindow.detach_limit`): `tests/ledger/test_window_kinds.py` fails if
arithmetic on a window's size appears in another ledger module. (The device code keeps its
own copy, `kvjax.device.attention.visibility_mask`.)

A new kind derives from `WindowBlockManager` and states:
  - `first_visible(query)`: the first key position a query sees (what may be detached, when a
    released block would be read, which matched positions admission may leave missing);
  - `detaches` (releases front blocks as a sequence grows: the block manager then detaches in
    it, rows hold placeholders, no store hints) and `detach_limit` (the token count up to
    which a sequence's next token detaches nothing: `add_token`'s fast path);
  - `grows` (tokens are added one by one) and `stores` (blocks are stored for reuse);
  - `match`, `real_blocks`, `reuse_safe`: how a prefix match ends and which matched prefix
    admission may reuse;
  - `context_blocks` (admission's split of the prompt between shared and per-beam blocks);
  - `remaining_blocks`, and where the kind differs `draft_blocks`, `step_blocks`,
    `step_blocks_many`, `remaining_blocks_many`: the scheduler's block counts;
  - where it differs, `grows_blocks`, `fresh_need` and `admitted` (what growth and
    admission allocate: `RecurrentStatesWindow` allocates state blocks as steps begin);
then `window_manager_for` picks it for its windows (and `CacheConfig` admits such a window).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, cast

import numpy as np

from kvjax._math import ceil_div
from kvjax.config import RECURRENT_STATES, CacheConfig
from kvjax.errors import IntegrityError, InvalidRequestError
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID
from kvjax.ledger.packing import int_array
from kvjax.ledger.sequence import RecurrentCursor
from kvjax.ledger.window_manager import WindowBlockManager

if TYPE_CHECKING:
    from kvjax.ledger.events import KVCacheEventManager
    from kvjax.ledger.radix_tree import RadixTree
    from kvjax.ledger.sequence import SequenceWindow, TrackedSequence
    from kvjax.ledger.token_path import TokenPath
    from kvjax.ledger.transfer_recorder import TransferRecorder
    from kvjax.request import Request


class FullAttentionWindow(WindowBlockManager):
    """Every query sees every key before it: nothing is ever detached, a prefix match ends at
    the first missing block and all of it may be reused."""

    def first_visible(self, query: int) -> int:
        return 0

    def match(self, path: TokenPath, n_full: int) -> tuple[list, list[int]]:
        return self.tree.match(self.index, path, n_full, False)

    def reuse_safe(self, gap_ends: list[int], length: int) -> bool:
        return True

    def real_blocks(self, matched: list[int | None]) -> list[int]:
        return cast("list[int]", matched)  # a walk that stops at the first missing block has no gaps

    def remaining_blocks(
        self, request: Request, seq: TrackedSequence | None, reuse: bool, reusable: Callable[[], int]
    ) -> int:
        """TensorRT-LLM's formula: context blocks (within the window and its temporary
        window) not yet allocated or reusable, plus the generation blocks per beam."""
        tpb, bubble = self.tokens_per_block, self.sink_bubble_length
        beam = request.beam_width
        prompt_len = len(request.prompt)
        final = prompt_len + request.max_new_tokens
        alloc = 0 if seq is None else len(seq.windows[self.index].blocks[0])
        span = self.window + self.temporary_window
        ctx = (min(prompt_len, span) + bubble) // tpb
        total = ceil_div(min(final, span) + bubble, tpb)
        gen = total - ctx
        credit = 0
        if reuse and alloc == 0:
            credit = min(reusable(), ctx, (prompt_len - 1) // tpb)
        cur_tokens = prompt_len if seq is None else seq.num_tokens
        extra = int(final > self.window and ceil_div(final, tpb) > ceil_div(cur_tokens, tpb) and ceil_div(final, tpb) > total)
        if alloc < ctx - credit:
            return (ctx - credit - alloc) + (gen + extra) * beam
        return max(0, (total - credit - alloc + extra) * beam)

    def remaining_blocks_many(
        self, seqs: Sequence[TrackedSequence], allocated: Callable[[], np.ndarray], one: Callable[[int], int]
    ) -> np.ndarray:
        if not seqs:
            return super().remaining_blocks_many(seqs, allocated, one)
        tpb, bubble = self.tokens_per_block, self.sink_bubble_length
        prompt = int_array([s.prompt_len for s in seqs])  # [n]
        final = prompt + int_array([s.max_new_tokens for s in seqs])  # [n]
        beam = int_array([s.beam_width for s in seqs])  # [n]
        alloc = allocated()  # [n]
        # a full-attention window spans `max_seq_len`, so the scalar form's clipping to the window
        # (and its extra block for a request outgrowing it) never applies here
        ctx = (prompt + bubble) // tpb  # [n]
        total = ceil_div(final + bubble, tpb)  # [n]
        # (a live request holds its prompt's blocks, never none: the scalar form's credit for
        # reusable blocks, which only a request holding none gets, does not apply)
        return np.where(alloc < ctx, ctx - alloc + (total - ctx) * beam, np.maximum(0, (total - alloc) * beam))


class SlidingWindow(WindowBlockManager):
    """A query at q sees the `window` keys up to q: blocks wholly before that are detached
    (released, a placeholder left), a prefix match may skip positions no new query reads, and
    a request holds at most about a window's worth of blocks once its prompt is behind it."""

    detaches: ClassVar[bool] = True

    def first_visible(self, query: int) -> int:
        first = query - self.window + 1
        return first if first > 0 else 0  # (a conditional, not `max`: `add_token`'s slow path asks)

    def detach_limit(self, sw: SequenceWindow, num_draft_tokens: int) -> int | None:
        """`first_visible` inverted: the front block goes once the oldest query of the next
        forward (the newest token less the drafts) sees no key before the block's end, i.e.
        reaches `end + window - 1`; until then the sequence may hold that query's position
        plus the drafts, in tokens."""
        front_end = (sw.num_front_removed + 1) * self.tokens_per_block
        return front_end + self.window - 1 + num_draft_tokens

    def match(self, path: TokenPath, n_full: int) -> tuple[list, list[int]]:
        return self.tree.match(self.index, path, n_full, True)

    def reuse_safe(self, gap_ends: list[int], length: int) -> bool:
        """No query from the reuse point on sees a missing block: the last one before it ends
        where a query at `length - 1` already sees no key of it (`length >= end + window`,
        docs/semantics.md; one token stricter than the first new query, at `length`, needs)."""
        last_gap = 0
        for end in gap_ends:
            if end - self.tokens_per_block < length:
                last_gap = end
        return last_gap == 0 or self.first_visible(length - 1) >= last_gap

    def real_blocks(self, matched: list[int | None]) -> list[int]:
        return [b for b in matched if b is not None]

    def remaining_blocks(
        self, request: Request, seq: TrackedSequence | None, reuse: bool, reusable: Callable[[], int]
    ) -> int:
        """The peak it will hold (its prompt, then about a window and the drafts) less what it
        holds now (docs/semantics.md, "Sliding windows")."""
        tpb, bubble = self.tokens_per_block, self.sink_bubble_length
        beam = request.beam_width
        prompt_len = len(request.prompt)
        final = prompt_len + request.max_new_tokens
        sw = None if seq is None else seq.windows[self.index]
        alloc = 0 if sw is None else len(sw.blocks[0])
        held = 0 if sw is None else alloc - sw.num_front_removed
        ctx = ceil_div(prompt_len + bubble, tpb)
        if reuse and alloc == 0:
            ctx -= min(reusable(), (prompt_len - 1) // tpb)
        # held blocks peak at ceil((window + drafts) / tpb) + 1: the blocks the oldest draft
        # query sees, and a new block is allocated before the token's detach releases one
        span = self.window + request.num_draft_tokens
        steady = min(ceil_div(final + bubble, tpb), ceil_div(span, tpb) + 1) * beam
        # until the first token is added nothing has left the window: if that token starts
        # a block, the whole context plus one block is held for a moment
        cur = prompt_len if seq is None else seq.num_tokens
        first = (ctx if seq is None else held) + beam * int(cur < final and (cur + bubble) % tpb == 0)
        peak = max(first, steady)
        return max(0, peak - held)


class CrossAttentionWindow(FullAttentionWindow):
    """The encoder's KV for the decoder's cross attention: every query sees all of it; a
    request's `ceil(encoder_len / tokens_per_block)` blocks are shared by every beam, allocated
    at admission, never grown token by token and never stored for reuse."""

    grows: ClassVar[bool] = False
    stores: ClassVar[bool] = False

    def context_blocks(self, seq: TrackedSequence, reuse: bool) -> tuple[int, int]:
        return ceil_div(seq.prompt_len, self.tokens_per_block), 0

    def draft_blocks(self, request: Request) -> int:
        return 0

    def step_blocks(self, seq: TrackedSequence, steps: int, beam: int) -> int:
        return 0

    def step_blocks_many(self, seqs: Sequence[TrackedSequence], steps: int) -> np.ndarray:
        return np.zeros(len(seqs), dtype=np.int64)

    def remaining_blocks(
        self, request: Request, seq: TrackedSequence | None, reuse: bool, reusable: Callable[[], int]
    ) -> int:
        if seq is not None:
            return 0
        assert request.encoder_len is not None  # validated for a cross cache's request
        return ceil_div(request.encoder_len, self.tokens_per_block)

    def remaining_blocks_many(
        self, seqs: Sequence[TrackedSequence], allocated: Callable[[], np.ndarray], one: Callable[[int], int]
    ) -> np.ndarray:
        return WindowBlockManager.remaining_blocks_many(self, seqs, allocated, one)


class RecurrentStatesWindow(WindowBlockManager):
    """TensorRT-LLM's `kRecurrentStates` (window -1): each block holds every recurrent layer's
    full state (conv + SSM / delta-rule) at one position, not keys and values.

    A sequence's chain has one entry per block of tokens, as the attention windows' rows do
    (one tree, per-window block lists), but it holds a real block only where a state is kept:
    a snapshot (the state after a block boundary that is a multiple of `snapshot_interval` or
    the prompt's last block boundary, which a step ended at) and its live state; every other
    entry is a placeholder (no memory, the null slot in tables). A step reads the live block
    and writes another one (copy-forward), so a snapshot is never written again and a cached
    prefix's state stays valid while its owner decodes; with block reuse off the state is
    updated in place in one block per sequence (TensorRT-LLM's static slots). The ledger
    counts a begun step done once the KV of every token it covered is materialised; a step
    whose tokens were rewound is dropped (docs/semantics.md, "Recurrent states").
    """

    grows_blocks: ClassVar[bool] = False

    def __init__(
        self,
        index: int,
        window: int,
        config: CacheConfig,
        tree: RadixTree,
        recorder: TransferRecorder,
        events: KVCacheEventManager | None,
        clock: Callable[[], float],
    ) -> None:
        super().__init__(index, window, config, tree, recorder, events, clock)
        assert config.snapshot_interval is not None  # set by CacheConfig for a recurrent window
        self.interval = config.snapshot_interval
        self.block_bytes = config.recurrent_block_bytes
        # copy-forward when snapshots may be reused; in place (one block a sequence) otherwise
        self.copy_forward = config.enable_block_reuse

    # ------------------------------------------------------------------ the kind interface
    def first_visible(self, query: int) -> int:
        return 0  # the state at a position sums up every token before it: nothing detaches

    def match(self, path: TokenPath, n_full: int) -> tuple[list, list[int]]:
        """Positions without a snapshot are gaps; admission's walk ends at the last real one."""
        return self.tree.match(self.index, path, n_full, True)

    def reuse_safe(self, gap_ends: list[int], length: int) -> bool:
        """A reused prefix ends at a real snapshot (the state the first new token reads)."""
        return length == 0 or (length % self.tokens_per_block == 0 and length not in gap_ends)

    def real_blocks(self, matched: list[int | None]) -> list[int]:
        return [b for b in matched if b is not None]

    def fresh_need(self, positions: int) -> int:
        return 1  # the block the first step writes (the unmatched positions are placeholders)

    def draft_blocks(self, request: Request) -> int:
        return 0

    def admitted(self, seq: TrackedSequence, sw: SequenceWindow, prepopulated: int) -> None:
        """The reused prefix ends at a snapshot, the live state; the first step's write block."""
        live = sw.blocks[0][prepopulated // self.tokens_per_block - 1] if prepopulated else -1
        assert live != PLACEHOLDER_BLOCK_ID  # `reuse_safe` ends a reused prefix at a real block
        sw.num_front_removed = 0  # (placeholders anywhere in a chain: no detached prefix)
        sw.state = RecurrentCursor(prepopulated, live, self.take_fresh(1, None)[0])

    def step_blocks(self, seq: TrackedSequence, steps: int, beam: int) -> int:
        """Write blocks the next `steps` steps may allocate: one a step that keeps the block
        it read (a snapshot), less the write block held (at most `steps`)."""
        cur = seq.windows[self.index].state
        assert cur is not None  # set at admission
        if not self.copy_forward:
            return int(steps > 0 and self._pinned_in_place(cur))
        # a decode's begun step may commit between scheduling and the next begin (its token's
        # KV lands): count the write block either outcome needs
        holds = self._holds_write(seq, cur) and self._holds_write(seq, cur, assume_commit=True)
        return max(0, steps - holds)

    def step_blocks_many(self, seqs: Sequence[TrackedSequence], steps: int) -> np.ndarray:
        return np.array([self.step_blocks(s, steps, 1) for s in seqs], dtype=np.int64)

    def remaining_blocks(
        self, request: Request, seq: TrackedSequence | None, reuse: bool, reusable: Callable[[], int]
    ) -> int:
        """At most what a request still allocates: in place, its one block; copy-forward, a
        block for each snapshot point from its state's position to its last token (each
        keeps the block it passes), plus its live and write blocks where it holds none."""
        if not self.copy_forward:
            if seq is None:
                return 1
            cur = seq.windows[self.index].state
            assert cur is not None
            return int(self._pinned_in_place(cur))
        prompt_len = len(request.prompt)
        final = prompt_len + request.max_new_tokens
        if seq is None:
            return self._points(prompt_len, 1, final) + 2
        cur = seq.windows[self.index].state
        assert cur is not None
        return self._points(prompt_len, max(cur.pos, 1), final) + (cur.write < 0) + (cur.live < 0)

    def _points(self, prompt_len: int, lo: int, hi: int) -> int:
        """Snapshot points in `[lo, hi]` (`lo >= 1`) of a request whose prompt is `prompt_len` long."""
        boundary = prompt_len // self.tokens_per_block * self.tokens_per_block
        extra = int(lo <= boundary <= hi and boundary % self.interval != 0)
        return max(0, hi // self.interval - (lo - 1) // self.interval) + extra

    def released_visible(self, sw: SequenceWindow, query: int) -> bool:
        """A step from `query` needs `S(query)`: gone once the live state is past it (a
        transfer failure's cut-back then readmits the request)."""
        cur = sw.state
        return cur is not None and query < cur.pos

    # ------------------------------------------------------------------ states
    def is_snapshot_point(self, seq: TrackedSequence, pos: int) -> bool:
        """Is the state after `pos` tokens kept (and stored for reuse)?"""
        tpb = self.tokens_per_block
        return pos > 0 and pos % tpb == 0 and (pos % self.interval == 0 or pos == seq.prompt_len // tpb * tpb)

    def last_snapshot_point(self, seq: TrackedSequence, limit: int) -> int:
        """The largest snapshot point at most `limit` (0: none)."""
        boundary = seq.prompt_len // self.tokens_per_block * self.tokens_per_block
        best = limit // self.interval * self.interval
        return boundary if best < boundary <= limit else best

    def next_chunk_end(self, seq: TrackedSequence) -> int:
        """Where the next step should end: during the prompt, its next snapshot point (or the
        prompt's end), so that snapshots exist for reuse; after it, the newest token."""
        cur = seq.windows[self.index].state
        assert cur is not None
        pos = cur.end if cur.end and self.committing(seq, cur) else cur.pos
        if pos >= seq.prompt_len:
            return seq.num_tokens
        tpb = self.tokens_per_block
        end = min((pos // self.interval + 1) * self.interval, seq.prompt_len)
        boundary = seq.prompt_len // tpb * tpb
        return boundary if pos < boundary < end else end

    @staticmethod
    def _materialised(seq: TrackedSequence) -> int:
        """Tokens whose KV exists: the context position during the prompt and right at its end
        (the prompt's last chunk ran: storing its blocks then keeps its step), then all but
        the newest token (added for the next forward)."""
        cp = seq.context_position
        return cp if cp < seq.prompt_len or seq.num_tokens == seq.prompt_len else seq.num_tokens - 1

    def committing(self, seq: TrackedSequence, cur: RecurrentCursor) -> bool:
        """Did the begun step take effect (the KV of every token it covered exists)?"""
        return self._materialised(seq) >= cur.end

    def _keeps_live(self, seq: TrackedSequence, cur: RecurrentCursor) -> bool:
        """Does committing the begun step keep the block it read (a snapshot)?"""
        tpb = self.tokens_per_block
        return cur.live >= 0 and (cur.pos - 1) // tpb != (cur.end - 1) // tpb and self.is_snapshot_point(seq, cur.pos)

    def _pinned_in_place(self, cur: RecurrentCursor) -> bool:
        """Reuse off: is the block the next step would update in place pinned? Its state must
        stay as pinned, so that step writes a fresh block (`begin_step`)."""
        return cur.live >= 0 and cur.write == cur.live and self.refs.ref[cur.live] > 1

    def _holds_write(self, seq: TrackedSequence, cur: RecurrentCursor, assume_commit: bool = False) -> bool:
        """Will the sequence hold a write block once its begun step is settled (`settle`)?
        `assume_commit`: as if the begun step had taken effect."""
        if not self.copy_forward:
            return cur.write >= 0 and not self._pinned_in_place(cur)
        if not cur.end or not (assume_commit or self.committing(seq, cur)) or not self.copy_forward:
            return cur.write >= 0
        old = cur.live
        if old < 0 or self._keeps_live(seq, cur):
            return False
        return self.refs.ref[old] == 1 and self.block_node[old] < 0  # recycled

    def settle(self, seq: TrackedSequence, sw: SequenceWindow) -> None:
        """Commit the begun step if it took effect (its write block becomes the live state),
        else forget it (its write block stays for the next step)."""
        cur = sw.state
        assert cur is not None
        if not cur.end:
            return
        if not self.committing(seq, cur):
            cur.end = 0
            if not self.copy_forward and cur.live >= 0 and cur.write != cur.live:
                self.refs.release(cur.write)  # the fresh block of a pinned in-place state
                cur.write = cur.live
            return
        tpb = self.tokens_per_block
        old, oldk, newk = cur.live, (cur.pos - 1) // tpb, (cur.end - 1) // tpb
        recycled = -1
        if old >= 0 and old != cur.write:
            if self.copy_forward and self._keeps_live(seq, cur):
                pass  # a snapshot: it stays in the chain, never written again
            else:
                if oldk != newk:
                    self._set(sw, oldk, PLACEHOLDER_BLOCK_ID)
                if self.copy_forward and self.refs.ref[old] == 1 and self.block_node[old] < 0:
                    recycled = old  # private and uncached: the next step's write block
                else:
                    self.refs.release(old)
        elif old >= 0 and oldk != newk:  # in place: the block moves to its new position
            self._set(sw, oldk, PLACEHOLDER_BLOCK_ID)
        self._set(sw, newk, cur.write)
        cur.live, cur.pos, cur.end = cur.write, cur.end, 0
        cur.write = cur.live if not self.copy_forward else recycled

    def _set(self, sw: SequenceWindow, pos: int, b: int) -> None:
        sw.set_block(0, pos, b)
        self.slot_table.set(sw, 0, pos, self.null_slot if b < 0 else int(self.columns.slot[b]))

    def check_step(self, seq: TrackedSequence, end: int) -> int:
        """Check a step of `seq` ending at `end` tokens; returns the blocks beginning it allocates."""
        cur = seq.windows[self.index].state
        assert cur is not None
        committing = bool(cur.end) and self.committing(seq, cur)
        pos = cur.end if committing else cur.pos
        if not pos < end <= seq.num_tokens:
            raise InvalidRequestError(
                f"request {seq.request_id!r}: a recurrent step from {pos} must end in ({pos}, {seq.num_tokens}], got {end}"
            )
        return int(not self._holds_write(seq, cur))

    def begin_step(self, seq: TrackedSequence, end: int) -> tuple[int, int, bool]:
        """Begin a step ending at `end` (checked by `check_step`, capacity too): settle the
        previous one, hold a write block; returns (read slot, write slot, has initial state)."""
        sw = seq.windows[self.index]
        self.settle(seq, sw)
        cur = sw.state
        assert cur is not None
        if cur.write < 0 or (not self.copy_forward and self._pinned_in_place(cur)):
            cur.write = self.take_fresh(1, None)[0]  # (in place: the live state is pinned; keep it as it is)
        cur.end = end
        slot = self.columns.slot
        read = int(slot[cur.live]) if cur.live >= 0 else self.null_slot
        return read, int(slot[cur.write]), cur.live >= 0

    def rewind_to(self, seq: TrackedSequence, sw: SequenceWindow, new_n: int) -> None:
        """Drop the chain's positions past `new_n` tokens (placeholders: the live state is
        before them, `check_rewind`) and a begun step that covered dropped tokens."""
        cur = sw.state
        assert cur is not None
        keep = ceil_div(new_n, self.tokens_per_block)
        beam = sw.blocks[0]
        while len(beam) > keep:
            assert beam[-1] < 0  # checked: no state past the new end
            sw.pop_block(0)
        self.slot_table.truncate(sw, 0, keep)
        if cur.end > new_n:
            cur.end = 0
        if sw.cursor is not None and sw.cursor.full_blocks > keep:
            self.set_cursor(sw, None, own=False)

    def check_rewind(self, seq: TrackedSequence, new_n: int) -> None:
        cur = seq.windows[self.index].state
        assert cur is not None
        if cur.pos > new_n:
            raise InvalidRequestError(
                f"cannot rewind request {seq.request_id!r} to {new_n} tokens: its recurrent state covers {cur.pos}"
            )
        if not self.copy_forward and cur.end >= new_n:  # (at new_n the step would no longer count as done)
            raise InvalidRequestError(
                f"cannot rewind request {seq.request_id!r} to {new_n} tokens: its begun step updates its recurrent "
                "state in place (block reuse off); finish the step first"
            )

    def store(self, seq: TrackedSequence, sw: SequenceWindow, num_tokens: int, allow_partial: bool) -> int:
        """Store the snapshots of the first `num_tokens` tokens (whole blocks up to the last
        snapshot point the live state reached; placeholders attach nowhere). A begun step
        that took effect is settled first; one whose newest token's KV the ledger cannot know
        yet (a store right after a decode forward, before the next token is added) stays begun
        for the next `begin_recurrent_step` to judge, never dropped here."""
        cur = sw.state
        assert cur is not None
        if cur.end and self.committing(seq, cur):
            self.settle(seq, sw)
        limit = self.last_snapshot_point(seq, min(num_tokens, cur.pos))
        return super().store(seq, sw, limit, False) if limit > 0 else 0

    def release_sequence(self, sw: SequenceWindow) -> None:
        blocks = sw.unique_blocks()
        blocks.reverse()
        self.refs.release_run(blocks)

    def verify_chain(self, seq: TrackedSequence, sw: SequenceWindow) -> None:
        """The chain's invariants (`verify_integrity`): placeholders map to the null slot, real
        blocks are snapshots (at snapshot points, or reused at admission) before the live
        state, or the live state at its position; the write block is private (never cached, never read by anyone else),
        so no snapshot is ever written."""
        cur = sw.state
        rid = seq.request_id
        if cur is None:
            raise IntegrityError(f"recurrent window: request {rid!r} has no state cursor")
        tpb = self.tokens_per_block
        live_pos = (cur.pos - 1) // tpb if cur.live >= 0 else -1
        if (cur.live >= 0) != (cur.pos > 0):
            raise IntegrityError(f"recurrent window: request {rid!r} has state {cur.as_tuple()}")
        beam = sw.blocks[0]
        slots = self.slot_table.row(sw, 0).tolist() if sw.rows is not None else []
        for k, b in enumerate(beam):
            if b == PLACEHOLDER_BLOCK_ID:
                if slots[k] != self.null_slot:
                    raise IntegrityError(f"recurrent window: placeholder of {rid!r} at {k} has slot {slots[k]}")
            elif k == live_pos:
                if b != cur.live:
                    raise IntegrityError(f"recurrent window: request {rid!r} holds {b} at its live position, not {cur.live}")
            elif k > live_pos or not (self.is_snapshot_point(seq, (k + 1) * tpb) or (k + 1) * tpb <= seq.prepopulated):
                raise IntegrityError(f"recurrent window: request {rid!r} holds block {b} at {k}, not a snapshot point")
        if live_pos >= 0 and beam[live_pos] != cur.live:
            raise IntegrityError(f"recurrent window: request {rid!r} lost its live block {cur.live}")
        w = cur.write
        if self.copy_forward and w >= 0:
            if w == cur.live or w in beam or self.block_node[w] >= 0 or self.refs.ref[w] != 1:
                raise IntegrityError(f"recurrent window: write block {w} of {rid!r} is shared, cached or in its chain")
        if not self.copy_forward and cur.pos > 0 and w != cur.live:
            # only a begun step whose live state is pinned writes elsewhere, a private block
            if not cur.end or w < 0 or w in beam or self.refs.ref[w] != 1 or self.block_node[w] >= 0:
                raise IntegrityError(f"recurrent window: request {rid!r} updates in place but writes {w}, not {cur.live}")


def window_kind(config: CacheConfig, window: int) -> type[WindowBlockManager]:
    """The kind of window `window` of `config`: the recurrent states (`RECURRENT_STATES`), a
    cross-attention cache's one window, else sliding when it is shorter than `max_seq_len`,
    else full attention."""
    if window == RECURRENT_STATES:
        return RecurrentStatesWindow
    if config.cache_type == "cross":
        return CrossAttentionWindow
    return SlidingWindow if config.is_swa(window) else FullAttentionWindow


def window_manager_for(
    index: int,
    window: int,
    config: CacheConfig,
    tree: RadixTree,
    recorder: TransferRecorder,
    events: KVCacheEventManager | None,
    clock: Callable[[], float],
) -> WindowBlockManager:
    """The manager of window `window` (the `index`-th, ascending), of its kind."""
    return window_kind(config, window)(index, window, config, tree, recorder, events, clock)
