"""`RadixInsert`: storing a sequence's blocks into the tree. The walk that attaches a path's
blocks and creates the positions it lacks (`insert`), and a decode step's shortcut, one new
block at the end of its own leaf run (`extend_leaf`).

The rules of what stays where (a cached position keeps its block, a partial block that grew
moves, a partial block offered with fewer tokens than it holds stays) live here.
"""
from __future__ import annotations

import array
from collections.abc import Callable

from kvjax.ledger.radix_nodes import NO_BLOCK, RadixNodes, equal_blocks, next_mm
from kvjax.ledger.token_path import TokenPath, child_key


class RadixInsert(RadixNodes):
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
                    k = min(k, next_mm(mm, d) - d)
                m = equal_blocks(P, (d - base) * bb, c, (o + 1) * bb, k, bb) if k > 0 else 0
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
                    c_id = kids.get(child_key(sid, blk, mmk))
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
                end, mmk = min(next_mm(mm, d), n_blocks), ()
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
            if cursor is not None and not self.holds(*cursor):
                # it named one of them (a window narrower than a block released the request's
                # newest full block): the walk passed no position there that still exists
                cursor = None
        return cursor
