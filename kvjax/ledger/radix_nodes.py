"""`RadixNodes`: the radix tree's node and position storage, and the only code that attaches
blocks to positions or detaches them.

A *position* is one block of a token path; it holds at most one block per window. Positions
are stored in compressed edges: a node is a run of consecutive positions, so a 1k-token
context is one node, not 64. A run is split where another path diverges from it (as in
SGLang's radix tree), never merged; a leaf run grows in place when its path goes on (a
decode storing one block at a time extends one node), up to `RUN_LIMIT` positions.

Everything is addressed by integers. Node `n` has columns `parent`, `depth` (the block index
of its first position), `length` (positions), `sig` (the constraint signature every block of
the run shares, interned) and `pid` (the id of its first position: position `o` of `n` is
`pid[n] + o`; ids are never reused, so a sequence can remember "the position I stored last"
across splits and notice when it was pruned). A node owns the ids `[pid, pid_end)`: a new
node reserves `RUN_LIMIT` of them, so a leaf can grow into ids nobody else was given; a node
that ever lost positions from its end (its `content` then keeps their tokens) never grows
again, so an id is never handed out twice. Its tokens are one `bytes` object (`content`,
see `kvjax.ledger.token_path`), its per-window block ids one `array('i')` per window
(`values`, -1 where the window holds none). Blocks point back through `block_node` /
`block_offset`, one int column per window. Children are found by the exact key of their first
block (a dict), and partial matches through a per-node sorted list of first blocks: the
longest common prefix is read off the two keys next to where the query sorts (one binary
search), and the keys sharing it are a range found from there, never a scan of the siblings.

Positions left with no block and nothing after them are pruned up to the root. Walks over
the tree live in `radix_match` (lookups) and `radix_insert` (storing), event hashes in
`event_records`; `RadixTree` puts them together.
"""
from __future__ import annotations

import array
from collections.abc import Iterator
from typing import Any

from kvjax.ledger.block_key import BlockKey
from kvjax.ledger.sorted_firsts import SortedFirsts
from kvjax.ledger.token_path import (
    EXTRA_UNIT,
    PLAIN_SIGNATURE,
    PLAIN_UNIT,
    block_key,
    child_key,
    common_units,
)

ROOT = 0
NO_BLOCK = -1
RUN_LIMIT = 256  # positions a leaf run may grow to in place (new nodes may start longer)
# What a freed node id holds in the `content` and `values` columns (the root, which has no
# positions, too in `values`), and a released signature id in `signatures`: nothing reads a
# vacant entry, so these columns are typed by what live entries hold.
_VACANT: Any = None


