"""`TreeEventRecords`: what the tree tells events about its positions. Each position's chained
block hash (computed once, cached per node, iteratively), and a Stored event's hashes and
tokens for a run of positions in one pass.

Kept apart from the walks because it only reads the tree (plus the hash cache): with events
off none of it runs. Hashes come from `kvjax.ledger.block_hashing` (plain blocks straight from
the node's bytes with `plain_block_hash`, others through the manager's `BlockHasher`).
"""
from __future__ import annotations

import array
import struct
from typing import Any

from kvjax.ledger.block_hashing import BlockHasher, plain_block_hash, plain_block_hashes
from kvjax.ledger.radix_nodes import ROOT, RadixNodes
from kvjax.ledger.token_path import PLAIN_UNIT


class TreeEventRecords(RadixNodes):
    def __init__(self, tokens_per_block: int, blocks_per_window: list[int], hasher: BlockHasher | None = None) -> None:
        super().__init__(tokens_per_block, blocks_per_window)
        self.hasher = BlockHasher() if hasher is None else hasher
        self._plain_units = self.hasher.plain_units  # plain blocks hash from the node's bytes
        self._plain_block_bytes = PLAIN_UNIT * tokens_per_block
        self._unpack_full = struct.Struct(f"{tokens_per_block}i").unpack  # native int32 units
        self._iter_unpack_full = struct.Struct(f"{tokens_per_block}i").iter_unpack

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

    def hash_after(self, n: int, o: int, parent: Any) -> bytes | int:
        """Chained hash of position `(n, o)` given its parent's (`parent`): the cached one, or
        computed and cached. Walking a path forwards this costs one hash per new position."""
        hs = self.hashes[n]
        if hs is None:
            hs = self.hashes[n] = [None] * self.length[n]
        h = hs[o]
        if h is None:
            if self._plain_units and self.sig[n] == 0 and n not in self.mm:
                bb = self._plain_block_bytes
                h = plain_block_hash(parent, self.content[n][o * bb : (o + 1) * bb])  # SHA-256 chains bytes
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
            if with_tokens:
                tokens = list(self._iter_unpack_full(c[lo:full_hi]))
                if full_hi < hi:
                    tokens.append(tuple(array.array("i", c[full_hi:hi])))
            if self._plain_units and out.count(None) == k and n not in self.mm:  # all new: one SHA-256 loop
                h: Any = self.hasher.root if parent is None else parent  # SHA-256 chains bytes
                out = plain_block_hashes(h, c[lo:hi], bb)
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
        if o and hs is not None and self._plain_units and self.sig[n] == 0 and hs[o] is None and n not in self.mm:
            parent: Any = hs[o - 1]  # SHA-256 chains bytes
            bb = self._plain_block_bytes
            blk = self.content[n][o * bb : (o + 1) * bb]
            if parent is not None and blk:
                hs[o] = h = plain_block_hash(parent, blk)
                if not with_tokens:
                    return parent, h, None
                # a partial block is the last position of its node
                return parent, h, self._unpack_full(blk) if len(blk) == bb else tuple(array.array("i", blk))
        parent, hashes, tokens = self.event_run(n, o, 1, with_tokens)
        return parent, hashes[0], None if tokens is None else tokens[0]

    def stored_tokens(self, n: int, o: int) -> tuple:
        """Tokens of position `(n, o)` as a Stored event carries them: token ids, or (token,
        extra id) pairs when the path uses extra ids."""
        if self.sig[n] == 0:
            bb = self._plain_block_bytes
            c = self.content[n][o * bb : (o + 1) * bb]
            return self._unpack_full(c) if len(c) == bb else tuple(array.array("i", c))
        key = self.key_at(n, o)
        return key.tokens if key.extra_ids is None else tuple(zip(key.tokens, key.extra_ids, strict=True))
