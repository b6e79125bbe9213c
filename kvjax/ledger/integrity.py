"""Ledger invariants (`verify_integrity`) and a full state snapshot for atomicity tests.

The ledger must never leak or double-count a block: every block is either referenced (its
ref count equals the live sequences holding it plus pins) or sits in exactly one free queue
of its cache level; slots form a permutation per level; the tree's links agree both ways; and
what may grow (the expiry heap, the tree's node table) stays bounded by the pools.

Each invariant has its own small check below, named for what it guards and run in a fixed
order (a corruption is reported by the first check it breaks), so an `IntegrityError` names
what broke. Every check is linear in the ledger's size.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, NoReturn

from kvjax._math import ceil_div
from kvjax.errors import IntegrityError
from kvjax.ledger import pending_tokens
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID, PRIMARY, SECONDARY
from kvjax.ledger.free_queues import NOT_FREE, NUM_PRIORITIES
from kvjax.ledger.radix_tree import NO_BLOCK, ROOT
from kvjax.ledger.tier3 import verify_tier3
from kvjax.ledger.token_path import child_key

if TYPE_CHECKING:
    from collections.abc import Hashable

    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences
    from kvjax.ledger.radix_tree import RadixTree
    from kvjax.ledger.sequence import SequenceWindow, TrackedSequence
    from kvjax.ledger.window_manager import WindowBlockManager


def _fail(msg: str) -> NoReturn:
    raise IntegrityError(msg)


# ------------------------------------------------------------------ the whole ledger
def verify_ledger(bm: BlockManager, live: LiveSequences) -> None:
    """Check every invariant of the ledger: sequences' token homes, then per window the slot
    table, each sequence's blocks, the free queues, reference counts and slots, then the tree."""
    _verify_token_homes(live)
    _verify_sequence_limits(bm, live)
    pending_tokens.verify(bm, live)
    for wm in bm.windows:
        _verify_window(bm, wm, live.seqs)
    _verify_tree(bm)
    verify_tier3(bm, _fail)


# ------------------------------------------------------------------ sequences
def _verify_token_homes(live: LiveSequences) -> None:
    """The token store holds exactly the rows of the sequences without a token list, and the
    sequences listed as keeping a token list are exactly (and identically) those that do."""
    seqs, listed = live.seqs, live.listed
    live.tok.verify({rid: seq.row for rid, seq in seqs.items() if seq.tokens is None})
    if listed.keys() != {rid for rid, seq in seqs.items() if seq.tokens is not None} or not all(
        seqs.get(rid) is seq for rid, seq in listed.items()
    ):
        _fail("the sequences keeping their tokens as a list are not the ones the manager files")


def _verify_sequence_limits(bm: BlockManager, live: LiveSequences) -> None:
    """Each sequence's fast-path token limit sits where its tokens live (and only there), and
    no self-attention sequence holds fewer tokens than its prompt."""
    limits = live.tok.limit
    for rid, seq in live.seqs.items():
        limit = 0 if rid in live.pending else bm.fast_limit(seq)
        if seq.tokens is not None:
            if seq.limit != limit or seq.row != -1:
                _fail(f"request {rid!r}: its token list has a stale limit, or it also holds a token-store row")
        elif seq.limit != 0 or limits[seq.row] != limit:
            _fail(f"request {rid!r}: its token-store row has a stale limit")
        if seq.num_tokens < seq.prompt_len:  # (a cross sequence holds exactly its encoder length)
            _fail(f"request {rid!r} holds fewer tokens than its prompt")