class RadixNodes:
    """Node columns, signatures, positions and block attachment (see the module docstring)."""

    def __init__(self, tokens_per_block: int, blocks_per_window: list[int]) -> None:
        self.tokens_per_block = tokens_per_block
        self.num_windows = len(blocks_per_window)
        # node columns (node 0 is the root: no positions)
        self.parent = array.array("i", [-1])
        self.depth = array.array("i", [0])
        self.length = array.array("i", [0])
        self.sig = array.array("i", [0])
        self.pid = array.array("q", [0])
        self.pid_end = array.array("q", [0])
        self.content: list[bytes] = [b""]
        self.children: list[dict | None] = [None]
        self.pindex: list[dict[int, SortedFirsts] | None] = [None]
        self.values: list[list[array.array]] = [[_VACANT] for _ in range(self.num_windows)]
        self.hashes: list[list | None] = [None]
        self.mm: dict[int, tuple] = {}  # node -> multimodal keys of its single position
        self.free_ids: list[int] = []
        self.next_pid = 1
        self.num_nodes = 0  # live nodes besides the root
        self.num_positions = 0
        # per window: block -> (node, offset) of the position holding it (node -1: not cached)
        self.block_node = [array.array("i", [NO_BLOCK]) * n for n in blocks_per_window]
        self.block_offset = [array.array("i", [0]) * n for n in blocks_per_window]
        # signatures (extra-id usage, LoRA task, cache salt), interned with reference counts
        self.signatures: list[tuple] = [PLAIN_SIGNATURE]
        self.sig_ids: dict[tuple, int] = {PLAIN_SIGNATURE: 0}
        self.sig_refs = [1]  # the plain signature is never released
        self._free_sigs: list[int] = []


    # ------------------------------------------------------------------ signatures
    def _acquire_signature(self, signature: tuple) -> int:
        sid = self.sig_ids.get(signature)
        if sid is None:
            if self._free_sigs:
                sid = self._free_sigs.pop()
                self.signatures[sid] = signature
                self.sig_refs[sid] = 0
            else:
                sid = len(self.signatures)
                self.signatures.append(signature)
                self.sig_refs.append(0)
            self.sig_ids[signature] = sid
        self.sig_refs[sid] += 1
        return sid

    def _release_signature(self, sid: int) -> None:
        self.sig_refs[sid] -= 1
        if self.sig_refs[sid] == 0:
            del self.sig_ids[self.signatures[sid]]
            self.signatures[sid] = _VACANT
            self._free_sigs.append(sid)

    def unit(self, n: int) -> int:
        return EXTRA_UNIT if self.signatures[self.sig[n]][0] else PLAIN_UNIT

    # ------------------------------------------------------------------ node storage
    def _alloc(self, parent: int, depth: int, length: int, sid: int, pid: int, pid_end: int) -> int:
        if self.free_ids:
            n = self.free_ids.pop()
            self.parent[n] = parent
            self.depth[n] = depth
            self.length[n] = length
            self.sig[n] = sid
            self.pid[n] = pid
            self.pid_end[n] = pid_end
        else:
            n = len(self.content)
            self.parent.append(parent)
            self.depth.append(depth)
            self.length.append(length)
            self.sig.append(sid)
            self.pid.append(pid)
            self.pid_end.append(pid_end)
            self.content.append(_VACANT)
            self.children.append(None)
            self.pindex.append(None)
            self.hashes.append(None)
            for rows in self.values:
                rows.append(_VACANT)
        self.num_nodes += 1
        return n

    def _free(self, n: int) -> None:
        sid = self.sig[n]
        if self.sig_refs[sid] > 1:
            self.sig_refs[sid] -= 1
        else:
            self._release_signature(sid)
        self.parent[n] = -1
        self.length[n] = 0
        self.pid[n] = self.pid_end[n] = -1
        self.content[n] = _VACANT
        self.children[n] = None
        self.pindex[n] = None
        self.hashes[n] = None
        for rows in self.values:
            rows[n] = _VACANT
        self.mm.pop(n, None)
        self.free_ids.append(n)
        self.num_nodes -= 1

    def first_key(self, n: int) -> tuple[bytes, bytes | tuple]:
        """(first block's bytes, key under the parent) of live node `n`: what its parent files it
        under and its partial-match index sorts (read-only; the integrity checks compare both)."""
        c = self.content[n]
        bb = self.unit(n) * self.tokens_per_block
        first = c if len(c) <= bb else c[:bb]
        sid = self.sig[n]
        return first, child_key(sid, first, self.mm.get(n, ()))

    def _add_child(self, p: int, n: int) -> None:
        first, key = self.first_key(n)
        kids = self.children[p]
        if kids is None:
            kids = self.children[p] = {}
        kids[key] = n
        index = self.pindex[p]
        if index is not None and n not in self.mm:
            firsts = index.get(self.sig[n])
            if firsts is None:
                firsts = index[self.sig[n]] = SortedFirsts([], [], array.array("q"))
            firsts.add(first, self.pid[n])

    def _remove_child(self, p: int, n: int) -> None:
        # `first_key` inlined: this runs for every pruned node (each eviction of a leaf run)
        c = self.content[n]
        sid = self.sig[n]
        bb = (EXTRA_UNIT if self.signatures[sid][0] else PLAIN_UNIT) * self.tokens_per_block
        first = c if len(c) <= bb else c[:bb]
        mmk = self.mm.get(n)
        kids = self.children[p]
        assert kids is not None  # `n` is one of them
        del kids[child_key(sid, first, () if mmk is None else mmk)]
        if not kids:
            self.children[p] = None
        index = self.pindex[p]
        if index is not None and mmk is None:
            firsts = index[sid]
            firsts.remove(first)
            h = firsts.head
            if h < len(firsts.births) and firsts.births[h] == self.pid[n]:  # the oldest goes (eviction order)
                firsts.head = h + 1
                firsts.stale -= 1
            if len(firsts.keys) == len(firsts.dead):
                del index[sid]
            elif 2 * firsts.stale > len(firsts.ages) - firsts.head or 2 * firsts.head > len(firsts.ages):
                firsts.compact(kids, sid, self.pid)

    def new_edge(self, p: int, depth: int, signature: tuple, content: bytes, mm: tuple, rows: dict[int, array.array]) -> int:
        """A node of `len(row)` new positions under `p`, holding `rows[w]` for window w."""
        length = len(next(iter(rows.values())))
        sid = self._acquire_signature(signature)
        pid = self.next_pid
        self.next_pid = pid_end = pid + max(length, RUN_LIMIT)
        n = self._alloc(p, depth, length, sid, pid, pid_end)
        self.content[n] = content
        for w, vals in enumerate(self.values):
            row = rows.get(w)
            vals[n] = array.array("i", [NO_BLOCK]) * length if row is None else row
        if mm:
            self.mm[n] = mm
        self._add_child(p, n)
        self.num_positions += length
        return n

    def can_grow(self, n: int, sid: int, block_bytes: int, k: int) -> bool:
        """May leaf `n` take `k` more positions of a path with signature `sid` in place? Only
        a run of full blocks that never lost positions at its end (its content still as long
        as its positions), with ids to spare. A run that lost its tail never grows back: the
        new position would get the lost one's id, which a storing cursor may still name
        (tests/ledger/test_store_paths.py shows the wrong reuse that follows)."""
        return (
            n != ROOT
            and self.children[n] is None
            and self.sig[n] == sid
            and n not in self.mm
            and len(self.content[n]) == self.length[n] * block_bytes
            and self.pid[n] + self.length[n] + k <= self.pid_end[n]
        )

    def grow(self, n: int, content: bytes, k: int, rows: dict[int, array.array] | None = None) -> int:
        """Append `k` positions holding `content` to leaf `n` (see `can_grow`), empty or, for
        window w, holding `rows[w]` (the caller files each block's node and offset); returns
        the offset of the first."""
        first = self.length[n]
        self.content[n] += content
        empty = array.array("i", [NO_BLOCK]) * k
        for w, vals in enumerate(self.values):
            vals[n].extend(empty if rows is None or w not in rows else rows[w])
        hs = self.hashes[n]
        if hs is not None:
            hs.extend([None] * k)
        self.length[n] = first + k
        self.num_positions += k
        return first

    def split(self, n: int, o: int) -> int:
        """Cut node `n` before its position `o` (0 < o < length): the first `o` positions move
        to a new node `h` (returned) that takes `n`'s place; `n` keeps the rest and its
        children. Position ids do not change."""
        p = self.parent[n]
        h = self._alloc(p, self.depth[n], o, self.sig[n], self.pid[n], self.pid[n] + o)  # h never grows: n follows it
        self.sig_refs[self.sig[n]] += 1
        bb = self.unit(n) * self.tokens_per_block
        c = self.content[n]
        self.content[h] = c[: o * bb]
        self.content[n] = c[o * bb :]
        for w, vals in enumerate(self.values):
            row = vals[n]
            head, tail = row[:o], row[o:]
            vals[h], vals[n] = head, tail
            bn, bo = self.block_node[w], self.block_offset[w]
            for b in head:
                if b >= 0:
                    bn[b] = h
            for b in tail:
                if b >= 0:
                    bo[b] -= o
        hs = self.hashes[n]
        if hs is not None:
            self.hashes[h], self.hashes[n] = hs[:o], hs[o:]
        _, key = self.first_key(h)
        kids = self.children[p]
        assert kids is not None  # `n` was one of them
        kids[key] = h  # the same key: the parent's partial index is unchanged
        self.parent[n] = h
        self.depth[n] += o
        self.length[n] -= o
        self.pid[n] += o
        self.children[h] = None
        self.pindex[h] = None
        self._add_child(h, n)
        return h

    # ------------------------------------------------------------------ positions
    def value(self, w: int, n: int, o: int) -> int:
        return self.values[w][n][o]

    def position_of(self, w: int, b: int) -> tuple[int, int] | None:
        n = self.block_node[w][b]
        return None if n < 0 else (n, self.block_offset[w][b])

    def position_tokens(self, n: int, o: int) -> int:
        """Tokens of position `o` of `n` (fewer than a block only for a partial last one)."""
        tpb = self.tokens_per_block
        if o < self.length[n] - 1:
            return tpb
        return min(tpb, len(self.content[n]) // self.unit(n) - o * tpb)

    def previous(self, n: int, o: int) -> tuple[int, int]:
        """The position before `(n, o)` on its path ((ROOT, -1) before the first)."""
        if o > 0:
            return n, o - 1
        p = self.parent[n]
        return p, self.length[p] - 1

    def key_at(self, n: int, o: int) -> BlockKey:
        bb = self.unit(n) * self.tokens_per_block
        c = self.content[n][o * bb : (o + 1) * bb]
        return block_key(c, self.signatures[self.sig[n]], self.mm.get(n, ()))

    def path_keys(self, n: int, o: int) -> list[BlockKey]:
        """Keys of every position from the root to `(n, o)`."""
        keys = []
        while n != ROOT:
            keys.append(self.key_at(n, o))
            n, o = self.previous(n, o)
        return keys[::-1]

    def is_leaf(self, w: int, b: int) -> bool:
        """No position right after `b`'s holds a block of window `w` (nobody's prefix)."""
        n = self.block_node[w][b]
        if n < 0:
            return True
        o = self.block_offset[w][b]
        vals = self.values[w]
        if o + 1 < self.length[n]:
            return vals[n][o + 1] == NO_BLOCK
        kids = self.children[n]
        if kids:
            for c in kids.values():
                if vals[c][0] != NO_BLOCK:
                    return False
        return True

    # ------------------------------------------------------------------ attach / detach
    def attach(self, w: int, n: int, o: int, b: int) -> None:
        """Make `b` window `w`'s block at `(n, o)` (the position holds none; `b` is detached)."""
        self.values[w][n][o] = b
        self.block_node[w][b] = n
        self.block_offset[w][b] = o

    def detach(self, w: int, b: int) -> bool:
        """Take `b` out of the tree and prune what is left empty. False if it was not cached."""
        return self.detach_many(w, (b,)) == 1

    def detach_many(self, w: int, blocks) -> int:
        """Take each of `blocks` out of the tree in order, pruning what is left empty (blocks
        not cached are skipped); returns how many were cached. Most are the tails of runs
        (victims claimed for new blocks): the position is dropped in place."""
        bn, boff, vals = self.block_node[w], self.block_offset[w], self.values[w]
        children, hashes, length = self.children, self.hashes, self.length
        single = self.num_windows == 1
        count = 0
        for b in blocks:
            n = bn[b]
            if n < 0:
                continue
            count += 1
            o = boff[b]
            row = vals[n]
            row[o] = NO_BLOCK
            bn[b] = NO_BLOCK
            if o == len(row) - 1 and children[n] is None:
                if o and single and row[o - 1] != NO_BLOCK:  # the usual tail eviction
                    del row[o]
                    hs = hashes[n]
                    if hs is not None:
                        del hs[o]
                    length[n] = o
                    self.num_positions -= 1
                else:
                    self.prune(n)
        return count

    def prune(self, n: int) -> None:
        """Drop trailing empty positions of leaf nodes, from `n` up to the root."""
        values = self.values
        while n != ROOT and self.children[n] is None:
            length = self.length[n]
            last = -1
            for vals in values:
                row = vals[n]
                for o in range(length - 1, last, -1):
                    if row[o] != NO_BLOCK:
                        last = o
                        break
            if last == length - 1:
                return
            if last >= 0:
                self._truncate(n, last + 1)
                return
            p = self.parent[n]
            self._remove_child(p, n)
            self.num_positions -= length
            self._free(n)
            n = p

    def _truncate(self, n: int, keep: int) -> None:
        """Keep the first `keep` positions of `n`. Its content keeps the dropped positions'
        tokens (bounded by what the node was created with; they go with the node or a split):
        only `length` says how many positions are live."""
        self.num_positions -= self.length[n] - keep
        for vals in self.values:
            del vals[n][keep:]
        hs = self.hashes[n]
        if hs is not None:
            del hs[keep:]
        self.length[n] = keep

    def locate(self, node: int, pid: int) -> tuple[int, int] | None:
        """Where position `pid` is now, looking from `node` (where it was) up to the root.
        None if it is not found there: pruned, or `node` was reused (then look it up by path)."""
        parent, holds = self.parent, self.holds
        while node > ROOT:
            if holds(node, pid):
                return node, pid - self.pid[node]
            node = parent[node]
        return None

    def holds(self, n: int, pid: int) -> bool:
        """Is position id `pid` one of node `n`'s live positions? (A storing cursor is still
        where it was stored: a split moves positions to a new node, a prune drops them.)"""
        first = self.pid[n]
        return first <= pid < first + self.length[n]

    # ------------------------------------------------------------------ inspection
    def iter_nodes(self) -> Iterator[int]:
        """Every live node but the root, parents before children."""
        stack = [ROOT]
        while stack:
            n = stack.pop()
            if n != ROOT:
                yield n
            kids = self.children[n]
            if kids:
                stack.extend(kids.values())



def equal_blocks(P: bytes, p: int, C: bytes, c: int, k: int, bb: int) -> int:
    """How many of the `k` blocks at `P[p:]` and `C[c:]` are equal, from the first."""
    size = k * bb
    if c == 0 and size == len(C):
        if P.startswith(C, p):
            return k
    elif P.startswith(C[c : c + size], p):
        return k
    return common_units(P[p : p + size], C[c : c + size], bb)


def next_mm(mm: dict, d: int) -> int:
    """The first block from `d` on that has multimodal keys (a large number if none)."""
    nxt = 1 << 60
    for k in mm:
        if d <= k < nxt:
            nxt = k
    return nxt
