"""Ledger invariants (`verify_integrity`) and a full state snapshot for atomicity tests.

The ledger must never leak or double-count a block: every block is either referenced (its
ref count equals the live sequences holding it plus pins) or sits in exactly one free queue
of its cache level; slots form a permutation per level; the tree's links agree both ways; and
what may grow (the expiry heap, the tree's node table) stays bounded by the pools.
"""
from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import TYPE_CHECKING

from kvjax._math import ceil_div
from kvjax.errors import IntegrityError
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID, PRIMARY, SECONDARY
from kvjax.ledger.free_queues import NOT_FREE, NUM_PRIORITIES
from kvjax.ledger.radix_tree import NO_BLOCK, ROOT
from kvjax.ledger.token_path import child_key

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences


def _fail(msg: str) -> None:
    raise IntegrityError(msg)


def verify_ledger(bm: BlockManager, live: LiveSequences) -> None:  # noqa: C901 - split next
    tpb = bm.tokens_per_block
    seqs, tokens, listed = live.seqs, live.tok, live.listed
    tokens.verify({rid: seq.row for rid, seq in seqs.items() if seq.tokens is None})
    if listed.keys() != {rid for rid, seq in seqs.items() if seq.tokens is not None} or not all(
        seqs.get(rid) is seq for rid, seq in listed.items()
    ):
        _fail("the sequences keeping their tokens as a list are not the ones the manager files")
    for rid, seq in seqs.items():
        limit = bm.fast_limit(seq)
        if seq.tokens is not None:
            if seq.limit != limit or seq.row != -1:
                _fail(f"request {rid!r}: its token list has a stale limit, or it also holds a token-store row")
        elif seq.limit != 0 or tokens.limit[seq.row] != limit:
            _fail(f"request {rid!r}: its token-store row has a stale limit")
        if not seq.is_cross and seq.num_tokens < seq.prompt_len:
            _fail(f"request {rid!r} holds fewer tokens than its prompt")
    for wm in bm.windows:
        w = wm.window
        refs: Counter = Counter()
        slot_col, level_col = wm.columns.slot, wm.columns.level
        slot_table = wm.slot_table
        slot_table.verify((rid, seq.windows[wm.index].rows or []) for rid, seq in seqs.items())
        for rid, seq in seqs.items():
            sw = seq.windows[wm.index]
            n_expected = ceil_div(seq.num_tokens, tpb)
            lengths = {len(beam) for beam in sw.blocks}
            if lengths != {n_expected}:
                _fail(f"window {w}: request {rid!r} has block lists of lengths {lengths}, expected {n_expected}")
            if sw.rows is not None and len(sw.rows) != len(sw.blocks):
                _fail(f"window {w}: request {rid!r} has {len(sw.blocks)} beams but {len(sw.rows)} slot-table rows")
            for b, beam in enumerate(sw.blocks):
                slots = slot_table.row(sw, b).tolist()
                if len(slots) != len(beam):
                    _fail(f"window {w}: request {rid!r} beam {b} has {len(beam)} blocks but {len(slots)} slots")
                for pos, blk in enumerate(beam):
                    if blk == PLACEHOLDER_BLOCK_ID:
                        if pos >= sw.num_front_removed:
                            _fail(f"window {w}: request {rid!r} has a placeholder at {pos} past the detached prefix")
                        if slots[pos] != wm.null_slot:
                            _fail(f"window {w}: placeholder of {rid!r} at {pos} has slot {slots[pos]}")
                        continue
                    if pos < sw.num_front_removed:
                        _fail(f"window {w}: request {rid!r} holds a real block inside its detached prefix")
                    if not 0 <= blk < wm.num_blocks:
                        _fail(f"window {w}: request {rid!r} holds block id {blk}, not one of this manager's")
                    if level_col[blk] != PRIMARY:
                        _fail(f"window {w}: request {rid!r} references secondary block {blk}")
                    if slots[pos] != slot_col[blk]:
                        _fail(f"window {w}: slot row of {rid!r} says {slots[pos]} at {pos}, block {blk} owns {slot_col[blk]}")
            if sw.rows is not None and len(sw.rows) == 1:
                _verify_store_hint(bm, wm, rid, seq, sw)
            for blk in sw.unique_blocks():
                refs[blk] += 1
        _verify_queues(wm)
        ref, pin, queue = wm.refs.ref, wm.refs.pin, wm.queues.queue
        for blk in range(wm.num_blocks):
            if pin[blk] < 0:
                _fail(f"window {w}: block {blk} has negative pins")
            if ref[blk] != refs[blk] + pin[blk]:
                _fail(f"window {w}: block {blk} ref_count {ref[blk]} != {refs[blk]} sequence refs + {pin[blk]} pins")
            if ref[blk] == 0 and queue[blk] == NOT_FREE:
                _fail(f"window {w}: block {blk} is unreferenced but in no free queue (leak)")
            if ref[blk] > 0 and queue[blk] != NOT_FREE:
                _fail(f"window {w}: block {blk} is referenced and free at once")
        for level, count in ((PRIMARY, wm.num_primary), (SECONDARY, wm.num_secondary)):
            slots = sorted(slot_col[b] for b in range(wm.num_blocks) if level_col[b] == level)
            if slots != list(range(count)):
                _fail(f"window {w}: level-{level} slots are not a permutation of 0..{count - 1}")
    _verify_tree(bm)