# ------------------------------------------------------------------ one window
def _verify_window(bm: BlockManager, wm: WindowBlockManager, seqs: dict[Hashable, TrackedSequence]) -> None:
    """One window: its slot table, each sequence's blocks and slots (counting the references
    they hold), its free queues, its reference counts, and its slot permutations."""
    wm.slot_table.verify((rid, seq.windows[wm.index].rows or []) for rid, seq in seqs.items())
    refs: Counter = Counter()
    for rid, seq in seqs.items():
        sw = seq.windows[wm.index]
        _verify_sequence_blocks(bm, wm, rid, seq, sw)
        refs.update(sw.unique_blocks())
    _verify_queues(wm)
    _verify_ref_counts(wm, refs)
    _verify_slot_permutations(wm)


def _verify_sequence_blocks(
    bm: BlockManager, wm: WindowBlockManager, rid: Hashable, seq: TrackedSequence, sw: SequenceWindow
) -> None:
    """A sequence's blocks in one window: list lengths and rows, then each beam's blocks
    against its slot-table row, then its store hint."""
    _verify_block_list_shape(bm, wm, rid, seq, sw)
    wm.verify_chain(seq, sw)  # the kind's own rules (a recurrent-state chain: placeholders anywhere)
    for b, beam in enumerate(sw.blocks):
        _verify_beam(wm, rid, sw, b, beam)
    if sw.rows is not None and len(sw.rows) == 1:
        _verify_store_hint(bm, wm, rid, seq, sw, sw.rows[0])


def _verify_block_list_shape(
    bm: BlockManager, wm: WindowBlockManager, rid: Hashable, seq: TrackedSequence, sw: SequenceWindow
) -> None:
    """Every beam holds one block per started block of tokens, and (once rows are handed out)
    each beam has its own slot-table row."""
    w = wm.window
    n_expected = ceil_div(seq.num_tokens, bm.tokens_per_block)
    lengths = {len(beam) for beam in sw.blocks}
    if lengths != {n_expected}:
        _fail(f"window {w}: request {rid!r} has block lists of lengths {lengths}, expected {n_expected}")
    if sw.rows is not None and len(sw.rows) != len(sw.blocks):
        _fail(f"window {w}: request {rid!r} has {len(sw.blocks)} beams but {len(sw.rows)} slot-table rows")


def _verify_beam(wm: WindowBlockManager, rid: Hashable, sw: SequenceWindow, b: int, beam) -> None:
    """One beam's slot-table row is as long as the beam, and each position agrees with it:
    placeholders only in the detached prefix (with the null slot), real blocks after it."""
    slots = wm.slot_table.row(sw, b).tolist()
    if len(slots) != len(beam):
        _fail(f"window {wm.window}: request {rid!r} beam {b} has {len(beam)} blocks but {len(slots)} slots")
    for pos, blk in enumerate(beam):
        if blk == PLACEHOLDER_BLOCK_ID:
            if sw.state is None:
                _verify_placeholder(wm, rid, sw, pos, slots[pos])
        else:
            _verify_held_block(wm, rid, sw, pos, blk, slots[pos])


def _verify_placeholder(wm: WindowBlockManager, rid: Hashable, sw: SequenceWindow, pos: int, slot: int) -> None:
    """A placeholder (a detached sliding-window block) lies inside the detached prefix and maps
    to the null slot."""
    if pos >= sw.num_front_removed:
        _fail(f"window {wm.window}: request {rid!r} has a placeholder at {pos} past the detached prefix")
    if slot != wm.null_slot:
        _fail(f"window {wm.window}: placeholder of {rid!r} at {pos} has slot {slot}")


def _verify_held_block(wm: WindowBlockManager, rid: Hashable, sw: SequenceWindow, pos: int, blk: int, slot: int) -> None:
    """A real block a sequence holds lies past its detached prefix, is one of this window's
    blocks, lives in primary memory, and its slot-table entry is the block's own slot."""
    w = wm.window
    if pos < sw.num_front_removed:
        _fail(f"window {w}: request {rid!r} holds a real block inside its detached prefix")
    if not 0 <= blk < wm.num_blocks:
        _fail(f"window {w}: request {rid!r} holds block id {blk}, not one of this manager's")
    if wm.columns.level[blk] != PRIMARY:
        _fail(f"window {w}: request {rid!r} references secondary block {blk}")
    slot_col = wm.columns.slot
    if slot != slot_col[blk]:
        _fail(f"window {w}: slot row of {rid!r} says {slot} at {pos}, block {blk} owns {slot_col[blk]}")


