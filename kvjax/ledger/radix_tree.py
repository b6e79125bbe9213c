"""`RadixTree`: one radix tree of cached blocks shared by every attention window.

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

This module is the only one that attaches blocks to positions or detaches them. Positions
left with no block and nothing after them are pruned up to the root.
"""
from __future__ import annotations

import array
import bisect
import hashlib
import math
import struct
from collections.abc import Callable, Iterator
from typing import Any, cast

from kvjax.ledger.block_key import BlockHasher, BlockKey, SHA256_ROOT_HASH
from kvjax.ledger.token_path import (
    EXTRA_UNIT,
    NATIVE_LITTLE,
    PLAIN_SIGNATURE,
    PLAIN_UNIT,
    TokenPath,
    block_key,
    common_units,
)

ROOT = 0
NO_BLOCK = -1
RUN_LIMIT = 256  # positions a leaf run may grow to in place (new nodes may start longer)
_U32 = struct.Struct("<I")
_PLAIN_TAIL = b"elsM" + _U32.pack(0)  # see block_key.canonical_key_bytes
_sha256 = hashlib.sha256
_bisect_left = bisect.bisect_left
_bisect_right = bisect.bisect_right
_from_bytes = int.from_bytes  # big-endian: an XOR's bit length locates the first differing byte
_isqrt = math.isqrt
# What a freed node id holds in the `content` and `values` columns (the root, which has no
# positions, too in `values`), and a released signature id in `signatures`: nothing reads a
# vacant entry, so these columns are typed by what live entries hold.
_VACANT: Any = None


