"""`WindowBlockManager`: the blocks, free queues and allocation rules of one attention window.

It owns block ids `0..P-1` (primary memory) and `P..P+S-1` (secondary memory) as columns
(`BlockColumns`: slot, level; `RefCounts`; `FreeQueues`: queues and retention), and the
per-window half of every ledger decision: allocate (evict or offload a victim), onboard,
partial copy, store into the shared tree, release, and the front-block detach. Every byte
movement it decides goes to the shared `TransferRecorder`.

It is the shared machinery only: what differs between attention kinds (which keys a query
sees, what may be detached, what a step or a request needs, how a prefix match ends, how
admission splits a prompt) is declared here as the kind interface and stated by each kind in
`kvjax.ledger.window_kinds`, which also makes the manager of a window.
"""
from __future__ import annotations

import abc
import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from kvjax._math import ceil_div
from kvjax.config import DEFAULT_PRIORITY, CacheConfig
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID, PRIMARY, SECONDARY, BlockColumns
from kvjax.ledger.block_tables import SlotTable
from kvjax.ledger.events import add_stored_blocks, new_columns
from kvjax.ledger.free_queues import FreeQueues
from kvjax.ledger.host_notices import HostHooks, HostNoticeKind
from kvjax.ledger.packing import int_array, packer
from kvjax.ledger.radix_tree import NO_BLOCK, ROOT
from kvjax.ledger.refs import RefCounts
from kvjax.ledger.sequence import StoreCursor
from kvjax.ledger.stats import Counters
from kvjax.ledger.transfer_recorder import TransferRecorder
from kvjax.transfer_plan import TransferKind

# a row this long is packed in one call (a Python int per entry costs ~100 ns)
_MANY_BLOCKS = 16

if TYPE_CHECKING:
    from kvjax.ledger.events import KVCacheEventManager
    from kvjax.ledger.radix_tree import RadixTree
    from kvjax.ledger.sequence import SequenceWindow, TrackedSequence
    from kvjax.ledger.token_path import TokenPath
    from kvjax.request import Request

_OFFLOAD = int(TransferKind.OFFLOAD)
_ONBOARD = int(TransferKind.ONBOARD)
_COPY = int(TransferKind.COPY)