def _verify_store_hint(
    bm: BlockManager, wm: WindowBlockManager, rid: Hashable, seq: TrackedSequence, sw: SequenceWindow, slot_row: int
) -> None:
    """A nonzero store hint (`WindowBlockManager.set_cursor`) on a one-beam sequence's slot-table
    row is the cursor's, in a full-attention window, and the cursor's position still holds the
    sequence's own block."""
    due = int(wm.slot_table.store_due[slot_row])
    if due == 0:
        return
    cur = sw.cursor
    w = wm.window
    if cur is None or wm.detaches or not wm.grows_blocks or due != (cur.full_blocks + 1) * bm.tokens_per_block:
        _fail(f"window {w}: request {rid!r} has store hint {due} for cursor {cur}")
    found = wm.cursor_position(seq, sw)  # where the position is now (a split may have moved it)
    own = sw.blocks[0][cur.full_blocks - 1]
    row = None if found is None else bm.tree.values[wm.index][found[0][0]]
    if found is None or row is None or row[found[0][1]] != own:
        _fail(f"window {w}: the store hint of request {rid!r} trusts cursor {cur}, whose position lost block {own}")


def _verify_queues(wm: WindowBlockManager) -> None:
    """The free queues: their links, records, counts and masks, then the retention expiries."""
    seen: set[int] = set()
    for level in (PRIMARY, SECONDARY):
        _verify_level_queues(wm, level, seen)
    q = wm.queues
    for b in range(q.num_blocks):
        if q.queue[b] != NOT_FREE and b not in seen:
            _fail(f"window {wm.window}: block {b} records a free queue but none holds it")
    _verify_expiries(wm)


def _verify_level_queues(wm: WindowBlockManager, level: int, seen: set[int]) -> None:
    """Every block in one level's queues sits in exactly the queue it records (none twice, no
    loop), the lists link both ways, and the level's free count and non-empty mask agree."""
    q = wm.queues
    total = 0
    mask = 0
    for prio in range(NUM_PRIORITIES):
        s = q.num_blocks + level * NUM_PRIORITIES + prio
        prev = s
        b = q.next[s]
        while b != s:
            _verify_queued_block(wm, level, prio, b, prev, seen)
            seen.add(b)
            total += 1
            prev = b
            b = q.next[b]
        if q.prev[s] != prev:
            _fail(f"window {wm.window}: free queue ({level},{prio}) tail link is stale")
        if total and q.next[s] != s:
            mask |= 1 << prio
    if total != q.num_free[level]:
        _fail(f"window {wm.window}: level {level} counts {q.num_free[level]} free blocks, queues hold {total}")
    if mask != q.nonempty[level]:
        _fail(f"window {wm.window}: level {level} non-empty mask is stale")


def _verify_queued_block(wm: WindowBlockManager, level: int, prio: int, b: int, prev: int, seen: set[int]) -> None:
    """A block met walking queue (level, prio) is a block not met before, linked back to its
    predecessor, and records that queue, that level and that priority."""
    q = wm.queues
    w = wm.window
    if not 0 <= b < q.num_blocks:
        _fail(f"window {w}: free queue ({level},{prio}) links to {b}, not a block")
    if b in seen:
        _fail(f"window {w}: block {b} is in two free queues (or a queue loops)")
    if q.prev[b] != prev:
        _fail(f"window {w}: free queue ({level},{prio}) links are not symmetric at block {b}")
    if q.queue[b] != level * NUM_PRIORITIES + prio:
        _fail(f"window {w}: block {b} queued at ({level},{prio}) but records queue {q.queue[b]}")
    if wm.columns.level[b] != level:
        _fail(f"window {w}: block {b} at level {wm.columns.level[b]} sits in level-{level} queue")
    if q.priority[b] != prio:
        _fail(f"window {w}: block {b} has priority {q.priority[b]} but sits in queue {prio}")


