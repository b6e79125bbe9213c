"""`RadixMatch`: the tree's lookups. The exact walk admission reuses (`match`), the best
partial match among a position's successors (`best_partial`, over each node's `SortedFirsts`
index, built on first use), and the position at a depth of a path (`find`).

Nothing here changes a block's attachment; the partial index is the only state a lookup builds
or tidies (stale entries at its front).
"""
from __future__ import annotations

import array
import bisect
import math

from kvjax.ledger.radix_nodes import NO_BLOCK, ROOT, RadixNodes, equal_blocks, next_mm
from kvjax.ledger.sorted_firsts import SortedFirsts
from kvjax.ledger.token_path import EXTRA_UNIT, PLAIN_UNIT, TokenPath, child_key, common_units

_bisect_left = bisect.bisect_left
_bisect_right = bisect.bisect_right
_from_bytes = int.from_bytes  # big-endian: an XOR's bit length locates the first differing byte
_isqrt = math.isqrt


class RadixMatch(RadixNodes):
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
                    k = min(k, next_mm(mm, d) - d)  # a multimodal block has its own node
                if k <= 0:
                    break
                first = o + 1
                m = equal_blocks(P, (d - base) * bb, c, first * bb, k, bb)
                if m == 0:
                    break
            else:
                kids = children[n]
                if kids is None:
                    break
                p0 = (d - base) * bb
                blk = P[p0 : p0 + bb]
                mmk = () if mm is None else mm.get(d, ())
                c_id = kids.get(child_key(sid, blk, mmk))
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
                    c = kids.get(child_key(sid, first, ()))
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
            c = kids.get(child_key(sid, first, ()))
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
                    k = min(k, next_mm(mm, d) - d)
                m = equal_blocks(path.content, d * bb, c, (o + 1) * bb, k, bb) if k > 0 else 0
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
                c_id = kids.get(child_key(sid, blk, mmk))
                if c_id is None:
                    return None
                n, o = c_id, 0
                d += 1
        return n, o



def _shared_bytes(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` share."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    return n - ((_from_bytes(a) ^ _from_bytes(b)).bit_length() + 7) // 8
