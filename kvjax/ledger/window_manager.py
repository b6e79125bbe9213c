"""`WindowBlockManager`: the blocks, free queues and allocation rules of one attention window.

It owns block ids `0..P-1` (primary memory) and `P..P+S-1` (secondary memory), the eviction
policy over them, and the per-window half of every ledger decision: allocate (evict or
offload a victim), onboard, partial copy, store into the shared tree, release, and the
sliding-window detach. Every byte movement it decides goes to the shared `TransferRecorder`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvjax.config import DEFAULT_PRIORITY, CacheConfig
from kvjax.ledger.block import PLACEHOLDER_BLOCK_ID, PRIMARY, SECONDARY, Block
from kvjax.ledger.block_key import BlockKey
from kvjax.ledger.eviction import LRUEvictionPolicy
from kvjax.ledger.events import StoredBlock
from kvjax.ledger.radix_tree import TokenRun
from kvjax.ledger.stats import Counters
from kvjax.ledger.transfer_plan import TransferKind, TransferRecorder

if TYPE_CHECKING:
    from kvjax.ledger.events import KVCacheEventManager
    from kvjax.ledger.radix_tree import RadixNode, UnifiedBlockTree
    from kvjax.ledger.sequence import Sequence, SequenceWindow

_new_key = tuple.__new__
_OFFLOAD = int(TransferKind.OFFLOAD)
_ONBOARD = int(TransferKind.ONBOARD)
_COPY = int(TransferKind.COPY)


class WindowBlockManager:
    def __init__(
        self,
        index: int,
        window: int,
        config: CacheConfig,
        tree: UnifiedBlockTree,
        recorder: TransferRecorder,
        events: KVCacheEventManager | None,
        clock: Callable[[], float],
    ) -> None:
        self.index = index
        self.window = window
        self.tokens_per_block = config.tokens_per_block
        self.is_swa = config.is_swa(window)
        self.num_primary = config.primary_blocks_for(window)
        self.num_secondary = config.secondary_blocks_for(window)
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
        self.blocks = [Block(i, window, i, PRIMARY) for i in range(self.num_primary)]
        self.blocks += [Block(self.num_primary + j, window, j, SECONDARY) for j in range(self.num_secondary)]
        self.placeholder = Block(PLACEHOLDER_BLOCK_ID, window, self.null_slot, PRIMARY, placeholder=True)
        self.policy = LRUEvictionPolicy(
            [self.blocks[: self.num_primary], self.blocks[self.num_primary :]],
            config.secondary_offload_min_priority,
            clock,
        )
        self.counters = Counters()
        if events is not None:
            events.created(window, self.num_primary, self.num_secondary)

    # ------------------------------------------------------------------ counts
    @property
    def num_free_primary(self) -> int:
        return self.policy.num_free[PRIMARY]

    @property
    def num_free_secondary(self) -> int:
        return self.policy.num_free[SECONDARY]

    # ------------------------------------------------------------------ tree helpers
    def is_leaf(self, block: Block) -> bool:
        """No child position holds a block of this window (its content is nobody's prefix)."""
        node = block.node
        if node is None:
            return True
        w = self.window
        for child in node.children.values():
            if w in child.blocks:
                return False
        return True

    def drop_cached(self, block: Block, evicted: bool = True) -> None:
        """Take `block`'s content out of the tree (true priority eviction: only this block;
        its descendants keep their own queue positions)."""
        node = block.node
        if self.events is not None:
            self.events.removed(self.window, self.tree.node_hash(node))
        del node.blocks[self.window]
        block.node = None
        if not node.blocks and not node.children:
            self.tree._prune(node)
        if evicted:
            self.counters.evicted += 1

    # ------------------------------------------------------------------ allocation
    def get_free_block(self, priority: int | None, duration: float | None) -> Block:
        """Claim a primary block: the policy's victim, whose cached content is offloaded to a
        free secondary block when its priority allows, else evicted."""
        policy = self.policy
        victim, can_offload = policy.pop_victim(PRIMARY)  # raises OutOfBlocksError when empty
        c = self.counters
        c.alloc_total += 1
        if victim.node is None:
            c.alloc_new += 1
            block = victim
        elif can_offload and self.offload_enabled and policy.num_free[SECONDARY]:
            spare, _ = policy.pop_victim(SECONDARY)
            if spare.node is not None:
                self.drop_cached(spare)
            self.recorder.record(_OFFLOAD, self.pools, victim.slot, spare.slot, self.tokens_per_block)
            victim.swap_memory(spare)
            policy.push(victim)  # same priority and pending expiry, now in the secondary queues
            c.offloaded += 1
            c.offload_bytes += self.block_bytes
            if self.events is not None:
                self.events.updated(self.window, self.tree.node_hash(victim.node), cache_level=(PRIMARY, SECONDARY))
            block = spare
        else:
            self.drop_cached(victim)
            block = victim
        block.heap_token += 1  # cancels any pending expiry
        block.expiry = None
        block.priority = DEFAULT_PRIORITY if priority is None else priority
        block.duration = duration
        return block

    def take_fresh(self, count: int, retention: list[tuple[int | None, float | None]] | None) -> list[Block]:
        """`count` blocks from `get_free_block`, each referenced once; `retention` holds each
        one's (priority, duration) (None: default priority, no duration)."""
        get = self.get_free_block
        out = [get(None, None) for _ in range(count)] if retention is None else [get(p, d) for p, d in retention]
        for blk in out:
            blk.ref_count = 1
        return out

    def onboard(self, block: Block) -> None:
        """Bring a claimed secondary block back to primary memory (swap with a fresh block)."""
        target = self.get_free_block(DEFAULT_PRIORITY, None)
        self.recorder.record(_ONBOARD, self.pools, block.slot, target.slot, self.tokens_per_block)
        block.swap_memory(target)
        self.policy.release(target)  # now owns secondary memory: back to the secondary queues
        c = self.counters
        c.onboarded += 1
        c.onboard_bytes += self.block_bytes
        if self.events is not None and block.node is not None:
            self.events.updated(self.window, self.tree.node_hash(block.node), cache_level=(SECONDARY, PRIMARY))

    def copy_prefix(self, src: Block, num_tokens: int, priority: int | None, duration: float | None) -> Block:
        """A fresh primary block holding the first `num_tokens` tokens of `src` (partial reuse)."""
        dst = self.get_free_block(priority, duration)
        kind = _COPY if src.level == PRIMARY else _ONBOARD
        self.recorder.record(kind, self.pools, src.slot, dst.slot, num_tokens)
        c = self.counters
        c.copied += 1
        c.copy_bytes += self.block_bytes * num_tokens // self.tokens_per_block
        return dst

    def set_priority(self, block: Block, priority: int) -> None:
        """Re-prioritise a matched cached block (a request stating no priority keeps the block's
        own, so a high-priority system prompt stays high); emits an Updated event."""
        if self.events is not None and block.node is not None:
            self.events.updated(self.window, self.tree.node_hash(block.node), priority=(block.priority, priority))
        block.priority = priority

    # ------------------------------------------------------------------ sequence block lists
    def extend_blocks(self, sw: SequenceWindow, blocks: list[Block], beam: int | None = None) -> None:
        """Append referenced blocks (or placeholders) to one beam, or with `beam=None` share them
        with every beam. Slots are mirrored for block tables (placeholders -> null slot)."""
        slots = [b.slot for b in blocks]
        if beam is not None:
            sw.beams[beam].extend(blocks)
            sw.slots[beam].extend(slots)
            return
        for b in range(len(sw.beams)):
            sw.beams[b].extend(blocks)
            sw.slots[b].extend(slots)

    def release_block(self, block: Block, to_front: bool = False) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            self.policy.release(block, to_front)

    def release_sequence(self, sw: SequenceWindow) -> None:
        """Drop the sequence's references, last block first (so LRU evicts tails first)."""
        beams = sw.beams
        if len(beams) == 1:
            freed = []
            for blk in reversed(beams[0]):
                if blk.placeholder:
                    continue
                rc = blk.ref_count - 1
                blk.ref_count = rc
                if rc == 0:
                    freed.append(blk)
            self.policy.release_many(freed)
            return
        for pos in range(len(beams[0]) - 1, -1, -1):
            seen = []
            for b in range(len(beams) - 1, -1, -1):
                blk = beams[b][pos]
                if blk.placeholder or any(blk is s for s in seen):
                    continue
                seen.append(blk)
                self.release_block(blk)

    def detach_front_block(self, sw: SequenceWindow) -> None:
        """Sliding window: the front block left the window; release it, keep a placeholder."""
        pos = sw.num_front_removed
        seen = []
        for b, beam in enumerate(sw.beams):
            blk = beam[pos]
            if not blk.placeholder and not any(blk is s for s in seen):
                seen.append(blk)
                self.release_block(blk)
            beam[pos] = self.placeholder
            sw.slots[b][pos] = self.null_slot
        sw.num_front_removed = pos + 1

    # ------------------------------------------------------------------ storing for reuse
    def store(self, seq: Sequence, sw: SequenceWindow, num_tokens: int, allow_partial: bool) -> int:
        """Attach the sequence's blocks covering its first `num_tokens` tokens to the tree.

        Positions whose key is already cached keep the cached block (ours is a duplicate and
        stays private). Returns how many blocks were newly stored. Full blocks advance a per-sequence
        cursor so repeated calls only walk new blocks.
        """
        tpb = self.tokens_per_block
        n_full = num_tokens // tpb
        n_blocks = n_full + (1 if allow_partial and num_tokens % tpb else 0)
        node = sw.store_node
        depth = sw.store_depth
        if node is None or not node.attached:
            node, depth = self.tree.root, 0
        if depth >= n_blocks:
            return 0
        tree = self.tree
        w = self.window
        beam0 = sw.beams[0]
        events = self.events
        stored = 0
        run: list[Block] = []
        run_parent: RadixNode | None = None
        tokens = seq.tokens
        plain = seq.extra_ids is None and not seq.mm_items
        lora, salt = seq.lora_task_id, seq.salt_id
        token_run = TokenRun(tuple(tokens[depth * tpb : num_tokens]), (lora, salt), depth * tpb) if plain else None
        prev_created = None
        for d in range(depth, n_blocks):
            start = d * tpb
            end = start + tpb
            if end > num_tokens:
                end = num_tokens
            if plain:
                key = _new_key(BlockKey, (tuple(tokens[start:end]), None, lora, salt, ()))
            else:
                key = seq.key(start, end)
            child = node.children.get(key)
            if child is None:
                child = tree.get_or_create_child(node, key)
                if token_run is not None:
                    child.run = token_run
                    if prev_created is node:
                        node.next_in_run = child
                prev_created = child
            blk = beam0[d]
            if not blk.placeholder and w not in child.blocks:
                if blk.node is not None:  # a regrown partial block: its old key leaves the tree
                    self.drop_cached(blk, evicted=False)
                child.blocks[w] = blk  # tree.attach, inlined: the slot is known to be empty
                blk.node = child
                if seq.retention is None:
                    blk.priority, blk.duration = DEFAULT_PRIORITY, None
                else:
                    prio, blk.duration = seq.block_priority(d, tpb)
                    blk.priority = DEFAULT_PRIORITY if prio is None else prio
                stored += 1
                if events is not None:
                    if not run:
                        run_parent = node
                    run.append(blk)
            elif run:
                self._emit_stored(run_parent, run)
                run = []
            node = child
            if d + 1 == n_full:
                sw.store_node, sw.store_depth = child, n_full
        if run:
            self._emit_stored(run_parent, run)
        if not node.blocks and not node.children:  # trailing placeholder-only position
            tree._prune(node)
        return stored

    def _emit_stored(self, parent: RadixNode, blocks: list[Block]) -> None:
        node_hash = self.tree.node_hash
        parent_hash = None if parent.parent is None else node_hash(parent)
        self.events.stored(
            self.window,
            parent_hash,
            [
                StoredBlock(
                    node_hash(b.node),
                    b.node.key.tokens if b.node.key.extra_ids is None else tuple(zip(b.node.key.tokens, b.node.key.extra_ids)),
                    b.node.key.lora_task_id,
                    b.level,
                    b.priority,
                    b.node.key.mm_keys,
                )
                for b in blocks
            ],
        )