def _verify_expiries(wm: WindowBlockManager) -> None:
    """Armed retention expiries belong to free blocks with an expiry time (and every expiry
    time is armed), each armed expiry still has its heap entry, and the heap stays bounded."""
    q = wm.queues
    w = wm.window
    for b in q.armed:
        if q.queue[b] == NOT_FREE or b not in q.expiry:
            _fail(f"window {w}: block {b} has an expiry armed but is not free")
    if set(q.expiry) != set(q.armed):
        _fail(f"window {w}: expiry times and armed heap entries disagree")
    entries = set(q.heap_entries())
    for b, c in q.armed.items():  # an armed expiry the heap lost would never fire
        if (q.expiry[b], c, b) not in entries:
            _fail(f"window {w}: block {b}'s armed expiry has no heap entry")
    if q.heap_size > q.heap_limit:
        _fail(f"window {w}: expiry heap holds {q.heap_size} entries, limit {q.heap_limit}")


def _verify_ref_counts(wm: WindowBlockManager, refs: Counter) -> None:
    """Each block's reference count is the sequences holding it plus its (non-negative) pins,
    and a block is free exactly when unreferenced: none leaks, none is held and free at once."""
    w = wm.window
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


def _verify_slot_permutations(wm: WindowBlockManager) -> None:
    """Per cache level, the blocks' slots are a permutation of that level's pool (no slot
    shared, none lost)."""
    slot_col, level_col = wm.columns.slot, wm.columns.level
    for level, count in ((PRIMARY, wm.num_primary), (SECONDARY, wm.num_secondary)):
        slots = sorted(slot_col[b] for b in range(wm.num_blocks) if level_col[b] == level)
        if slots != list(range(count)):
            _fail(f"window {wm.window}: level-{level} slots are not a permutation of 0..{count - 1}")


# ------------------------------------------------------------------ the radix tree
@dataclass(slots=True)
class _TreeWalk:
    """What a walk of the tree from its root found: the nodes reached, their totals, the blocks
    their positions hold (per window index: block -> (node, offset)) and their position ids."""

    seen: set[int] = field(default_factory=set)
    num_nodes: int = 0
    num_positions: int = 0
    held: list[dict[int, tuple[int, int]]] = field(default_factory=list)
    id_ranges: list[tuple[int, int]] = field(default_factory=list)


def _verify_tree(bm: BlockManager) -> None:
    """The radix tree: every node and its links (one walk from the root), then the walk's
    findings against the tree's position ids, counts, block back-pointers, node table and
    signature counts."""
    tree = bm.tree
    walk = _walk_tree(bm)
    _verify_position_ids_disjoint(walk.id_ranges)
    if walk.num_nodes != tree.num_nodes or walk.num_positions != tree.num_positions:
        _fail(
            f"tree counts {tree.num_nodes} nodes / {tree.num_positions} positions, "
            f"walk found {walk.num_nodes} / {walk.num_positions}"
        )
    _verify_block_back_pointers(bm, walk.held)
    _verify_node_table(tree, walk.seen)
    _verify_signature_counts(tree, walk.seen)


