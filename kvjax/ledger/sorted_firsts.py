"""`SortedFirsts`: one node's index of its children's first blocks, for partial matching.

Kept apart from the tree's node storage because its rules (dead keys, age order, stale
entries) are about the index alone; the tree keeps one per node and signature once a partial
lookup asks there (`RadixMatch.best_partial`) and keeps it in step as children come and go.
"""
from __future__ import annotations

import array
import bisect

from kvjax.ledger.token_path import child_key


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

    def compact(self, kids: dict, sid: int, pid: array.array) -> None:
        """Drop the stale entries of the age list, and those before its head (once either
        outnumbers the rest, so O(1) amortised per removal). `kids`: the children of the node
        this index belongs to (it still has live keys); `pid`: the tree's position-id column."""
        ages, births = self.ages, self.births
        keep = [
            j
            for j in range(self.head, len(ages))
            if (c := kids.get(child_key(sid, ages[j], ()))) is not None and pid[c] == births[j]
        ]
        self.ages = [ages[j] for j in keep]
        self.births = array.array("q", [births[j] for j in keep])
        self.head = self.stale = 0