def _verify_store_hint(bm: BlockManager, wm, rid, seq, sw) -> None:
    """A nonzero store hint (`WindowBlockManager.set_cursor`) is the cursor's, in a
    full-attention window, and the cursor's position still holds the sequence's own block."""
    due = int(wm.slot_table.store_due[sw.rows[0]])
    if due == 0:
        return
    cur = sw.cursor
    w = wm.window
    if cur is None or wm.is_swa or due != (cur.full_blocks + 1) * bm.tokens_per_block:
        _fail(f"window {w}: request {rid!r} has store hint {due} for cursor {cur}")
    found = wm.cursor_position(seq, sw)  # where the position is now (a split may have moved it)
    own = sw.blocks[0][cur.full_blocks - 1]
    row = None if found is None else bm.tree.values[wm.index][found[0][0]]
    if row is None or row[found[0][1]] != own:
        _fail(f"window {w}: the store hint of request {rid!r} trusts cursor {cur}, whose position lost block {own}")


def _verify_queues(wm) -> None:
    """Every free block sits in exactly the queue it records, the lists link both ways, and
    the counts, masks and retention agree."""
    q = wm.queues
    w = wm.window
    n = q.num_blocks
    seen = set()
    for level in (PRIMARY, SECONDARY):
        total = 0
        mask = 0
        for prio in range(NUM_PRIORITIES):
            s = n + level * NUM_PRIORITIES + prio
            prev = s
            b = q.next[s]
            while b != s:
                if not 0 <= b < n:
                    _fail(f"window {w}: free queue ({level},{prio}) links to {b}, not a block")
                if b in seen:
                    _fail(f"window {w}: block {b} is in two free queues (or a queue loops)")
                seen.add(b)
                if q.prev[b] != prev:
                    _fail(f"window {w}: free queue ({level},{prio}) links are not symmetric at block {b}")
                if q.queue[b] != level * NUM_PRIORITIES + prio:
                    _fail(f"window {w}: block {b} queued at ({level},{prio}) but records queue {q.queue[b]}")
                if wm.columns.level[b] != level:
                    _fail(f"window {w}: block {b} at level {wm.columns.level[b]} sits in level-{level} queue")
                if q.priority[b] != prio:
                    _fail(f"window {w}: block {b} has priority {q.priority[b]} but sits in queue {prio}")
                total += 1
                prev = b
                b = q.next[b]
            if q.prev[s] != prev:
                _fail(f"window {w}: free queue ({level},{prio}) tail link is stale")
            if total and q.next[s] != s:
                mask |= 1 << prio
        if total != q.num_free[level]:
            _fail(f"window {w}: level {level} counts {q.num_free[level]} free blocks, queues hold {total}")
        if mask != q.nonempty[level]:
            _fail(f"window {w}: level {level} non-empty mask is stale")
    for b in range(n):
        if q.queue[b] != NOT_FREE and b not in seen:
            _fail(f"window {w}: block {b} records a free queue but none holds it")
    for b in q.armed:
        if q.queue[b] == NOT_FREE or b not in q.expiry:
            _fail(f"window {w}: block {b} has an expiry armed but is not free")
    if set(q.expiry) != set(q.armed):
        _fail(f"window {w}: expiry times and armed heap entries disagree")
    entries = set(q._heap)
    for b, c in q.armed.items():  # an armed expiry the heap lost would never fire
        if (q.expiry[b], c, b) not in entries:
            _fail(f"window {w}: block {b}'s armed expiry has no heap entry")
    if q.heap_size > q.heap_limit:
        _fail(f"window {w}: expiry heap holds {q.heap_size} entries, limit {q.heap_limit}")