def _walk_tree(bm: BlockManager) -> _TreeWalk:
    """Visit every node reachable from the root once (depth first), checking each node where
    it stands; a node reached twice (a cycle or a shared child) fails at once, so the walk ends."""
    tree = bm.tree
    walk = _TreeWalk(held=[{} for _ in bm.windows])
    stack = [ROOT]
    while stack:
        n = stack.pop()
        if n in walk.seen:
            _fail(f"tree node {n} is reachable twice")
        walk.seen.add(n)
        kids = tree.children[n]
        if kids is not None and not kids:
            _fail(f"tree node {n} keeps an empty child map")
        if n != ROOT:
            _verify_node(tree, n)
            walk.num_nodes += 1
            walk.num_positions += tree.length[n]
            walk.id_ranges.append((tree.pid[n], tree.pid_end[n]))
            _verify_node_rows(bm, n, walk.held)
            if kids is None:  # after the rows are known to cover the node's positions
                _verify_leaf_end(tree, n)
        if kids:
            _verify_children(tree, n, kids)
            stack.extend(kids.values())
        elif tree.pindex[n]:
            _fail(f"leaf tree node {n} keeps a partial-match index")
    return walk


def _verify_node(tree: RadixTree, n: int) -> None:
    """A live node's own columns: positions, tokens and position ids, then what it carries."""
    ntok = _verify_node_positions(tree, n)
    _verify_node_extras(tree, n, ntok)


def _verify_node_positions(tree: RadixTree, n: int) -> int:
    """A live node has positions and content, its tokens fill every position but the last
    (which may be partial), and its position ids lie inside its id range, which was handed
    out. Returns its token count."""
    length = tree.length[n]
    content = tree.content[n]
    unit = tree.unit(n)
    if length < 1 or content is None:
        _fail(f"live tree node {n} has no positions")
    ntok = len(content) // unit  # a truncated node keeps its dropped positions' tokens
    if len(content) % unit or ntok <= (length - 1) * tree.tokens_per_block:
        _fail(f"tree node {n}: {ntok} tokens do not fill {length} positions (only the last may be partial)")
    if not tree.pid[n] + length <= tree.pid_end[n] <= tree.next_pid:
        _fail(
            f"tree node {n}: position ids [{tree.pid[n]}, {tree.pid[n] + length}) "
            f"outside its range ending {tree.pid_end[n]}"
        )
    return ntok


def _verify_node_extras(tree: RadixTree, n: int, ntok: int) -> None:
    """A multimodal block is a node of its own, a node's signature is live, only a node ending
    on a full block has children, and cached hashes (if any) cover exactly its positions."""
    length = tree.length[n]
    if n in tree.mm and length != 1:
        _fail(f"tree node {n} holds a multimodal block inside a run of {length}")
    if tree.signatures[tree.sig[n]] is None or tree.sig_refs[tree.sig[n]] < 1:
        _fail(f"tree node {n} carries a released signature")
    if tree.children[n] is not None and ntok < length * tree.tokens_per_block:
        _fail(f"tree node {n} ends on a partial block but has children")
    hs = tree.hashes[n]
    if hs is not None and len(hs) != length:
        _fail(f"tree node {n}: {len(hs)} cached hashes for {length} positions")


def _verify_node_rows(bm: BlockManager, n: int, held: list[dict[int, tuple[int, int]]]) -> None:
    """Each window's row of a live node covers its positions, and no block sits at two tree
    positions; records where each block sits for the back-pointer check."""
    tree = bm.tree
    length = tree.length[n]
    for widx, vals in enumerate(tree.values):
        row = vals[n]
        if row is None or len(row) != length:
            _fail(f"tree node {n}: window {bm.windows[widx].window} row does not cover its {length} positions")
        mine = held[widx]
        for o, b in enumerate(row):
            if b == NO_BLOCK:
                continue
            if b in mine:
                _fail(f"block {b} of window {bm.windows[widx].window} sits at two tree positions")
            mine[b] = (n, o)


def _verify_leaf_end(tree: RadixTree, n: int) -> None:
    """A leaf's last position holds a block in some window (empty trailing positions are pruned)."""
    last = max((vals[n][tree.length[n] - 1] for vals in tree.values), default=NO_BLOCK)
    if last == NO_BLOCK:
        _fail(f"empty tree position left unpruned at the end of leaf node {n}")