class RadixTree:
    def __init__(self, tokens_per_block: int, blocks_per_window: list[int], hasher: BlockHasher | None = None) -> None:
        self.tokens_per_block = tokens_per_block
        self.num_windows = len(blocks_per_window)
        self.hasher = BlockHasher() if hasher is None else hasher
        self._fast_sha256 = self.hasher.algorithm == "sha256" and NATIVE_LITTLE
        self._full_head = b"T" + _U32.pack(tokens_per_block)  # a full plain block's canonical prefix
        self._unpack_full = struct.Struct(f"{tokens_per_block}i").unpack  # native int32 units
        self._iter_unpack_full = struct.Struct(f"{tokens_per_block}i").iter_unpack
        self._plain_block_bytes = PLAIN_UNIT * tokens_per_block
        self._iter_full_blocks = struct.Struct(f"{PLAIN_UNIT * tokens_per_block}s").iter_unpack  # (bytes,) per block
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

    @staticmethod
    def child_key(sid: int, first: bytes, mm: tuple) -> bytes | tuple:
        """Key of a child under its parent: its first block's bytes (plain signature), else
        the signature id, those bytes and the multimodal keys."""
        return first if sid == 0 and not mm else (sid, first, mm)

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

    def _first_key(self, n: int) -> tuple[bytes, bytes | tuple]:
        """(first block's bytes, key under the parent) of node `n`."""
        c = self.content[n]
        bb = self.unit(n) * self.tokens_per_block
        first = c if len(c) <= bb else c[:bb]
        sid = self.sig[n]
        return first, self.child_key(sid, first, self.mm.get(n, ()))

    def _add_child(self, p: int, n: int) -> None:
        first, key = self._first_key(n)
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
        # `_first_key` inlined: this runs for every pruned node (each eviction of a leaf run)
        c = self.content[n]
        sid = self.sig[n]
        bb = (EXTRA_UNIT if self.signatures[sid][0] else PLAIN_UNIT) * self.tokens_per_block
        first = c if len(c) <= bb else c[:bb]
        mmk = self.mm.get(n)
        kids = self.children[p]
        assert kids is not None  # `n` is one of them
        del kids[first if sid == 0 and mmk is None else (sid, first, () if mmk is None else mmk)]
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
                self._compact_ages(p, sid, firsts)

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

    def extend_leaf(self, w: int, n: int, o: int, signature: tuple, content: bytes, b: int) -> bool:
        """Attach block `b` of window `w`, holding `content` (one full block's units), at a
        new position right after `(n, o)` when that is the last position of leaf run `n`, the
        run can grow in place (`can_grow`) and `b` is cached nowhere: what `insert` does
        there, without its walk. False, changing nothing, otherwise."""
        bnode = self.block_node[w]
        if o != self.length[n] - 1 or b < 0 or bnode[b] >= 0:
            return False
        if not self.can_grow(n, self.sig_ids.get(signature, -1), len(content), 1):
            return False
        # `grow(n, content, 1, {w: [b]})` for one position, without its per-window row arrays
        self.content[n] += content
        for i, vals in enumerate(self.values):
            vals[n].append(b if i == w else NO_BLOCK)
        hs = self.hashes[n]
        if hs is not None:
            hs.append(None)
        self.length[n] = o + 2
        self.num_positions += 1
        bnode[b] = n
        self.block_offset[w][b] = o + 1
        return True

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
        _, key = self._first_key(h)
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

    # ------------------------------------------------------------------ lookups
    def match(self, w: int, path: TokenPath, n_full: int, swa: bool) -> tuple[list, list[int]]:
        """Exact walk from the root over the path's first `n_full` full blocks in window `w`:
        the matched block ids (None where a sliding window may skip a missing block) and, for
        each None, the end token of its block. A full-attention walk stops at the first
        position without a block of `w`."""
        matched: list = []
        gaps: list[int] = []
        sid = self.sig_ids.get(path.signature, -1)
        if sid < 0 or n_full <= 0:
            return matched, gaps
        tpb = self.tokens_per_block
        bb = path.block_bytes
        P = path.content
        base = path.base
        mm = path.mm
        children, content, length = self.children, self.content, self.length
        vals = self.values[w]
        n, o, d = ROOT, -1, 0
        while d < n_full:
            if o + 1 < length[n]:  # along the current node's run
                c = content[n]
                k = min(min(len(c) // bb, length[n]) - (o + 1), n_full - d)
                if mm is not None:
                    k = min(k, _next_mm(mm, d) - d)  # a multimodal block has its own node
                if k <= 0:
                    break
                first = o + 1
                m = _equal_blocks(P, (d - base) * bb, c, first * bb, k, bb)
                if m == 0:
                    break
            else:
                kids = children[n]
                if kids is None:
                    break
                p0 = (d - base) * bb
                blk = P[p0 : p0 + bb]
                mmk = () if mm is None else mm.get(d, ())
                c_id = kids.get(blk if sid == 0 and not mmk else (sid, blk, mmk))
                if c_id is None:
                    break
                n, first, m, k = c_id, 0, 1, 1
            seg = vals[n][first : first + m]
            if NO_BLOCK in seg:
                if not swa:
                    matched.extend(seg[: seg.index(NO_BLOCK)])
                    break
                for j, b in enumerate(seg):
                    if b == NO_BLOCK:
                        matched.append(None)
                        gaps.append((d + j + 1) * tpb)
                    else:
                        matched.append(b)
            else:
                matched.extend(seg)
            d += m
            o = first + m - 1
            if m < k:
                break
        return matched, gaps

    def best_partial(
        self, w: int, after: tuple[int, int], query: bytes, signature: tuple, mm: tuple, ref: list[int], skip_referenced: bool
    ) -> tuple[int, int]:
        """The block, among the positions right after `after`, holding a block of window `w`
        whose tokens share the most leading units with `query` (ties: the oldest position),
        and that count; referenced blocks are skipped when `skip_referenced`. (-1, 0) when
        none shares a unit. Blocks with multimodal keys never partially match."""
        sid = self.sig_ids.get(signature, -1)
        if sid < 0 or mm or not query:
            return NO_BLOCK, 0
        n, o = after
        unit = EXTRA_UNIT if signature[0] else PLAIN_UNIT
        vals = self.values[w]
        if n != ROOT and o + 1 < self.length[n]:  # inside a run: one candidate
            b = vals[n][o + 1]
            if b == NO_BLOCK or (skip_referenced and ref[b] > 0):
                return NO_BLOCK, 0
            bb = unit * self.tokens_per_block
            t = common_units(query, self.content[n][(o + 1) * bb : (o + 2) * bb], unit)
            return (b, t) if t else (NO_BLOCK, 0)
        kids = self.children[n]
        if not kids:
            return NO_BLOCK, 0
        index = self.pindex[n]
        if index is None:
            index = self._build_index(n)
        firsts = index.get(sid)
        if not firsts:
            return NO_BLOCK, 0
        keys = firsts.keys  # sorted, with the removed ones still in (children.get skips them)
        size = len(keys)
        # The keys sharing the most units with the query sort right next to it: the longer
        # of its two neighbours' common prefixes is the best any key has (a removed key may
        # overstate it: then no candidate is found at that length and a shorter one is tried).
        i = _bisect_left(keys, query)
        nq = len(query)
        fq = _from_bytes(query)
        shared_lo = shared_hi = 0  # bytes the query shares with keys[i - 1] and keys[i]
        if i:
            k = keys[i - 1]
            shared_lo = nq - ((fq ^ _from_bytes(k)).bit_length() + 7) // 8 if len(k) == nq else _shared_bytes(query, k)
        if i < size:
            k = keys[i]
            shared_hi = nq - ((fq ^ _from_bytes(k)).bit_length() + 7) // 8 if len(k) == nq else _shared_bytes(query, k)
        best_t = max(shared_lo, shared_hi) // unit
        if not best_t:
            return NO_BLOCK, 0
        pid = self.pid
        # Ties among more than about sqrt(children) keys are settled by the children's age
        # order instead (see below): beyond `reach` keys on a side a range's end is not needed.
        reach = _isqrt(len(kids))
        wide = False
        lo = hi = i  # keys[lo:hi]: those sharing more than `t` units (none was a candidate)
        for t in range(best_t, 0, -1):
            nb = t * unit
            prefix = query[:nb]
            if not wide:
                # the keys sharing t units with the query are one range of the sorted keys
                # around [lo, hi): one neighbour test per side settles the common small case,
                # one more `reach` keys away tells a wide range from a bounded search
                new_lo = lo
                if lo and (shared_lo >= nb if lo == i else keys[lo - 1].startswith(prefix)):
                    far = lo - 1 - reach
                    if far >= 0 and keys[far].startswith(prefix):
                        wide = True
                    else:
                        new_lo = _bisect_left(keys, prefix, max(far + 1, 0), lo - 1)
                new_hi = hi
                if not wide and hi < size and (shared_hi >= nb if hi == i else keys[hi].startswith(prefix)):
                    far = hi + reach
                    if far < size and keys[far].startswith(prefix):
                        wide = True
                    else:
                        new_hi = _bisect_right(keys, prefix + b"\xff" * (unit * self.tokens_per_block), hi + 1, min(far, size))
                if not wide and new_hi - new_lo > reach:
                    wide = True
            if wide:
                # many ties (siblings after a shared first token): children are kept oldest
                # first, and about len(kids) / (keys with the prefix) of them are seen before
                # one has the prefix; every shorter prefix is at least as common
                b = self._oldest_with_prefix(kids, sid, firsts, prefix, vals, ref, skip_referenced)
                if b != NO_BLOCK:
                    return b, t
                continue
            if new_lo < lo or new_hi > hi:
                b = NO_BLOCK
                best_pid = -1
                for j in (*range(new_lo, lo), *range(hi, new_hi)):
                    first = keys[j]
                    c = kids.get(first if sid == 0 else (sid, first, ()))
                    if c is None:  # removed since the index was compacted
                        continue
                    cb = vals[c][0]
                    if cb == NO_BLOCK or (skip_referenced and ref[cb] > 0):
                        continue
                    if best_pid < 0 or pid[c] < best_pid:
                        b, best_pid = cb, pid[c]
                if b != NO_BLOCK:
                    return b, t
                lo, hi = new_lo, new_hi
        return NO_BLOCK, 0

    def _oldest_with_prefix(
        self, kids: dict, sid: int, firsts: SortedFirsts, prefix: bytes, vals: list, ref: list[int], skip_referenced: bool
    ) -> int:
        """The block of the oldest child of signature `sid` whose first block starts with
        `prefix` and that holds a block (unreferenced when `skip_referenced`), walking the
        index's age list; the stale entries it meets before the first live one are dropped for
        good (the oldest children are the ones eviction removes first)."""
        ages, births, pid = firsts.ages, firsts.births, self.pid
        front = True
        for j in range(firsts.head, len(ages)):
            first = ages[j]
            c = kids.get(first if sid == 0 else (sid, first, ()))
            if c is None or pid[c] != births[j]:  # removed (maybe filed again since: a newer child)
                if front:
                    firsts.head = j + 1
                    firsts.stale -= 1
                continue
            front = False
            if first.startswith(prefix):
                b = vals[c][0]
                if b != NO_BLOCK and not (skip_referenced and ref[b] > 0):
                    return b
        return NO_BLOCK

    def _compact_ages(self, p: int, sid: int, firsts: SortedFirsts) -> None:
        """Drop the stale entries of an index's age list, and those before its head (once
        either outnumbers the rest, so O(1) amortised per removal)."""
        kids = self.children[p]
        assert kids is not None  # the index still has live keys
        pid = self.pid
        ages, births = firsts.ages, firsts.births
        keep = [
            j
            for j in range(firsts.head, len(ages))
            if (c := kids.get(ages[j] if sid == 0 else (sid, ages[j], ()))) is not None and pid[c] == births[j]
        ]
        firsts.ages = [ages[j] for j in keep]
        firsts.births = array.array("q", [births[j] for j in keep])
        firsts.head = firsts.stale = 0

    def _build_index(self, n: int) -> dict[int, SortedFirsts]:
        """Sorted first blocks of `n`'s children, per signature, and the same in age order
        (built on the first partial lookup at `n`, kept in step from then on)."""
        kids = self.children[n]
        assert kids is not None  # only a node with children is searched for partial matches
        pid = self.pid
        # a bytes key is a plain child's first block (see `child_key`); the others are
        # (signature id, first block, multimodal keys), and those with multimodal keys never
        # partially match. Dict order is age order: children are filed as they are made.
        plain = [key for key in kids if type(key) is bytes]
        groups: dict[int, tuple[list[bytes], array.array]] = {}
        if len(plain) == len(kids):  # the usual case: every child is plain
            groups[0] = (plain, array.array("q", [pid[c] for c in kids.values()]))
        elif plain:
            groups[0] = (plain, array.array("q", [pid[c] for key, c in kids.items() if type(key) is bytes]))
        if len(plain) < len(kids):
            for key, c in kids.items():
                if type(key) is not bytes and not key[2]:
                    group = groups.get(key[0])
                    if group is None:
                        group = groups[key[0]] = ([], array.array("q"))
                    group[0].append(key[1])
                    group[1].append(pid[c])
        index = {sid: SortedFirsts(sorted(ages), ages, births) for sid, (ages, births) in groups.items()}
        self.pindex[n] = index
        return index

    # ------------------------------------------------------------------ storing
    def insert(
        self,
        w: int,
        path: TokenPath,
        start: tuple[int, int],
        n_blocks: int,
        n_full: int,
        blocks: array.array,
        on_move: Callable[[int, int], None],
    ) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
        """Attach `blocks[d]` (window `w`) at depth d of the path for d from `path.base` to
        `n_blocks`, starting after position `start` (the one at depth `path.base - 1`), creating
        the positions that do not exist. A position already holding a block of `w` keeps it,
        and placeholders (negative ids) attach nowhere. A block cached elsewhere (a partial
        block that grew) is reported to `on_move(depth, block)` and moved, except a partial last
        block already cached right there under a longer key (`_holds_longer`), which stays. Returns the (depth, block) pairs
        attached, in order, and (node, position id) of the position at depth `n_full - 1` if
        the walk passed it and it is still there (a trailing run of placeholders the walk
        created is pruned before returning)."""
        bb = path.block_bytes
        P = path.content
        base = path.base
        mm = path.mm
        sid = self.sig_ids.get(path.signature, -1)
        children, content, length, pid = self.children, self.content, self.length, self.pid
        vals = self.values[w]
        bnode = self.block_node[w]
        attached: list[tuple[int, int]] = []
        cursor = None
        n, o = start
        d = base
        while d < n_blocks:
            if o + 1 < length[n]:  # along the current node's run
                c = content[n]
                full_n = min(len(c) // bb, length[n])
                k = min(full_n - (o + 1), n_full - d)
                if mm is not None:
                    k = min(k, _next_mm(mm, d) - d)
                m = _equal_blocks(P, (d - base) * bb, c, (o + 1) * bb, k, bb) if k > 0 else 0
                if m == 0:
                    # our partial last block may equal the run's partial last position
                    last_partial = d == n_blocks - 1 and d >= n_full and full_n == o + 1 and o + 2 == length[n]
                    if last_partial and (mm is None or d not in mm) and P[(d - base) * bb :] == c[(o + 1) * bb :]:
                        m = 1
                    if m == 0:
                        if d == n_blocks - 1 and d >= n_full and self._holds_longer(w, blocks[d], (n, o), sid, path, d):
                            break
                        n = self.split(n, o + 1)
                        cursor = self._create_rest(w, path, n, d, n_blocks, n_full, blocks, on_move, attached, cursor)
                        break
                first = o + 1
            else:
                kids = children[n]
                c_id = None
                if kids is not None and sid >= 0:
                    blk = path.block(d)
                    mmk = () if mm is None else mm.get(d, ())
                    c_id = kids.get(blk if sid == 0 and not mmk else (sid, blk, mmk))
                if c_id is None:
                    if d == n_blocks - 1 and d >= n_full and self._holds_longer(w, blocks[d], (n, o), sid, path, d):
                        break
                    cursor = self._create_rest(w, path, n, d, n_blocks, n_full, blocks, on_move, attached, cursor)
                    break
                n, first, m = c_id, 0, 1
            row = vals[n]
            for j in range(m):
                b = blocks[d + j]
                if b >= 0 and row[first + j] == NO_BLOCK:
                    if bnode[b] >= 0:
                        if d + j == n_blocks - 1 and d + j >= n_full and self._holds_longer(
                            w, b, self.previous(n, first + j), sid, path, d + j
                        ):
                            continue
                        on_move(d + j, b)
                        self.detach(w, b)
                    self.attach(w, n, first + j, b)
                    attached.append((d + j, b))
            if d < n_full <= d + m:
                cursor = (n, pid[n] + first + n_full - 1 - d)
            d += m
            o = first + m - 1
        return attached, cursor

    def _holds_longer(self, w: int, b: int, before: tuple[int, int], sid: int, path: TokenPath, d: int) -> bool:
        """Is block `b`, offered as the path's partial last block `d`, cached right after
        position `before` (the path's position at depth d - 1) under a key that extends the
        offered tokens? Then it stays there: a cached block's KV never changes, so its longer
        key is still true, and requests matching it keep it (a holder that materialised fewer
        of its tokens, such as one whose speculative tokens were rejected, would otherwise
        move it under the shorter key and the tree would forget the rest)."""
        n = self.block_node[w][b] if b >= 0 else NO_BLOCK
        if n < 0 or sid < 0 or self.sig[n] != sid or n in self.mm or (path.mm is not None and d in path.mm):
            return False
        o = self.block_offset[w][b]
        if self.previous(n, o) != before:
            return False
        bb = path.block_bytes
        offered = path.content[(d - path.base) * bb :]
        held = self.content[n][o * bb : (o + 1) * bb]
        return len(held) > len(offered) and held.startswith(offered)

    def _create_rest(
        self, w, path: TokenPath, p: int, d: int, n_blocks: int, n_full: int, blocks, on_move, attached: list, cursor
    ) -> tuple[int, int] | None:
        """New nodes under `p` for depths `d..n_blocks-1` (a multimodal block gets its own)."""
        bb = path.block_bytes
        unit = path.unit
        tpb = self.tokens_per_block
        base = path.base
        mm = path.mm
        bnode = self.block_node[w]
        sid = self.sig_ids.get(path.signature, -1)
        boff = self.block_offset[w]
        last = p
        placeholders = False
        while d < n_blocks:
            if mm is None:
                end, mmk = n_blocks, ()
            elif d in mm:
                end, mmk = d + 1, mm[d]
            else:
                end, mmk = min(_next_mm(mm, d), n_blocks), ()
            lo = (d - base) * bb
            hi = (min(end * tpb, path.num_tokens) - base * tpb) * unit
            row = blocks[d:end]
            if min(row) < 0:  # placeholders hold no position
                row = array.array("i", [b if b >= 0 else NO_BLOCK for b in row])
                placeholders = True
            moving = [(j, b) for j, b in enumerate(row) if b >= 0 and bnode[b] >= 0]
            if not mmk and self.can_grow(last, sid, bb, len(row)):  # the leaf run goes on
                n = last
                if moving or placeholders:
                    first = self.grow(n, path.content[lo:hi], len(row))
                    for j, b in enumerate(row):
                        if b >= 0:
                            if bnode[b] >= 0:  # a partial block that grew leaves its old key first
                                on_move(d + j, b)
                                self.detach(w, b)
                            self.attach(w, n, first + j, b)
                            attached.append((d + j, b))
                else:  # new blocks only (a finished request's decode blocks): the row as it is
                    first = self.grow(n, path.content[lo:hi], len(row), {w: row})
                    for j, b in enumerate(row, d):
                        bnode[b] = n
                        boff[b] = first + j - d
                        attached.append((j, b))
                if d < n_full <= end:
                    cursor = (n, self.pid[n] + first + n_full - 1 - d)
                d = end
                continue
            if moving:  # partial blocks that grew: attached one by one, after leaving their old key
                empty = array.array("i", [NO_BLOCK]) * len(row)
                n = self.new_edge(last, d, path.signature, path.content[lo:hi], mmk, {w: empty})
                for j, b in enumerate(row):
                    if b >= 0:
                        if bnode[b] >= 0:
                            on_move(d + j, b)
                            self.detach(w, b)
                        self.attach(w, n, j, b)
                        attached.append((d + j, b))
            else:
                n = self.new_edge(last, d, path.signature, path.content[lo:hi], mmk, {w: row})
                for j, b in enumerate(row, d):
                    if b >= 0:
                        bnode[b] = n
                        boff[b] = j - d
                        attached.append((j, b))
            if d < n_full <= end:
                cursor = (n, self.pid[n] + n_full - 1 - d)
            last = n
            d = end
        if placeholders:
            self.prune(last)  # a trailing run of placeholders holds nothing
            if cursor is not None and not self.pid[cursor[0]] <= cursor[1] < self.pid[cursor[0]] + self.length[cursor[0]]:
                # it named one of them (a window narrower than a block released the request's
                # newest full block): the walk passed no position there that still exists
                cursor = None
        return cursor

    def locate(self, node: int, pid: int) -> tuple[int, int] | None:
        """Where position `pid` is now, looking from `node` (where it was) up to the root.
        None if it is not found there: pruned, or `node` was reused (then look it up by path)."""
        pids, length, parent = self.pid, self.length, self.parent
        while node > ROOT:
            b = pids[node]
            if b <= pid < b + length[node]:
                return node, pid - b
            node = parent[node]
        return None

    def find(self, path: TokenPath, depth: int) -> tuple[int, int] | None:
        """The position at block index `depth` on the path's full blocks (path.base == 0)."""
        sid = self.sig_ids.get(path.signature, -1)
        if sid < 0:
            return None
        bb = path.block_bytes
        mm = path.mm
        n, o, d = ROOT, -1, 0
        while d <= depth:
            if o + 1 < self.length[n]:
                c = self.content[n]
                k = min(min(len(c) // bb, self.length[n]) - (o + 1), depth + 1 - d)
                if mm is not None:
                    k = min(k, _next_mm(mm, d) - d)
                m = _equal_blocks(path.content, d * bb, c, (o + 1) * bb, k, bb) if k > 0 else 0
                if m == 0:
                    return None
                d += m
                o += m
            else:
                kids = self.children[n]
                if kids is None:
                    return None
                blk = path.block(d)
                mmk = () if mm is None else mm.get(d, ())
                c_id = kids.get(blk if sid == 0 and not mmk else (sid, blk, mmk))
                if c_id is None:
                    return None
                n, o = c_id, 0
                d += 1
        return n, o

    # ------------------------------------------------------------------ block hashes
    def position_hash(self, n: int, o: int) -> bytes | int:
        """Chained block hash of position `(n, o)` (`hasher.root` for the root), computed once
        per position, iteratively (a deep path never hits the recursion limit)."""
        hs = self.hashes[n]
        if hs is not None:
            h = hs[o]
            if h is not None:
                return h
        pending = []
        while True:
            if n == ROOT:
                h = self.hasher.root
                break
            hs = self.hashes[n]
            if hs is None:
                hs = self.hashes[n] = [None] * self.length[n]
            h = hs[o]
            if h is not None:
                break
            pending.append((n, o))
            n, o = self.previous(n, o)
        for n, o in reversed(pending):
            h = self.hash_after(n, o, h)
        return h

    def hash_after(self, n: int, o: int, parent: bytes | int) -> bytes | int:
        """Chained hash of position `(n, o)` given its parent's (`parent`): the cached one, or
        computed and cached. Walking a path forwards this costs one hash per new position."""
        hs = self.hashes[n]
        if hs is None:
            hs = self.hashes[n] = [None] * self.length[n]
        h = hs[o]
        if h is None:
            if self._fast_sha256 and self.sig[n] == 0 and n not in self.mm:
                bb = 4 * self.tokens_per_block
                c = self.content[n][o * bb : (o + 1) * bb]
                head = self._full_head if len(c) == bb else b"T" + _U32.pack(len(c) >> 2)
                h = _sha256(b"".join((cast(bytes, parent), head, c, _PLAIN_TAIL))).digest()  # SHA-256 chains bytes
            else:
                h = self.hasher.hash(self.key_at(n, o), parent)
            hs[o] = h
        return h

    def event_run(self, n: int, o: int, k: int, with_tokens: bool = True) -> tuple[bytes | int | None, list, list[tuple] | None]:
        """What a Stored event says of positions `o..o+k-1` of node `n`, in one pass: the hash
        of the position before `o` (None at the root), each position's chained hash (cached
        ones reused, new ones cached: `hash_after`) and its tokens (`stored_tokens`; None
        without `with_tokens`: the caller has them as ints already)."""
        hs = self.hashes[n]
        if hs is None:
            hs = self.hashes[n] = [None] * self.length[n]
        parent: Any
        if o:
            parent = hs[o - 1]
            if parent is None:
                parent = self.position_hash(n, o - 1)
        else:
            p = self.parent[n]
            parent = None if p == ROOT else self.position_hash(p, self.length[p] - 1)
        out = hs[o : o + k]
        tokens: list[tuple] | None = None
        if self.sig[n] != 0:
            if with_tokens:
                tokens = [self.stored_tokens(n, i) for i in range(o, o + k)]
        else:  # token ids straight from the node's bytes; only a run's last block can be partial
            bb = self._plain_block_bytes
            c = self.content[n]
            lo = o * bb
            hi = lo + k * bb
            full_hi = hi if hi <= len(c) else hi - bb
            run = c[lo:full_hi]
            if with_tokens:
                tokens = list(self._iter_unpack_full(run))
                if full_hi < hi:
                    tokens.append(tuple(array.array("i", c[full_hi:hi])))
            if self._fast_sha256 and out.count(None) == k and n not in self.mm:  # all new: one SHA-256 loop
                h: Any = self.hasher.root if parent is None else parent  # SHA-256 chains bytes
                head, join = self._full_head, b"".join
                out = []
                append = out.append
                for (blk,) in self._iter_full_blocks(run):  # hash_after's SHA-256 fast path
                    h = _sha256(join((h, head, blk, _PLAIN_TAIL))).digest()
                    append(h)
                if full_hi < hi:
                    blk = c[full_hi:hi]
                    append(_sha256(join((h, b"T" + _U32.pack(len(blk) >> 2), blk, _PLAIN_TAIL))).digest())
                hs[o : o + k] = out
                return parent, out, tokens
        if None in out:
            h = self.hasher.root if parent is None else parent
            for i in range(k):
                h = out[i] = self.hash_after(n, o + i, h)
        return parent, out, tokens

    def event_one(self, n: int, o: int, with_tokens: bool = True) -> tuple[bytes | int | None, bytes | int, tuple | None]:
        """`event_run` of the single position `(n, o)` (a decode block, or the partial block a
        finished request stores): (parent hash, hash, tokens or None). The usual case, a new
        plain block after a hashed one, takes one SHA-256."""
        hs = self.hashes[n]
        if o and hs is not None and self._fast_sha256 and self.sig[n] == 0 and hs[o] is None and n not in self.mm:
            parent: Any = hs[o - 1]  # SHA-256 chains bytes
            bb = self._plain_block_bytes
            blk = self.content[n][o * bb : (o + 1) * bb]
            if parent is not None and blk:
                if len(blk) == bb:
                    hs[o] = h = _sha256(b"".join((parent, self._full_head, blk, _PLAIN_TAIL))).digest()
                    return parent, h, self._unpack_full(blk) if with_tokens else None
                # a partial block (the last position of its node), hashed as `event_run` does
                hs[o] = h = _sha256(b"".join((parent, b"T" + _U32.pack(len(blk) >> 2), blk, _PLAIN_TAIL))).digest()
                return parent, h, tuple(array.array("i", blk)) if with_tokens else None
        parent, hashes, tokens = self.event_run(n, o, 1, with_tokens)
        return parent, hashes[0], None if tokens is None else tokens[0]

    def stored_tokens(self, n: int, o: int) -> tuple:
        """Tokens of position `(n, o)` as a Stored event carries them: token ids, or (token,
        extra id) pairs when the path uses extra ids."""
        if self.sig[n] == 0:
            bb = PLAIN_UNIT * self.tokens_per_block
            c = self.content[n][o * bb : (o + 1) * bb]
            return self._unpack_full(c) if len(c) == bb else tuple(array.array("i", c))
        key = self.key_at(n, o)
        return key.tokens if key.extra_ids is None else tuple(zip(key.tokens, key.extra_ids, strict=True))

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


class SortedFirsts:
    """The first blocks of one node's children of one signature, sorted, for partial matching.

    A removal only marks the key dead (deleting from the middle of a sorted list moves half of
    it: with 100k siblings, most of an admission's time); lookups skip dead keys, and the list
    drops them once they are half of it, so removals cost O(1) amortised and lookups stay
    binary searches. Each key is live at most once (children are keyed by their first block).

    The same keys in the order their children were made (`ages`, with each one's position id
    then in `births`) settle ties among many keys oldest first. An entry goes stale when its
    child is removed (its key may come back as a newer child: the position id tells them
    apart); the tree drops stale entries at the front as lookups meet them and compacts the
    list once they are half of it."""

    __slots__ = ("keys", "dead", "ages", "births", "head", "stale")

    def __init__(self, keys: list[bytes], ages: list[bytes], births: array.array) -> None:
        self.keys = keys
        self.dead: set[bytes] = set()
        self.ages = ages
        self.births = births
        self.head = 0  # ages[:head] are all stale
        self.stale = 0  # stale entries in ages[head:]

    def add(self, key: bytes, pid: int) -> None:
        dead = self.dead
        if key in dead:  # still in the list: live again
            dead.discard(key)
        else:
            bisect.insort(self.keys, key)
        self.ages.append(key)
        self.births.append(pid)

    def remove(self, key: bytes) -> None:
        dead = self.dead
        dead.add(key)
        self.stale += 1
        if 2 * len(dead) > len(self.keys):
            self.keys = [k for k in self.keys if k not in dead]
            dead.clear()

    def live(self) -> list[bytes]:
        """The live keys, sorted."""
        dead = self.dead
        return [k for k in self.keys if k not in dead] if dead else list(self.keys)

    def __len__(self) -> int:
        return len(self.keys) - len(self.dead)


def _equal_blocks(P: bytes, p: int, C: bytes, c: int, k: int, bb: int) -> int:
    """How many of the `k` blocks at `P[p:]` and `C[c:]` are equal, from the first."""
    size = k * bb
    if c == 0 and size == len(C):
        if P.startswith(C, p):
            return k
    elif P.startswith(C[c : c + size], p):
        return k
    return common_units(P[p : p + size], C[c : c + size], bb)


def _shared_bytes(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` share."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    return n - ((_from_bytes(a) ^ _from_bytes(b)).bit_length() + 7) // 8


def _next_mm(mm: dict, d: int) -> int:
    """The first block from `d` on that has multimodal keys (a large number if none)."""
    nxt = 1 << 60
    for k in mm:
        if d <= k < nxt:
            nxt = k
    return nxt


__all__ = ["NO_BLOCK", "ROOT", "RadixTree", "SHA256_ROOT_HASH"]
