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

from kvjax.ledger.block_key import MmKey

BlockHash = bytes | int


@dataclasses.dataclass(frozen=True)
class CreatedData:
    num_blocks_per_cache_level: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class StoredBlock:
    block_hash: BlockHash
    tokens: tuple
    lora_id: int | None
    cache_level: int
    priority: int
    mm_keys: tuple[MmKey, ...] = ()


@dataclasses.dataclass(frozen=True)
class StoredData:
    parent_hash: BlockHash | None
    blocks: tuple[StoredBlock, ...]


@dataclasses.dataclass(frozen=True)
class RemovedData:
    block_hashes: tuple[BlockHash, ...]


@dataclasses.dataclass(frozen=True)
class UpdatedData:
    block_hash: BlockHash
    cache_level: tuple[int, int] | None = None
    priority: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class KVCacheEvent:
    event_id: int
    window_size: int
    data: CreatedData | StoredData | RemovedData | UpdatedData


# Positional constructors that skip the generated `__init__` of the frozen dataclasses (one
# `object.__setattr__` per field): the ledger builds one event per stored run and one
# `StoredBlock` per stored block from values it already holds checked. Each fills every field
# of its class (tests compare them with the dataclass constructors).
_new, _set = object.__new__, object.__setattr__


def new_stored_block(
    block_hash: BlockHash, tokens: tuple, lora_id: int | None, cache_level: int, priority: int, mm_keys: tuple[MmKey, ...]
) -> StoredBlock:
    obj = _new(StoredBlock)
    _set(obj, "__dict__", {
        "block_hash": block_hash, "tokens": tokens, "lora_id": lora_id,
        "cache_level": cache_level, "priority": priority, "mm_keys": mm_keys,
    })  # fmt: skip
    return obj


def _new_stored_data(parent_hash: BlockHash | None, blocks: tuple[StoredBlock, ...]) -> StoredData:
    obj = _new(StoredData)
    _set(obj, "__dict__", {"parent_hash": parent_hash, "blocks": blocks})
    return obj


def _new_event(event_id: int, window_size: int, data: CreatedData | StoredData | RemovedData | UpdatedData) -> KVCacheEvent:
    obj = _new(KVCacheEvent)
    _set(obj, "__dict__", {"event_id": event_id, "window_size": window_size, "data": data})
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

    def stored(self, window: int, parent_hash: BlockHash | None, blocks: list[StoredBlock]) -> None:
        self._flush_removed(window)
        self._enqueue(window, _new_stored_data(parent_hash, tuple(blocks)))

    def removed(self, window: int, block_hash: BlockHash) -> None:
        self._removed.setdefault(window, []).append(block_hash)

    def updated(self, window: int, block_hash: BlockHash, cache_level=None, priority=None) -> None:
        self._enqueue(window, UpdatedData(block_hash, cache_level, priority))

    def _flush_removed(self, window: int) -> None:
        hashes = self._removed.pop(window, None)
        if hashes:
            self._enqueue(window, RemovedData(tuple(hashes)))

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
