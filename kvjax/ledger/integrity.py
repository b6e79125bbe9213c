"""Ledger invariants (`verify_integrity`) and a full state snapshot for atomicity tests.

The ledger must never leak or double-count a block: every block is either referenced (its
ref count equals the live sequences holding it plus pins) or sits in exactly one free queue
of its cache level; slots form a permutation per level; the tree's links agree both ways.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvjax.errors import IntegrityError
from kvjax.ledger.block import NOT_FREE, PRIMARY, SECONDARY
from kvjax.ledger.block_key import partial_index_key

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager


def _fail(msg: str) -> None:
    raise IntegrityError(msg)


def verify_ledger(bm: BlockManager, seqs: dict) -> None:
    tpb = bm.tokens_per_block
    for wm in bm.windows:
        w = wm.window
        refs: Counter = Counter()
        for rid, seq in seqs.items():
            sw = seq.windows[wm.index]
            n_expected = -(-seq.num_tokens // tpb)
            lengths = {len(beam) for beam in sw.beams}
            if lengths != {n_expected}:
                _fail(f"window {w}: request {rid!r} has block lists of lengths {lengths}, expected {n_expected}")
            for b, beam in enumerate(sw.beams):
                slots = list(sw.slots[b])
                for pos, blk in enumerate(beam):
                    if blk.placeholder:
                        if blk is not wm.placeholder:
                            _fail(f"window {w}: request {rid!r} holds a foreign placeholder")
                        if pos >= sw.num_front_removed:
                            _fail(f"window {w}: request {rid!r} has a placeholder at {pos} past the detached prefix")
                        if slots[pos] != wm.null_slot:
                            _fail(f"window {w}: placeholder of {rid!r} at {pos} has slot {slots[pos]}")
                        continue
                    if pos < sw.num_front_removed:
                        _fail(f"window {w}: request {rid!r} holds a real block inside its detached prefix")
                    if wm.blocks[blk.block_id] is not blk:
                        _fail(f"window {w}: request {rid!r} holds a block of another manager")
                    if blk.level != PRIMARY:
                        _fail(f"window {w}: request {rid!r} references secondary block {blk.block_id}")
                    if slots[pos] != blk.slot:
                        _fail(f"window {w}: slot row of {rid!r} says {slots[pos]} at {pos}, block {blk.block_id} owns {blk.slot}")
            for blk in sw.unique_blocks():
                refs[blk] += 1
        policy = wm.policy
        seen_free = set()
        for level in (PRIMARY, SECONDARY):
            total = 0
            mask = 0
            for prio, q in enumerate(policy.queues[level]):
                if q:
                    mask |= 1 << prio
                for blk in q:
                    total += 1
                    if blk.block_id in seen_free:
                        _fail(f"window {w}: block {blk.block_id} is in two free queues")
                    seen_free.add(blk.block_id)
                    if wm.blocks[blk.block_id] is not blk:
                        _fail(f"window {w}: a free queue holds a foreign block")
                    if blk.free_level != level or blk.free_priority != prio:
                        _fail(f"window {w}: block {blk.block_id} queued at ({level},{prio}) but records ({blk.free_level},{blk.free_priority})")
                    if blk.level != level:
                        _fail(f"window {w}: block {blk.block_id} at level {blk.level} sits in level-{level} queue")
                    if blk.priority != prio:
                        _fail(f"window {w}: block {blk.block_id} has priority {blk.priority} but sits in queue {prio}")
            if total != policy.num_free[level]:
                _fail(f"window {w}: level {level} counts {policy.num_free[level]} free blocks, queues hold {total}")
            if mask != policy.nonempty[level]:
                _fail(f"window {w}: level {level} non-empty mask is stale")
        for blk in wm.blocks:
            if blk.pin_count < 0:
                _fail(f"window {w}: block {blk.block_id} has negative pins")
            if blk.ref_count != refs[blk] + blk.pin_count:
                _fail(f"window {w}: block {blk.block_id} ref_count {blk.ref_count} != {refs[blk]} sequence refs + {blk.pin_count} pins")
            if blk.ref_count == 0 and blk.block_id not in seen_free:
                _fail(f"window {w}: block {blk.block_id} is unreferenced but in no free queue (leak)")
            if blk.ref_count > 0 and blk.free_level != NOT_FREE:
                _fail(f"window {w}: block {blk.block_id} is referenced and free at once")
            if blk.node is not None and (not blk.node.attached or blk.node.blocks.get(w) is not blk):
                _fail(f"window {w}: block {blk.block_id} points at a tree node that does not hold it")
        for level, count in ((PRIMARY, wm.num_primary), (SECONDARY, wm.num_secondary)):
            slots = sorted(b.slot for b in wm.blocks if b.level == level)
            if slots != list(range(count)):
                _fail(f"window {w}: level-{level} slots are not a permutation of 0..{count - 1}")
    _verify_tree(bm)
    _verify_bounds(bm)


def _verify_tree(bm: BlockManager) -> None:
    from kvjax.ledger import radix_tree

    if radix_tree._EMPTY:
        _fail("the shared empty child map was mutated")
    tree = bm.tree
    managers = {wm.window: wm for wm in bm.windows}
    count = 0
    stack = [tree.root]
    while stack:
        node = stack.pop()
        if node.parent is not None:
            count += 1
            if not node.blocks and not node.children:
                _fail(f"empty tree node left unpruned at depth {node.depth}")
        buckets: dict = {}
        for key, child in node.children.items():
            if child.key != key or child.parent is not node or not child.attached:
                _fail(f"tree link broken under depth {node.depth}")
            if child.depth != node.depth + 1:
                _fail("tree depth inconsistent")
            bk = partial_index_key(key)
            if bk is not None:
                buckets.setdefault(bk, set()).add(child)
            stack.append(child)
        if node.partial_index is not None and {k: set(v) for k, v in node.partial_index.items()} != buckets:
            _fail(f"partial-match index stale at depth {node.depth}")
        for w, blk in node.blocks.items():
            if w not in managers or managers[w].blocks[blk.block_id] is not blk:
                _fail(f"tree node holds a foreign block for window {w}")
            if blk.node is not node or blk.window != w:
                _fail(f"block {blk.block_id} of window {w} does not point back at its node")
    if count != tree.num_nodes:
        _fail(f"tree counts {tree.num_nodes} nodes, walk found {count}")


def _verify_bounds(bm: BlockManager) -> None:
    """What must stay bounded by the pools: the expiry heaps, and no live node may keep a
    pruned one (and through it the rest of a dead run) alive."""
    for wm in bm.windows:
        if wm.policy.heap_size > wm.policy.heap_limit:
            _fail(f"window {wm.window}: expiry heap holds {wm.policy.heap_size} entries, limit {wm.policy.heap_limit}")
    for node in bm.tree.iter_nodes():
        nxt = node.next_in_run
        if nxt is not None and (not nxt.attached or nxt.parent is not node):
            _fail(f"a tree node at depth {node.depth} links a pruned or foreign node as its run successor")


def ledger_snapshot(bm: BlockManager, seqs: dict) -> tuple:
    out = []
    for wm in bm.windows:
        blocks = tuple(
            (b.block_id, b.slot, b.level, b.ref_count, b.pin_count, b.priority, b.duration, b.expiry, b.free_level, b.free_priority)
            for b in wm.blocks
        )
        queues = tuple(tuple(tuple(b.block_id for b in q) for q in level) for level in wm.policy.queues)
        out.append((wm.window, blocks, queues, wm.counters.as_tuple(), tuple(wm.policy.num_free)))
    nodes = []
    stack = [(bm.tree.root, ())]
    while stack:
        node, path = stack.pop()
        if node.parent is not None:
            nodes.append((path, tuple(sorted((w, b.block_id) for w, b in node.blocks.items()))))
        for key, child in node.children.items():
            stack.append((child, path + (key,)))
    sequences = tuple(
        (
            repr(rid),
            tuple(seq.tokens),
            seq.num_tokens,
            seq.context_position,
            tuple(
                (tuple(tuple(b.block_id for b in beam) for beam in sw.beams), tuple(tuple(s) for s in sw.slots), sw.num_front_removed)
                for sw in seq.windows
            ),
        )
        for rid, seq in seqs.items()
    )
    events = bm.events.state() if bm.events is not None else ()
    return (tuple(out), tuple(sorted(nodes, key=repr)), sequences, len(bm.recorder), events)
