"""`PrefixIndex`: which block hashes each replica holds, on which medium, learned only from
decoded wire events.

Block hashes are chained (each covers its block and everything before it), so a hash names a
whole prefix and the index needs no tree: it maps `(group, hash)` to the replicas holding it
and, per replica, to a bit mask of media. `match(hashes)` walks a request's chain once and
returns, per replica, how many leading blocks it holds (and how many of those on the GPU),
stopping each replica at its first missing block as the replica's own admission walk would.

Events apply per replica in stream order: `BlockStored` / `BlockRemoved` set and clear a
medium's bit, `AllBlocksCleared` (a fresh or reset cache) forgets the replica, as does
`clear_replica` (a router that saw the replica restart, or lost events it could not replay).
Memory is bounded by the blocks the replicas hold. Every method holds one lock, so subscriber
threads may apply events while request handlers match.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable, Iterable, Sequence

from kvjax.kv_events.wire import (
    KIND_FULL_ATTENTION,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    canonical_hash,
)

_GPU_BIT = 1


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """A replica's cached prefix of a request: leading blocks held on any medium, and how many
    of them are on the GPU (the rest must be onboarded from a host or storage tier)."""

    blocks: int = 0
    gpu_blocks: int = 0

    @property
    def other_blocks(self) -> int:
        return self.blocks - self.gpu_blocks


class PrefixIndex:
    """Global index of cached block hashes across replicas (any hashable replica ids)."""

    def __init__(self) -> None:
        self._media: dict[str | None, int] = {MEDIUM_GPU: _GPU_BIT, None: _GPU_BIT, MEDIUM_CPU: 2}
        self._where: dict[tuple[int, object], dict[Hashable, int]] = {}  # (group, hash) -> replica -> media mask
        self._held: dict[Hashable, set[tuple[int, object]]] = {}  # replica -> its (group, hash) keys
        self._full_groups: set[int] = set()  # groups announced as full attention
        self._lock = threading.RLock()
        self.events_applied = 0

    # ------------------------------------------------------------------ feeding
    def _bit(self, medium: str | None) -> int:
        bit = self._media.get(medium)
        if bit is None:  # another tier ("STORAGE", ...): a bit of its own
            bit = self._media[medium] = 1 << len(set(self._media.values()))
        return bit

    def apply(self, replica: Hashable, batch: KVEventBatch) -> None:
        """Apply one decoded batch of `replica`'s stream (batches must come in order). A batch
        holding anything but events or valid hashes raises before any of it is applied."""
        events = list(batch.events)
        hashes = [self._checked(ev) for ev in events]
        with self._lock:
            for ev, hs in zip(events, hashes, strict=True):
                self._apply_event(replica, ev, hs)

    def apply_event(self, replica: Hashable, ev) -> None:
        hashes = self._checked(ev)
        with self._lock:
            self._apply_event(replica, ev, hashes)

    @staticmethod
    def _checked(ev) -> list:
        if isinstance(ev, (BlockStored, BlockRemoved)):
            return [canonical_hash(h) for h in ev.block_hashes]
        if isinstance(ev, AllBlocksCleared):
            return []
        raise TypeError(f"not a KV event: {type(ev).__name__}")

    def _apply_event(self, replica: Hashable, ev, hashes: list) -> None:
        if isinstance(ev, BlockStored):
            group = ev.group_idx or 0
            if ev.kv_cache_spec_kind == KIND_FULL_ATTENTION:
                self._full_groups.add(group)
            bit = self._bit(ev.medium)
            held = self._held.setdefault(replica, set())
            for h in hashes:
                key = (group, h)
                where = self._where.get(key)
                if where is None:
                    where = self._where[key] = {}
                where[replica] = where.get(replica, 0) | bit
                held.add(key)
        elif isinstance(ev, BlockRemoved):
            group = ev.group_idx or 0
            bit = self._bit(ev.medium)
            held = self._held.get(replica, set())
            for h in hashes:
                key = (group, h)
                where = self._where.get(key)
                if where is None or replica not in where:
                    continue  # never seen stored (e.g. a late join that replay could not fill)
                mask = where[replica] & ~bit
                if mask:
                    where[replica] = mask
                    continue
                del where[replica]
                if not where:
                    del self._where[key]
                held.discard(key)
        else:
            self.clear_replica(replica)
        self.events_applied += 1

    def clear_replica(self, replica: Hashable) -> None:
        """Forget every block of `replica` (it restarted, reset its cache, or left)."""
        with self._lock:
            for key in self._held.pop(replica, ()):
                where = self._where[key]
                del where[replica]
                if not where:
                    del self._where[key]

    # ------------------------------------------------------------------ queries
    @property
    def replicas(self) -> list[Hashable]:
        with self._lock:
            return list(self._held)

    def default_group(self) -> int:
        """The group a prefix match uses: the first full-attention group announced, else 0."""
        return min(self._full_groups) if self._full_groups else 0

    def blocks(self, replica: Hashable, medium: str | None = MEDIUM_GPU, group: int | None = None) -> set:
        """Hashes `replica` holds on `medium` (None: on any medium) in `group` (None: default)."""
        with self._lock:
            g = self.default_group() if group is None else group
            bit = None if medium is None else self._bit(medium)
            out = set()
            for key in self._held.get(replica, ()):
                if key[0] == g and (bit is None or self._where[key][replica] & bit):
                    out.add(key[1])
            return out

    def num_blocks(self, replica: Hashable) -> int:
        """(group, hash) entries held by `replica` on any medium."""
        with self._lock:
            return len(self._held.get(replica, ()))

    def match(self, hashes: Sequence, replicas: Iterable[Hashable], group: int | None = None) -> dict[Hashable, PrefixMatch]:
        """Per replica, the longest leading run of `hashes` it holds (any medium)."""
        with self._lock:
            return self._match(hashes, replicas, group)

    def _match(self, hashes: Sequence, replicas: Iterable[Hashable], group: int | None) -> dict[Hashable, PrefixMatch]:
        g = self.default_group() if group is None else group
        alive = {r: 0 for r in replicas}  # replica -> GPU blocks in its run so far
        done: dict[Hashable, PrefixMatch] = {}
        where_of = self._where
        for i, h in enumerate(hashes):
            if not alive:
                break
            where = where_of.get((g, canonical_hash(h)))
            for r in list(alive):
                mask = None if where is None else where.get(r)
                if mask is None:
                    done[r] = PrefixMatch(i, alive.pop(r))
                elif mask & _GPU_BIT:
                    alive[r] += 1
        n = len(hashes)
        for r, gpu in alive.items():
            done[r] = PrefixMatch(n, gpu)
        return done