def _verify_tree(bm: BlockManager) -> None:  # noqa: C901 - split next
    tree = bm.tree
    tpb = tree.tokens_per_block
    num_nodes = num_positions = 0
    stack = [ROOT]
    seen_nodes = set()
    held: list[dict[int, tuple[int, int]]] = [{} for _ in bm.windows]  # window index -> block -> (node, offset)
    id_ranges: list[tuple[int, int]] = []
    while stack:
        n = stack.pop()
        if n in seen_nodes:
            _fail(f"tree node {n} is reachable twice")
        seen_nodes.add(n)
        length = tree.length[n]
        kids = tree.children[n]
        if kids is not None and not kids:
            _fail(f"tree node {n} keeps an empty child map")
        if n != ROOT:
            num_nodes += 1
            num_positions += length
            content = tree.content[n]
            unit = tree.unit(n)
            if length < 1 or content is None:
                _fail(f"live tree node {n} has no positions")
            ntok = len(content) // unit  # a truncated node keeps its dropped positions' tokens
            if len(content) % unit or ntok <= (length - 1) * tpb:
                _fail(f"tree node {n}: {ntok} tokens do not fill {length} positions (only the last may be partial)")
            if not tree.pid[n] + length <= tree.pid_end[n] <= tree.next_pid:
                _fail(
                    f"tree node {n}: position ids [{tree.pid[n]}, {tree.pid[n] + length}) "
                    f"outside its range ending {tree.pid_end[n]}"
                )
            id_ranges.append((tree.pid[n], tree.pid_end[n]))
            if n in tree.mm and length != 1:
                _fail(f"tree node {n} holds a multimodal block inside a run of {length}")
            if tree.signatures[tree.sig[n]] is None or tree.sig_refs[tree.sig[n]] < 1:
                _fail(f"tree node {n} carries a released signature")
            if kids is not None and ntok < length * tpb:
                _fail(f"tree node {n} ends on a partial block but has children")
            hs = tree.hashes[n]
            if hs is not None and len(hs) != length:
                _fail(f"tree node {n}: {len(hs)} cached hashes for {length} positions")
        for widx, vals in enumerate(tree.values):
            row = vals[n]
            if n == ROOT:
                continue
            if row is None or len(row) != length:
                _fail(f"tree node {n}: window {bm.windows[widx].window} row does not cover its {length} positions")
            for o, b in enumerate(row):
                if b == NO_BLOCK:
                    continue
                if b in held[widx]:
                    _fail(f"block {b} of window {bm.windows[widx].window} sits at two tree positions")
                held[widx][b] = (n, o)
        if n != ROOT and kids is None:  # after the rows are known to cover the node's positions
            last = max((vals[n][length - 1] for vals in tree.values), default=NO_BLOCK)
            if last == NO_BLOCK:
                _fail(f"empty tree position left unpruned at the end of leaf node {n}")
        if kids:
            index = tree.pindex[n]
            buckets: dict[int, list] = {}
            for key, c in kids.items():
                if tree.parent[c] != n:
                    _fail(f"tree link broken under node {n}: child {c} names parent {tree.parent[c]}")
                if tree.depth[c] != tree.depth[n] + length:
                    _fail(f"tree node {c}: depth {tree.depth[c]} after a parent ending at {tree.depth[n] + length}")
                # `_first_key` reads these; the child's own checks come only when it is popped
                if tree.content[c] is None:
                    _fail(f"live tree node {c} has no positions")
                if tree.signatures[tree.sig[c]] is None:
                    _fail(f"tree node {c} carries a released signature")
                first, own_key = tree._first_key(c)
                if own_key != key:
                    _fail(f"tree node {c} is filed under a key that is not its first block")
                if c not in tree.mm:
                    buckets.setdefault(tree.sig[c], []).append(first)
                stack.append(c)
            if index is not None and {s: sorted(v) for s, v in buckets.items()} != {s: f.live() for s, f in index.items()}:
                _fail(f"partial-match index of tree node {n} is stale")
            if index is not None:
                _check_ages(tree, n, kids, buckets, index)
        elif tree.pindex[n]:
            _fail(f"leaf tree node {n} keeps a partial-match index")
    id_ranges.sort()
    for (_, end), (start, _) in pairwise(id_ranges):
        if start < end:
            _fail("two tree nodes own overlapping position ids")
    if num_nodes != tree.num_nodes or num_positions != tree.num_positions:
        _fail(f"tree counts {tree.num_nodes} nodes / {tree.num_positions} positions, walk found {num_nodes} / {num_positions}")
    for wm in bm.windows:
        bn, bo = tree.block_node[wm.index], tree.block_offset[wm.index]
        mine = held[wm.index]
        for b in range(wm.num_blocks):
            pos = mine.get(b)
            if pos is None:
                if bn[b] != NO_BLOCK:
                    _fail(f"window {wm.window}: block {b} points at a tree position that does not hold it")
            elif (bn[b], bo[b]) != pos:
                _fail(f"window {wm.window}: block {b} points at {(bn[b], bo[b])} but is held at {pos}")
    # bounded storage: every node id is live or free, free ones hold nothing
    capacity = len(tree.content)
    if len(tree.free_ids) + tree.num_nodes + 1 != capacity or len(set(tree.free_ids)) != len(tree.free_ids):
        _fail(f"tree node table: {capacity} ids, {tree.num_nodes} live + root, {len(tree.free_ids)} free")
    for n in tree.free_ids:
        if n in seen_nodes or tree.content[n] is not None or tree.children[n] is not None or tree.parent[n] != -1:
            _fail(f"free tree node {n} still holds data or is linked")
    live_sigs = Counter(tree.sig[n] for n in seen_nodes if n != ROOT)
    for sid, sig in enumerate(tree.signatures):
        if sig is None:
            continue
        if tree.sig_refs[sid] != live_sigs.get(sid, 0) + (sid == 0):
            _fail(f"signature {sig} counts {tree.sig_refs[sid]} nodes, {live_sigs.get(sid, 0)} carry it")



