"""The attention kinds of a window: `FullAttentionWindow`, `SlidingWindow`, `CrossAttentionWindow`.

Each is a `WindowBlockManager` (the shared per-window machinery) stating the rules in which
its kind differs, as vLLM's `FullAttentionManager` / `SlidingWindowManager` and TensorRT-LLM's
per-window managers do; the rest of the ledger asks the window and never tests its kind. The
visibility rule `query - window + 1` lives here only (`SlidingWindow.first_visible`, and its
inverse in `SlidingWindow.detach_limit`): `tests/ledger/test_window_kinds.py` fails if
arithmetic on a window's size appears in another ledger module. (The device code keeps its
own copy, `kvjax.device.attention.visibility_mask`.)

A new kind (e.g. a recurrent-state window, TensorRT-LLM's `kRecurrentStates`, window -1, whose
sequences hold placeholder blocks) derives from `WindowBlockManager` and states:
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
then `window_manager_for` picks it for its windows (and `CacheConfig` admits such a window).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, cast

import numpy as np

from kvjax._math import ceil_div
from kvjax.config import CacheConfig
from kvjax.ledger.packing import int_array
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


def window_kind(config: CacheConfig, window: int) -> type[WindowBlockManager]:
    """The kind of attention window `window` of `config`: a cross-attention cache's one
    window, else sliding when it is shorter than `max_seq_len`, else full attention."""
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