def _verify_children(tree: RadixTree, n: int, kids: dict) -> None:
    """Each child links back to `n` and is filed under its own key; then `n`'s partial-match
    index and age lists agree with its (non-multimodal) children's first blocks."""
    buckets: dict[int, list] = {}
    for key, c in kids.items():
        first = _verify_child_link(tree, n, key, c)
        if c not in tree.mm:
            buckets.setdefault(tree.sig[c], []).append(first)
    index = tree.pindex[n]
    if index is not None and {s: sorted(v) for s, v in buckets.items()} != {s: f.live() for s, f in index.items()}:
        _fail(f"partial-match index of tree node {n} is stale")
    if index is not None:
        _check_ages(tree, n, kids, buckets, index)


def _verify_child_link(tree: RadixTree, n: int, key: bytes | tuple, c: int) -> bytes:
    """Child `c` names `n` as its parent, starts where `n` ends, and is filed under the key of
    its first block. Returns that first block's bytes."""
    if tree.parent[c] != n:
        _fail(f"tree link broken under node {n}: child {c} names parent {tree.parent[c]}")
    end = tree.depth[n] + tree.length[n]
    if tree.depth[c] != end:
        _fail(f"tree node {c}: depth {tree.depth[c]} after a parent ending at {end}")
    # `first_key` reads these; the child's own checks come only when it is popped
    if tree.content[c] is None:
        _fail(f"live tree node {c} has no positions")
    if tree.signatures[tree.sig[c]] is None:
        _fail(f"tree node {c} carries a released signature")
    first, own_key = tree.first_key(c)
    if own_key != key:
        _fail(f"tree node {c} is filed under a key that is not its first block")
    return first


def _verify_position_ids_disjoint(id_ranges: list[tuple[int, int]]) -> None:
    """No two live nodes own overlapping position-id ranges."""
    id_ranges.sort()
    for (_, end), (start, _) in pairwise(id_ranges):
        if start < end:
            _fail("two tree nodes own overlapping position ids")


def _verify_block_back_pointers(bm: BlockManager, held: list[dict[int, tuple[int, int]]]) -> None:
    """Each block's (node, offset) back-pointer names exactly the tree position holding it, and
    an uncached block points nowhere."""
    tree = bm.tree
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


def _verify_node_table(tree: RadixTree, seen: set[int]) -> None:
    """Bounded storage: every node id is live or listed free (once), and a free id holds
    nothing and links nowhere."""
    capacity = len(tree.content)
    if len(tree.free_ids) + tree.num_nodes + 1 != capacity or len(set(tree.free_ids)) != len(tree.free_ids):
        _fail(f"tree node table: {capacity} ids, {tree.num_nodes} live + root, {len(tree.free_ids)} free")
    for n in tree.free_ids:
        if n in seen or tree.content[n] is not None or tree.children[n] is not None or tree.parent[n] != -1:
            _fail(f"free tree node {n} still holds data or is linked")


def _verify_signature_counts(tree: RadixTree, seen: set[int]) -> None:
    """Each live signature counts exactly the live nodes carrying it (the plain one one more:
    it is never released)."""
    live_sigs = Counter(tree.sig[n] for n in seen if n != ROOT)
    for sid, sig in enumerate(tree.signatures):
        if sig is None:
            continue
        if tree.sig_refs[sid] != live_sigs.get(sid, 0) + (sid == 0):
            _fail(f"signature {sig} counts {tree.sig_refs[sid]} nodes, {live_sigs.get(sid, 0)} carry it")


def _check_ages(tree: RadixTree, n: int, kids: dict, buckets: dict, index: dict) -> None:
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
    # store cursors, and recurrent-state cursors (None outside a recurrent-state window)
    cursors = tuple(
        tuple((sw.cursor, None if sw.state is None else sw.state.as_tuple()) for sw in seq.windows) for seq in seqs.values()
    )
    events = bm.events.state() if bm.events is not None else ()
    return (tuple(out), tuple(sorted(nodes)), sequences, len(bm.recorder), events, cursors)
