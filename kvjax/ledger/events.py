"""KV-cache events (TensorRT-LLM's `KVCacheEventManager`): what a router needs to mirror the tree.

Created (per window, at construction), Stored (consecutive new blocks under one parent),
Removed (batched per window; flushed before that window's next Stored or at the iteration
flush) and Updated (cache level or priority changes). Events collect in a pending list;
`flush()` publishes them to a bounded queue that drops the oldest when full.

Block hashes are `BlockHash` values: 32-byte `bytes` (SHA-256, the default) or an `int` in
[0, 2**64) (`CacheConfig(event_hash="trtllm64")`), the two shapes vLLM's KV-event wire format
carries (`ExternalBlockHash = bytes | int`; msgpack ints stop at 64 bits, so a 256-bit digest
travels as bytes). See docs/semantics.md.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any

from kvjax.ledger.block_key import MmKey

BlockHash = bytes | int


@dataclasses.dataclass(frozen=True, slots=True)
class CreatedData:
    num_blocks_per_cache_level: tuple[int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class StoredBlock:
    block_hash: BlockHash
    tokens: tuple
    lora_id: int | None
    cache_level: int
    priority: int
    mm_keys: tuple[MmKey, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class StoredData:
    parent_hash: BlockHash | None
    blocks: tuple[StoredBlock, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class RemovedData:
    block_hashes: tuple[BlockHash, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class UpdatedData:
    block_hash: BlockHash
    cache_level: tuple[int, int] | None = None
    priority: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheEvent:
    event_id: int
    window_size: int
    data: CreatedData | StoredData | RemovedData | UpdatedData


# Fast constructors. The frozen dataclasses' `__init__` sets each field with one
# `object.__setattr__` call; the ledger builds one `StoredBlock` per stored block (and one
# event per stored run) from values it already holds checked, so it fills a mutable twin with
# the same slots (plain slot stores) and then makes it the frozen class (`__class__`
# assignment between classes of one slot layout). Each constructor fills every field of its
# class (tests compare the results with the dataclass constructors).
def _mutable_twin(cls: type) -> type:
    slots = tuple(f.name for f in dataclasses.fields(cls))
    assert slots == cls.__dict__["__slots__"]  # the layout `__class__` assignment needs
    return type(f"_Mutable{cls.__name__}", (), {"__slots__": slots})


_StoredBlockFields = _mutable_twin(StoredBlock)
_StoredDataFields = _mutable_twin(StoredData)
_RemovedDataFields = _mutable_twin(RemovedData)
_EventFields = _mutable_twin(KVCacheEvent)


def add_stored_blocks(
    out: list[StoredBlock],
    hashes: list,
    tokens: list[tuple],
    lora_id: int | None,
    attached: list[tuple[int, int]],
    levels,
    priorities,
    mm_keys: tuple[MmKey, ...],
) -> None:
    """Append one `StoredBlock` per block of a run of one node (the frozen records,
    built in one loop): `hashes[i]` and `tokens[i]` belong to the block of `attached[i]` (a
    (depth, block id) pair), whose level and priority are read from the `levels` and
    `priorities` columns."""
    append = out.append
    obj: Any
    for (_, b), h, t in zip(attached, hashes, tokens, strict=True):
        obj = _StoredBlockFields()
        obj.block_hash = h
        obj.tokens = t
        obj.lora_id = lora_id
        obj.cache_level = levels[b]
        obj.priority = priorities[b]
        obj.mm_keys = mm_keys
        obj.__class__ = StoredBlock
        append(obj)


def _new_stored_data(parent_hash: BlockHash | None, blocks: tuple[StoredBlock, ...]) -> StoredData:
    obj: Any = _StoredDataFields()
    obj.parent_hash = parent_hash
    obj.blocks = blocks
    obj.__class__ = StoredData
    return obj


def _new_removed_data(block_hashes: tuple[BlockHash, ...]) -> RemovedData:
    obj: Any = _RemovedDataFields()
    obj.block_hashes = block_hashes
    obj.__class__ = RemovedData
    return obj


def _new_event(event_id: int, window_size: int, data: CreatedData | StoredData | RemovedData | UpdatedData) -> KVCacheEvent:
    obj: Any = _EventFields()
    obj.event_id = event_id
    obj.window_size = window_size
    obj.data = data
    obj.__class__ = KVCacheEvent
    return obj


class KVCacheEventManager:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._ids = itertools.count()
        self._pending: collections.deque[KVCacheEvent] = collections.deque(maxlen=max_size)
        self._removed: dict[int, list[BlockHash]] = {}
        self._published: collections.deque[KVCacheEvent] = collections.deque(maxlen=max_size)
        self._cond = threading.Condition()
        self.dropped = 0

    def _enqueue(self, window: int, data) -> None:
        if len(self._pending) == self.max_size:
            self.dropped += 1
        self._pending.append(_new_event(next(self._ids), window, data))

    def created(self, window: int, num_primary: int, num_secondary: int) -> None:
        self._enqueue(window, CreatedData((num_primary, num_secondary)))

    def stored(self, window: int, parent_hash: BlockHash | None, blocks: tuple[StoredBlock, ...]) -> None:
        if self._removed:
            self._flush_removed(window)
        self._enqueue(window, _new_stored_data(parent_hash, blocks))

    def stored_one(
        self, window: int, parent_hash: BlockHash | None, block_hash: BlockHash, tokens: tuple, lora_id: int | None,
        cache_level: int, priority: int, mm_keys: tuple[MmKey, ...],
    ) -> None:
        """`stored` of one new block (a decode block: the most frequent Stored event), its
        three records built in place (as `add_stored_blocks`, `_new_stored_data` and `_new_event` build
        them)."""
        if self._removed:
            self._flush_removed(window)
        blk: Any = _StoredBlockFields()
        blk.block_hash = block_hash
        blk.tokens = tokens
        blk.lora_id = lora_id
        blk.cache_level = cache_level
        blk.priority = priority
        blk.mm_keys = mm_keys
        blk.__class__ = StoredBlock
        data: Any = _StoredDataFields()
        data.parent_hash = parent_hash
        data.blocks = (blk,)
        data.__class__ = StoredData
        ev: Any = _EventFields()
        ev.event_id = next(self._ids)
        ev.window_size = window
        ev.data = data
        ev.__class__ = KVCacheEvent
        pending = self._pending
        if len(pending) == self.max_size:
            self.dropped += 1
        pending.append(ev)

    def removed(self, window: int, block_hash: BlockHash) -> None:
        self._removed.setdefault(window, []).append(block_hash)

    def removed_many(self, window: int, block_hashes: list[BlockHash]) -> None:
        """`removed` of each hash, in order."""
        if block_hashes:
            self._removed.setdefault(window, []).extend(block_hashes)

    def updated(self, window: int, block_hash: BlockHash, cache_level=None, priority=None) -> None:
        self._enqueue(window, UpdatedData(block_hash, cache_level, priority))

    def _flush_removed(self, window: int) -> None:
        hashes = self._removed.pop(window, None)
        if hashes:
            self._enqueue(window, _new_removed_data(tuple(hashes)))

    def flush(self) -> None:
        """End of an iteration: publish pending removes and every pending event."""
        for window in sorted(self._removed):
            self._flush_removed(window)
        with self._cond:
            for ev in self._pending:
                if len(self._published) == self.max_size:
                    self.dropped += 1
                self._published.append(ev)
            self._pending.clear()
            self._cond.notify_all()

    def get_latest(self, timeout: float | None = None) -> list[KVCacheEvent]:
        """Published events, oldest first (waits up to `timeout` seconds if there are none)."""
        with self._cond:
            if not self._published and timeout:
                deadline = time.monotonic() + timeout
                while not self._published:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._cond.wait(remaining):
                        break
            out = list(self._published)
            self._published.clear()
            return out

    def state(self) -> tuple:
        return (
            tuple(self._pending),
            tuple((w, tuple(h)) for w, h in sorted(self._removed.items())),
            tuple(self._published),
        )