class WindowBlockManager(abc.ABC):
    """One attention window's blocks and rules; a kind (`kvjax.ledger.window_kinds`) supplies
    the kind interface below (class attributes and abstract methods)."""

    #: releases a sequence's front blocks as it grows (placeholders in its rows, gaps in a
    #: prefix match, no store hints): the block manager detaches only in these windows
    detaches: ClassVar[bool] = False
    #: a sequence grows token by token (a cross-attention cache holds the encoder's KV, fixed)
    grows: ClassVar[bool] = True
    #: its blocks may be stored in the tree for reuse
    stores: ClassVar[bool] = True
    #: a token that starts a block allocates one here (False: a placeholder; a recurrent-state
    #: window allocates its state blocks when steps begin, `RecurrentStatesWindow`)
    grows_blocks: ClassVar[bool] = True

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
        self.index = index
        self.window = window
        self.tokens_per_block = config.tokens_per_block
        self.max_seq_len = config.max_seq_len
        self.sink_bubble_length = config.sink_bubble_length
        self.num_primary = config.primary_blocks_for(window)
        self.num_secondary = config.secondary_blocks_for(window)
        self.num_blocks = self.num_primary + self.num_secondary
        self.pools = config.window_pools[window]
        self.null_slot = self.num_primary
        self.max_token_num = config.max_token_num(window)
        self.temporary_window = config.temporary_window(window)
        # every layer's K and V of one block in this window, FP8 block scales included
        self.block_bytes = round(config.cache_size_per_token[window] * config.tokens_per_block)
        self.tree = tree
        self.recorder = recorder
        self.events = events
        # Offloading only makes sense if blocks come back (TensorRT-LLM ties it to onboarding).
        self.offload_enabled = config.onboard_blocks and self.num_secondary > 0 and config.enable_block_reuse
        self.columns = BlockColumns(self.num_primary, self.num_secondary)
        self.slot_table = SlotTable(self.null_slot)  # the slots block tables show
        self.queues = FreeQueues(self.columns.level, self.num_primary, config.secondary_offload_min_priority, clock)
        self.refs = RefCounts(self.num_blocks, self.queues)
        self.block_node = tree.block_node[index]  # read-only here: the tree changes it
        self.counters = Counters()
        self.tier3: HostHooks | None = None  # tier-3 hooks (`kvjax.ledger.tier3`), set on first use
        if events is not None:
            events.created(window, self.num_primary, self.num_secondary)

    # ------------------------------------------------------------------ counts
    @property
    def num_free_primary(self) -> int:
        return self.queues.num_free[PRIMARY]

    @property
    def num_free_secondary(self) -> int:
        return self.queues.num_free[SECONDARY]

    def is_cached(self, b: int) -> bool:
        return self.block_node[b] >= 0

    def is_leaf(self, b: int) -> bool:
        return self.tree.is_leaf(self.index, b)

    def block_hash(self, b: int):
        """Event hash of a cached block's position."""
        tree = self.tree
        n, o = self.block_node[b], tree.block_offset[self.index][b]
        hs = tree.hashes[n]  # hashed when stored with events on: the lookup is the usual case
        if hs is not None:
            h = hs[o]
            if h is not None:
                return h
        return tree.position_hash(n, o)

    def drop_cached(self, b: int, evicted: bool = True) -> None:
        """Take `b`'s content out of the tree (true priority eviction: only this block; its
        descendants keep their own queue positions)."""
        if self.events is not None:
            self.events.removed(self.window, self.block_hash(b))
        self.tree.detach(self.index, b)
        if evicted:
            self.counters.evicted += 1

    # ------------------------------------------------------------------ the kind interface
    # Each kind states these; everything else in the ledger asks the window, never its kind.
    @abc.abstractmethod
    def first_visible(self, query: int) -> int:
        """The first key position a query at position `query` attends to (>= 0): the one home
        of the kind's visibility rule in the ledger."""

    @abc.abstractmethod
    def match(self, path: TokenPath, n_full: int) -> tuple[list, list[int]]:
        """Admission's read-only walk over the path's first `n_full` full blocks: the matched
        block ids from position 0 (None: a position the kind may leave missing) and the end
        token of each None's block (`RadixTree.match`)."""

    @abc.abstractmethod
    def reuse_safe(self, gap_ends: list[int], length: int) -> bool:
        """May a request reuse its first `length` matched tokens (all covered by the walk)
        although the walk left the positions ending at `gap_ends` missing?"""

    @abc.abstractmethod
    def real_blocks(self, matched: list[int | None]) -> list[int]:
        """The block ids of a walk's `matched` list (its gaps left out)."""

    @abc.abstractmethod
    def remaining_blocks(
        self, request: Request, seq: TrackedSequence | None, reuse: bool, reusable: Callable[[], int]
    ) -> int:
        """`remaining_blocks_to_completion` in this window: blocks the request (`seq`: its live
        sequence, None before admission) still needs to finish. `reuse`: the ledger may credit
        cached blocks; `reusable()`: the prompt's blocks admission would reuse that live
        sequences already hold (a tree walk: asked only when used)."""

    def detach_end(self, oldest: int) -> int:
        """How many front block positions no query at `oldest` or later sees."""
        return self.first_visible(oldest) // self.tokens_per_block

    def released_visible(self, sw: SequenceWindow, query: int) -> bool:
        """Would a query at `query` see a block this sequence already released?"""
        return sw.num_front_removed * self.tokens_per_block > self.first_visible(query)

    def detach_invisible(self, sw: SequenceWindow, oldest: int) -> None:
        """Release the sequence's front blocks that no query at `oldest` or later sees."""
        end = self.first_visible(oldest) // self.tokens_per_block  # `detach_end`, one call less
        while sw.num_front_removed < end:
            self.detach_front_block(sw)

    def detach_limit(self, sw: SequenceWindow, num_draft_tokens: int) -> int | None:
        """The most tokens the sequence may hold before its next token detaches its front
        block (None: it never does); `num_draft_tokens` newest tokens are unverified drafts,
        queries of the next forward too."""
        return None

    def context_blocks(self, seq: TrackedSequence, reuse: bool) -> tuple[int, int]:
        """Admission's split of the prompt's blocks: (blocks every beam shares, 1 when the last
        context block is allocated once per beam). With beams the last block is per beam
        unless, reuse off, it is full."""
        n_ctx = ceil_div(seq.prompt_len, self.tokens_per_block)
        shared = n_ctx if seq.beam_width == 1 or (not reuse and seq.prompt_len % self.tokens_per_block == 0) else n_ctx - 1
        return shared, int(shared < n_ctx)

    def fresh_need(self, positions: int) -> int:
        """Free blocks admission takes for `positions` context positions it does not match."""
        return positions

    def admitted(self, seq: TrackedSequence, sw: SequenceWindow, prepopulated: int) -> None:
        """Admission wrote the sequence's row (its first `prepopulated` tokens reused): a kind
        that keeps more per sequence sets it up here."""
        return None

    def verify_chain(self, seq: TrackedSequence, sw: SequenceWindow) -> None:
        """Raise `IntegrityError` unless the sequence's row keeps the kind's own rules
        (`verify_integrity`; the shared rules are `kvjax.ledger.integrity`'s)."""
        return None

    def check_rewind(self, seq: TrackedSequence, new_n: int) -> None:
        """Raise `InvalidRequestError` unless the sequence may drop its tokens past `new_n` here."""
        return None

    def draft_blocks(self, request: Request) -> int:
        """Blocks the first step's draft tokens start after the prompt (a request not yet admitted)."""
        if not request.num_draft_tokens:
            return 0
        tpb = self.tokens_per_block
        prompt_len = len(request.prompt)
        with_drafts = min(prompt_len + request.num_draft_tokens, self.max_seq_len)
        return (ceil_div(with_drafts, tpb) - ceil_div(prompt_len, tpb)) * request.beam_width

    def step_blocks(self, seq: TrackedSequence, steps: int, beam: int) -> int:
        """Blocks the next `steps` decode steps of a live sequence start, `beam` per block
        (`needed_blocks_one_step`, the request's beam width; none during a chunked prefill,
        none past the window's token limit)."""
        if seq.context_position < seq.prompt_len:
            return 0
        tpb = self.tokens_per_block
        curr = seq.num_tokens
        max_add = min(steps * (seq.num_draft_tokens + 1), seq.max_new_tokens - (curr - seq.prompt_len))
        nxt = curr + max(max_add, 0)
        if nxt > self.max_token_num:
            return 0
        return (ceil_div(nxt, tpb) - ceil_div(curr, tpb)) * beam

    def step_blocks_many(self, seqs: Sequence[TrackedSequence], steps: int) -> np.ndarray:
        """`step_blocks` of each live sequence (its own beam width), int64 `[n]`."""
        tpb = self.tokens_per_block
        cur = int_array([s.num_tokens for s in seqs])  # [n]
        prompt = int_array([s.prompt_len for s in seqs])  # [n]
        idle = np.array([s.context_position < s.prompt_len for s in seqs], dtype=bool)  # [n]
        drafts = int_array([s.num_draft_tokens for s in seqs])  # [n]
        left = int_array([s.max_new_tokens for s in seqs]) - (cur - prompt)  # [n] tokens still to generate
        nxt = cur + np.maximum(np.minimum(steps * (drafts + 1), left), 0)  # [n]
        beam = int_array([s.beam_width for s in seqs])  # [n]
        need = (ceil_div(nxt, tpb) - ceil_div(cur, tpb)) * beam  # [n] blocks the new tokens start
        return np.where(idle | (nxt > self.max_token_num), 0, need)

    def remaining_blocks_many(
        self, seqs: Sequence[TrackedSequence], allocated: Callable[[], np.ndarray], one: Callable[[int], int]
    ) -> np.ndarray:
        """`remaining_blocks` of each live sequence, int64 `[n]`: `one(i)` answers row `i` alone;
        `allocated()` is each row's beam-0 block count, int64 `[n]`, for a kind that answers
        the rows together."""
        return np.array([one(i) for i in range(len(seqs))], dtype=np.int64)

    # ------------------------------------------------------------------ allocation
    def get_free_block(self, priority: int | None, duration: float | None) -> int:
        """Claim a primary block, referenced once: the queues' victim, whose cached content is
        offloaded to a free secondary block when its priority allows, else evicted."""
        queues, refs = self.queues, self.refs
        victim, can_offload = refs.claim_victim(PRIMARY)  # raises OutOfBlocksError when empty
        c = self.counters
        c.alloc_total += 1
        if self.block_node[victim] < 0:
            c.alloc_new += 1
            b = victim
        elif can_offload and self.offload_enabled and queues.num_free[SECONDARY] and (spare := self._host_spare()) >= 0:
            slot = self.columns.slot
            self.recorder.record(_OFFLOAD, self.pools, slot[victim], slot[spare], self.tokens_per_block)
            self.columns.swap_memory(victim, spare)
            refs.requeue(victim)  # same priority and pending expiry, now in the secondary queues
            c.offloaded += 1
            c.offload_bytes += self.block_bytes
            if self.events is not None:
                self.events.updated(self.window, self.block_hash(victim), cache_level=(PRIMARY, SECONDARY))
            if self.tier3 is not None:
                self.tier3.notice(HostNoticeKind.STORED, victim)
            b = spare
        else:
            if self.events is not None:
                self.events.removed(self.window, self.block_hash(victim))
            self.tree.detach(self.index, victim)
            c.evicted += 1
            b = victim
        queues.set_retention(b, DEFAULT_PRIORITY if priority is None else priority, duration)
        return b

    def _host_spare(self) -> int:
        """Claim the host victim an offload copies into (its cached content evicted; with tier-3
        hooks on, an evict guard may keep it): the block, or -1 when none is left."""
        spare, _ = self.refs.claim_victim(SECONDARY)
        if self.block_node[spare] >= 0:
            if self.tier3 is not None:
                return self.tier3.evict_spare(spare)
            self.drop_cached(spare)
        return spare

    def take_fresh(self, count: int, retention: list[tuple[int | None, float | None]] | None) -> list[int]:
        """`count` blocks from `get_free_block`, each referenced once; `retention` holds each
        one's (priority, duration) (None: default priority, no duration)."""
        if self.offload_enabled and self.queues.num_free[SECONDARY]:  # victims may be offloaded
            get = self.get_free_block
            out = [get(None, None) for _ in range(count)] if retention is None else [get(p, d) for p, d in retention]
        else:  # every victim is fresh or evicted: claim them in one pass, as get_free_block would
            queues = self.queues
            out = self.refs.claim_victims(count)
            bnode, events, c = self.block_node, self.events, self.counters
            c.alloc_total += count
            tree, widx = self.tree, self.index
            if events is not None:  # the victims' hashes, read before any leaves the tree
                hashes, boff = tree.hashes, tree.block_offset[widx]
                removed: list = []
                for b in out:
                    n = bnode[b]
                    if n >= 0:  # its hash, cached when it was stored (else block_hash)
                        hs = hashes[n]
                        h = None if hs is None else hs[boff[b]]
                        removed.append(self.block_hash(b) if h is None else h)
                if removed:
                    events.removed_many(self.window, removed)
            evicted = tree.detach_many(widx, out)
            c.alloc_new += count - evicted
            c.evicted += evicted
            if retention is not None:
                queues.set_retention_each(out, retention)
        return out

    def onboard(self, b: int) -> None:
        """Bring a claimed secondary block back to primary memory (swap with a fresh block)."""
        target = self.get_free_block(DEFAULT_PRIORITY, None)
        slot = self.columns.slot
        tier3 = self.tier3
        if tier3 is not None:
            tier3.notice(HostNoticeKind.HIT, b)
        self.recorder.record(_ONBOARD, self.pools, slot[b], slot[target], self.tokens_per_block)
        self.columns.swap_memory(b, target)
        if tier3 is not None:
            tier3.onboarded(b, target)  # host pins follow the host slot
        self.refs.release(target)  # now owns secondary memory: back to the secondary queues
        c = self.counters
        c.onboarded += 1
        c.onboard_bytes += self.block_bytes
        if self.events is not None and self.block_node[b] >= 0:
            self.events.updated(self.window, self.block_hash(b), cache_level=(SECONDARY, PRIMARY))

    def copy_prefix(self, src: int, num_tokens: int, priority: int | None, duration: float | None) -> int:
        """A fresh primary block, referenced once, holding the first `num_tokens` tokens of
        `src` (partial reuse)."""
        dst = self.get_free_block(priority, duration)
        slot = self.columns.slot
        kind = _COPY if self.columns.level[src] == PRIMARY else _ONBOARD
        if kind == _ONBOARD and self.tier3 is not None:
            self.tier3.notice(HostNoticeKind.HIT, src)
        self.recorder.record(kind, self.pools, slot[src], slot[dst], num_tokens)
        c = self.counters
        c.copied += 1
        c.copy_bytes += self.block_bytes * num_tokens // self.tokens_per_block
        return dst

    def set_priority(self, b: int, priority: int) -> None:
        """Re-prioritise a matched cached block (a request stating no priority keeps the block's
        own, so a high-priority system prompt stays high); emits an Updated event."""
        if self.events is not None and self.block_node[b] >= 0:
            self.events.updated(self.window, self.block_hash(b), priority=(self.queues.priority[b], priority))
        self.queues.set_priority(b, priority)

    # ------------------------------------------------------------------ sequence block lists
    def extend_blocks(self, sw: SequenceWindow, blocks: list[int], beam: int | None = None) -> None:
        """Append referenced blocks (or placeholders) to one beam, or with `beam=None` share them
        with every beam. Slots are mirrored for block tables (placeholders -> null slot)."""
        slots: list[int] | np.ndarray
        if self.num_secondary or self.detaches or not self.grows_blocks:
            slot, null = self.columns.slot, self.null_slot
            slots = [slot[b] if b >= 0 else null for b in blocks]
        else:  # no host tier: every block keeps its own slot (no swaps); no placeholders either
            slots = blocks
        # (a recurrent-state chain has placeholders where it grows: `grows_blocks`)
        # an admitted row: one pack, then a byte copy (`array.extend` of a list converts int by int)
        ids = packer(len(blocks))(*blocks) if len(blocks) >= _MANY_BLOCKS else None
        if ids is not None and slots is blocks:  # the slots are those bytes too: no list conversion
            slots = np.frombuffer(ids, dtype=np.int32)
        for b in range(len(sw.blocks)) if beam is None else (beam,):
            sw.extend_blocks(b, blocks, ids)
            self.slot_table.extend(sw, b, slots)

    def append_block(self, sw: SequenceWindow, beam: int, b: int) -> None:
        sw.append_block(beam, b)
        self.slot_table.append(sw, beam, self.columns.slot[b])

    def release_block(self, b: int, to_front: bool = False) -> None:
        self.refs.release(b, to_front)

    def release_sequence(self, sw: SequenceWindow) -> None:
        """Drop the sequence's references, last block first (so LRU evicts tails first)."""
        beams = sw.blocks
        if len(beams) == 1:
            ids = beams[0][sw.num_front_removed :]
            ids.reverse()
            self.refs.release_run(ids)
            return
        release = self.refs.release
        for pos in range(len(beams[0]) - 1, -1, -1):
            seen: list[int] = []
            for b in range(len(beams) - 1, -1, -1):
                blk = beams[b][pos]
                if blk == PLACEHOLDER_BLOCK_ID or blk in seen:
                    continue
                seen.append(blk)
                release(blk)

    def detach_front_block(self, sw: SequenceWindow) -> None:
        """The front block left what any query sees: release it, keep a placeholder."""
        pos = sw.num_front_removed
        seen: list[int] = []
        for b, beam in enumerate(sw.blocks):
            blk = beam[pos]
            if blk != PLACEHOLDER_BLOCK_ID and blk not in seen:
                seen.append(blk)
                self.refs.release(blk)
            sw.set_block(b, pos, PLACEHOLDER_BLOCK_ID)
            self.slot_table.set(sw, b, pos, self.null_slot)
        sw.num_front_removed = pos + 1

    # ------------------------------------------------------------------ storing for reuse
    def set_cursor(self, sw: SequenceWindow, cursor: StoreCursor | None, own: bool) -> None:
        """Move a sequence's storing cursor (None: forget it) and file the row's store hint to
        match.

        The hint is `(full blocks + 1) * tokens_per_block` only when the position holds the
        sequence's own block (`own`) in a full-attention window: a block the sequence
        references is never evicted, and a split moves a position without changing its id, so
        until a new full block materialises the sequence has nothing to store, which is all
        `store_new_blocks` may skip a row for. A cursor on another request's block (ours stayed
        private: a duplicate) can lose its position to an eviction, after which the sequence
        stores its own block there; a window that detaches releases old blocks. Those, and no
        cursor, file 0 (always check). The one way a referenced block leaves its position is
        a store that moves it under another key (a partial block that grew; a block offered
        with fewer tokens than its cached key stays, `RadixTree._holds_longer`): `store` then
        clears every hint of the window."""
        sw.cursor = cursor
        due = 0
        if cursor is not None and own and not self.detaches and self.grows_blocks:  # (a state chain: snapshots only)
            due = (cursor.full_blocks + 1) * self.tokens_per_block
        self.slot_table.set_store_due(sw, due)

    def cursor_position(self, seq: TrackedSequence, sw: SequenceWindow) -> tuple[tuple[int, int], int] | None:
        """Where the sequence's storing cursor is ((node, offset), full blocks), or None when
        it has none or its position was pruned since."""
        cur = sw.cursor
        if cur is None:
            return None
        tree = self.tree
        node, pid, full = cur
        pos = tree.locate(node, pid)
        if pos is None:  # its node was reused: look the position up by the sequence's tokens
            path = seq.token_path(0, full * self.tokens_per_block, self.tokens_per_block)
            pos = tree.find(path, full - 1)
            if pos is None or tree.pid[pos[0]] + pos[1] != pid:
                return None
        return pos, full

    def store(self, seq: TrackedSequence, sw: SequenceWindow, num_tokens: int, allow_partial: bool) -> int:
        """Attach the sequence's blocks covering its first `num_tokens` tokens to the tree.

        Positions whose key is already cached keep the cached block (ours is a duplicate and
        stays private). Returns how many blocks were newly stored. Full blocks advance a
        per-sequence cursor so repeated calls only walk new blocks.
        """
        tpb = self.tokens_per_block
        n_full = num_tokens // tpb
        n_blocks = n_full + (1 if allow_partial and num_tokens % tpb else 0)
        found = self.cursor_position(seq, sw)
        start, depth = ((ROOT, -1), 0) if found is None else found
        if depth >= n_blocks:
            return 0
        events = self.events
        moves: list[tuple[int, object]] = []
        b = NO_BLOCK
        if n_blocks == n_full == depth + 1 and found is not None:
            b = self._extend_own_leaf(seq, sw, start, depth)
        if b >= 0:
            attached = [(depth, b)]
        else:
            path = seq.token_path(depth, num_tokens, tpb)

            def on_move(d: int, b: int) -> None:  # a block cached under another key moves here
                moves.append((d, None if events is None else self.block_hash(b)))

            attached, cursor = self.tree.insert(self.index, path, start, n_blocks, n_full, sw.blocks[0], on_move)
            if moves:  # the moved block may hold another request's cursor position: no hint holds
                self.slot_table.clear_store_hints()
            if cursor is not None:
                node, pid = cursor
                row = self.tree.values[self.index][node]  # None: the node holds nothing of this window
                own = row is not None and row[pid - self.tree.pid[node]] == sw.blocks[0][n_full - 1]
                self.set_cursor(sw, StoreCursor(node, pid, n_full), own)
            if not attached:
                return 0
        queues = self.queues
        if seq.retention is None:
            queues.set_default_retention([b for _, b in attached])
        else:
            first, stop = attached[0][0], attached[-1][0] + 1
            retention = seq.block_priorities(first, stop, tpb)
            if stop - first == len(attached):  # one run of consecutive blocks (the usual case)
                queues.set_retention_each([b for _, b in attached], retention)
            else:
                queues.set_retention_each([b for _, b in attached], [retention[d - first] for d, _ in attached])
        if events is not None:
            self._emit_stored(attached, moves, None if seq.extra_ids is not None else seq, num_tokens)
        return len(attached)

    def attach_restored(self, path: TokenPath, n_blocks: int, blocks: list[int]) -> list[int]:
        """Cache restored host blocks: `blocks[d]` at depth d of `path` (a path from the root;
        negative entries attach nothing), with their Stored events. A position already holding a
        block keeps it. Returns the blocks attached."""
        moves: list[tuple[int, object]] = []
        ids = array.array("i", blocks)
        attached, _ = self.tree.insert(self.index, path, (ROOT, -1), n_blocks, n_blocks, ids, lambda d, b: None)
        if attached and self.events is not None:
            self._emit_stored(attached, moves, None, n_blocks * self.tokens_per_block)
        return [b for _, b in attached]

    def _extend_own_leaf(self, seq: TrackedSequence, sw: SequenceWindow, pos: tuple[int, int], depth: int) -> int:
        """A decode step's store: the sequence's block `depth`, one new full block, attached
        right after `pos` (where its block `depth - 1` is) when that position ends a leaf run
        that can grow in place (`RadixTree.extend_leaf`: what `insert` does there, without its
        walk); the cursor moves on. Returns the block, or NO_BLOCK (nothing changed: `insert`
        must do it)."""
        if seq.extra_ids is not None or seq.mm_items:
            return NO_BLOCK
        tpb, tree = self.tokens_per_block, self.tree
        node, o = pos
        b = sw.blocks[0][depth]
        content = seq.units(depth * tpb, (depth + 1) * tpb)
        if not tree.extend_leaf(self.index, node, o, seq.signature, content, b):
            return NO_BLOCK
        self.set_cursor(sw, StoreCursor(node, tree.pid[node] + o + 1, depth + 1), own=True)
        return b

    def store_new_full_blocks(self, seqs: list[TrackedSequence], counts: list[int]) -> None:
        """`store(seq, count, allow_partial=False)` of each, in order. A decode step's usual
        row (one new full block after its cursor, at the end of its own leaf run; no
        retention wishes) is attached here, and the rows' priorities are written together,
        then their Stored events made in one loop, in row order; any other row goes through
        `store`, after the events of the rows before it."""
        tpb, idx, locate = self.tokens_per_block, self.index, self.tree.locate
        done: list[int] = []  # blocks attached here, their default priority not yet written
        emit: list[tuple[TrackedSequence, int, int, int]] | None = None if self.events is None else []
        for seq, n in zip(seqs, counts, strict=True):
            sw = seq.windows[idx]
            cur = sw.cursor
            if cur is not None and n // tpb == cur.full_blocks + 1 and seq.retention is None:
                pos = locate(cur.node, cur.pid)
                if pos is not None:
                    b = self._extend_own_leaf(seq, sw, pos, cur.full_blocks)
                    if b >= 0:
                        done.append(b)
                        if emit is not None:
                            emit.append((seq, cur.full_blocks, b, n))
                        continue
            if done:
                self._settle_attached(done, emit)
                done = []
            self.store(seq, sw, n, False)
        if done:
            self._settle_attached(done, emit)

    def _settle_attached(self, blocks: list[int], emit: list | None) -> None:
        """The default priority of blocks `store_new_full_blocks` attached, then their Stored
        events (`emit` is emptied)."""
        self.queues.set_default_retention(blocks)
        if emit:
            self._emit_decode_blocks(emit)
            emit.clear()

    def _emit_stored(
        self, attached: list[tuple[int, int]], moves: list, seq: TrackedSequence | None, num_tokens: int
    ) -> None:
        """Stored events, one per run of consecutive newly stored depths under one parent; a
        moved block's Removed comes before the run that stores it again (as it happened).
        A run is hashed and built node by node (one pass per node). `seq`: the sequence when
        its blocks carry no extra ids: the usual events take each block's tokens from it (its
        list, or its row of the token store) instead of decoding the tree's bytes."""
        tree, events = self.tree, self.events
        assert events is not None  # called only with events on
        tpb = self.tokens_per_block
        if len(attached) == 1 and not moves:  # a decode block
            d, b = attached[0]
            if seq is not None:
                self._emit_decode_blocks([(seq, d, b, num_tokens)])
                return
            n = self.block_node[b]
            parent, h, block_tokens = tree.event_one(n, tree.block_offset[self.index][b], True)
            assert block_tokens is not None
            events.stored_one(
                self.window, parent, h, block_tokens, tree.signatures[tree.sig[n]][1], self.columns.level[b],
                self.queues.priority[b], tree.mm.get(n, ()),
            )  # fmt: skip
            return
        bnode, boff = self.block_node, tree.block_offset[self.index]
        (d0, b0), (d1, b1) = attached[0], attached[-1]
        n, o = bnode[b0], boff[b0]
        if not moves and d1 - d0 == len(attached) - 1 and bnode[b1] == n and boff[b1] - o == d1 - d0:
            # the usual store (a new context): one run of consecutive positions of
            # one node (a path passes a node once, so its first and last block tell)
            parent, hashes, run_tokens = tree.event_run(n, o, len(attached), seq is None)
            level_of, prio_of = self.columns.level, self.queues.priority
            levels, prios = [level_of[b] for _, b in attached], [prio_of[b] for _, b in attached]
            lora, mm = tree.signatures[tree.sig[n]][1], tree.mm.get(n, ())
            if seq is not None:  # columns: the run's tokens in one tuple (a partial last block ends the run)
                tokens = tuple(seq.token_list(d0 * tpb, min(num_tokens, (d1 + 1) * tpb)))
                columns = new_columns((tuple(hashes), tokens, tpb, lora, tuple(levels), tuple(prios), mm))
                events.stored_columns(self.window, parent, columns)
            else:  # (token, extra id) pairs: records
                assert run_tokens is not None
                blocks: list = []
                add_stored_blocks(blocks, hashes, run_tokens, lora, levels, prios, mm)
                events.stored(self.window, parent, tuple(blocks))
        else:
            self._emit_stored_runs(attached, moves)

    def _emit_decode_blocks(self, rows: list[tuple[TrackedSequence, int, int, int]]) -> None:
        """The Stored event of each row's one new block, in order: (sequence, depth, block,
        the sequence's stored token count), the sequence's blocks carrying no extra ids (each
        block's tokens come from it). One loop for a decode step's rows keeps the hashing
        code warm between them."""
        tree, events, window = self.tree, self.events, self.window
        assert events is not None  # called only with events on
        tpb = self.tokens_per_block
        bnode, boff = self.block_node, tree.block_offset[self.index]
        level, prio = self.columns.level, self.queues.priority
        sig, signatures, mm = tree.sig, tree.signatures, tree.mm
        event_one, stored = tree.event_one, events.stored_columns
        for seq, d, b, num_tokens in rows:
            n = bnode[b]
            parent, h, _ = event_one(n, boff[b], False)
            tokens = tuple(seq.token_list(d * tpb, min(d * tpb + tpb, num_tokens)))
            lora = signatures[sig[n]][1]
            stored(window, parent, new_columns(((h,), tokens, tpb, lora, (level[b],), (prio[b],), mm.get(n, ()))))

    def _emit_stored_runs(self, attached: list[tuple[int, int]], moves: list) -> None:
        """`_emit_stored` of several runs, or of runs over several nodes, or with moves."""
        tree, window = self.tree, self.window
        bnode, boff = self.block_node, tree.block_offset[self.index]
        events = self.events
        assert events is not None  # called only with events on
        level, prio = self.columns.level, self.queues.priority
        sig, signatures, mm = tree.sig, tree.signatures, tree.mm
        pending_moves = list(moves)
        i, count = 0, len(attached)
        while i < count:
            j = i + 1
            while j < count and attached[j][0] == attached[j - 1][0] + 1:
                j += 1
            last_depth = attached[j - 1][0]
            while pending_moves and pending_moves[0][0] <= last_depth:
                events.removed(window, pending_moves.pop(0)[1])
            blocks: list = []
            first = True
            while i < j:  # consecutive positions of one path, node by node
                b = attached[i][1]
                n = bnode[b]
                k = i + 1
                while k < j and bnode[attached[k][1]] == n:
                    k += 1
                parent, hashes, tokens = tree.event_run(n, boff[b], k - i)
                assert tokens is not None
                if first:
                    parent_hash, first = parent, False
                run = [b for _, b in attached[i:k]]
                levels, prios = [level[b] for b in run], [prio[b] for b in run]
                add_stored_blocks(blocks, hashes, tokens, signatures[sig[n]][1], levels, prios, mm.get(n, ()))
                i = k
            events.stored(window, parent_hash, tuple(blocks))
        for _, h in pending_moves:
            events.removed(window, h)