def _check_ages(tree, n: int, kids: dict, buckets: dict, index: dict) -> None:
    """Each partial-match bucket's age list holds its live keys in the order their children
    were made (dict order), with the right position ids, and counts its stale entries."""
    for sid, firsts in index.items():
        if len(firsts.births) != len(firsts.ages) or not 0 <= firsts.head <= len(firsts.ages):
            _fail(f"partial-match age list of tree node {n} is malformed")
        live, stale = [], 0
        for j, (first, birth) in enumerate(zip(firsts.ages, firsts.births, strict=True)):
            c = kids.get(child_key(sid, first, ()))
            if c is not None and tree.pid[c] == birth:
                if j < firsts.head:
                    _fail(f"partial-match age list of tree node {n} skips a live child")
                live.append(first)
            elif j >= firsts.head:
                stale += 1
        if live != buckets.get(sid, []) or stale != firsts.stale:
            _fail(f"partial-match age list of tree node {n} is out of step with its children")


def ledger_snapshot(bm: BlockManager, seqs: dict) -> tuple:
    """Per window (window, per-block tuples (id, slot, level, refs, pins, priority, duration,
    expiry, queue, tree node, offset), free queues, counters, free counts); the tree's nodes;
    per sequence (id, tokens, length, context position, per window (block ids per beam, slots
    per beam, detached prefix)); pending transfer ops; events; storing cursors."""
    out = []
    tree = bm.tree
    for wm in bm.windows:
        q, refs, cols = wm.queues, wm.refs, wm.columns
        bn, bo = tree.block_node[wm.index], tree.block_offset[wm.index]
        blocks = tuple(
            (b, cols.slot[b], cols.level[b], refs.ref[b], refs.pin[b], q.priority[b],
             q.duration.get(b), q.expiry.get(b), q.queue[b], bn[b], bo[b])
            for b in range(wm.num_blocks)
        )
        queues = tuple(tuple(q.free_blocks(level)) for level in (PRIMARY, SECONDARY))
        out.append((wm.window, blocks, queues, wm.counters.as_tuple(), tuple(q.num_free)))
    nodes = []
    for n in tree.iter_nodes():
        rows = tuple(tuple(vals[n]) for vals in tree.values)
        nodes.append((n, tree.parent[n], tree.pid[n], tree.content[n], rows, tree.mm.get(n)))
    sequences = tuple(
        (
            repr(rid),
            tuple(seq.token_list()),
            seq.num_tokens,
            seq.context_position,
            tuple(
                (tuple(tuple(b) for b in sw.blocks), tuple(map(tuple, wm.slot_table.slots(sw))), sw.num_front_removed)
                for wm, sw in zip(bm.windows, seq.windows, strict=True)
            ),
        )
        for rid, seq in seqs.items()
    )
    cursors = tuple(tuple(sw.cursor for sw in seq.windows) for seq in seqs.values())
    events = bm.events.state() if bm.events is not None else ()
    return (tuple(out), tuple(sorted(nodes)), sequences, len(bm.recorder), events, cursors)
