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
import functools
import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

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


class StoredColumns(NamedTuple):
    """A Stored event's blocks as columns, oldest first: what the ledger builds (one record per
    stored run instead of one per block) and what `StoredData.blocks` is made from when first
    read. The wire publisher (`kvjax.kv_events.LedgerEventAdapter`) reads them directly."""

    block_hashes: tuple[BlockHash, ...]
    token_ids: tuple[int, ...]  # every block's tokens, in order; only the last block may be partial
    block_size: int  # tokens per full block
    lora_id: int | None
    cache_levels: tuple[int, ...]  # per block
    priorities: tuple[int, ...]  # per block
    mm_keys: tuple[MmKey, ...]  # of every block (a block with multimodal keys is a run of its own)


new_columns = functools.partial(tuple.__new__, StoredColumns)  # without the Python-level `__new__`


class StoredData:
    """Stored: consecutive new blocks under one parent (`parent_hash`, None at the root), as
    `blocks`, one `StoredBlock` each. Immutable, compared and hashed by those two fields, like
    the other records. The ledger makes it from `StoredColumns` (`columns`): its per-block
    records are built when `blocks` is first read, so a consumer that reads the columns (the
    wire publisher does) or only counts the blocks (`num_blocks`) never pays for them."""

    __slots__ = ("parent_hash", "_blocks", "_columns")
    __match_args__ = ("parent_hash", "blocks")
    parent_hash: BlockHash | None
    _blocks: tuple[StoredBlock, ...] | None  # None until first read
    _columns: StoredColumns | None

    def __init__(self, parent_hash: BlockHash | None, blocks: tuple[StoredBlock, ...]) -> None:
        object.__setattr__(self, "parent_hash", parent_hash)
        object.__setattr__(self, "_blocks", blocks)
        object.__setattr__(self, "_columns", None)

    @property
    def blocks(self) -> tuple[StoredBlock, ...]:
        b = self._blocks
        if b is None:
            c = self._columns
            assert c is not None  # one of the two is always set
            b = _blocks_of(c)
            object.__setattr__(self, "_blocks", b)  # built once; equal however often
        return b

    @property
    def columns(self) -> StoredColumns | None:
        """The columns the ledger built this event from (None for one made from `blocks`)."""
        return self._columns

    @property
    def num_blocks(self) -> int:
        c = self._columns
        return len(self.blocks) if c is None else len(c.block_hashes)

    def __setattr__(self, name: str, value: object) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not StoredData:
            return NotImplemented
        assert isinstance(other, StoredData)
        return self.parent_hash == other.parent_hash and self.blocks == other.blocks

    def __hash__(self) -> int:
        return hash((self.parent_hash, self.blocks))

    def __repr__(self) -> str:
        return f"StoredData(parent_hash={self.parent_hash!r}, blocks={self.blocks!r})"

    def __reduce__(self) -> tuple:
        return StoredData, (self.parent_hash, self.blocks)


def stored_data_from_columns(parent_hash: BlockHash | None, columns: StoredColumns) -> StoredData:
    """The `StoredData` of `columns` (its `blocks` built on first read)."""
    return _new_stored_data(parent_hash, None, columns)


def _blocks_of(c: StoredColumns) -> tuple[StoredBlock, ...]:
    """The `StoredBlock`s of `columns` (built as `add_stored_blocks` builds them)."""
    toks, bs = c.token_ids, c.block_size
    per_block = list(zip(*[iter(toks)] * bs, strict=False))  # full blocks' tuples, one C-level pass
    if len(per_block) < len(c.block_hashes):  # a partial last block
        per_block.append(toks[len(per_block) * bs :])
    out: list[StoredBlock] = []
    add_stored_blocks(out, c.block_hashes, per_block, c.lora_id, c.cache_levels, c.priorities, c.mm_keys)
    return tuple(out)


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


# Fast constructors. The frozen records' `__init__` sets each field with one
# `object.__setattr__` call; the ledger builds one event per stored run (and, where a run's
# tokens are not plain ids, one `StoredBlock` per block) from values it already holds checked,
# so it fills a mutable twin with the same slots (plain slot stores) and then makes it the
# frozen class (`__class__` assignment between classes of one slot layout). Each constructor
# fills every field of its class (tests compare the results with the public constructors).
def _mutable_twin(cls: type) -> type:
    slots = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else cls.__dict__["__slots__"]
    assert slots == cls.__dict__["__slots__"]  # the layout `__class__` assignment needs
    return type(f"_Mutable{cls.__name__}", (), {"__slots__": slots})


_StoredBlockFields = _mutable_twin(StoredBlock)
_StoredDataFields = _mutable_twin(StoredData)
_RemovedDataFields = _mutable_twin(RemovedData)
_EventFields = _mutable_twin(KVCacheEvent)


def add_stored_blocks(
    out: list[StoredBlock],
    hashes: Sequence[BlockHash],
    tokens: Sequence[tuple],
    lora_id: int | None,
    levels: Sequence[int],
    priorities: Sequence[int],
    mm_keys: tuple[MmKey, ...],
) -> None:
    """Append one `StoredBlock` per block (the frozen records, built in one loop): block i
    has `hashes[i]`, `tokens[i]`, `levels[i]` and `priorities[i]`; the LoRA id and multimodal
    keys are the run's."""
    append = out.append
    obj: Any
    for h, t, level, prio in zip(hashes, tokens, levels, priorities, strict=True):
        obj = _StoredBlockFields()
        obj.block_hash = h
        obj.tokens = t
        obj.lora_id = lora_id
        obj.cache_level = level
        obj.priority = prio
        obj.mm_keys = mm_keys
        obj.__class__ = StoredBlock
        append(obj)


def _new_stored_data(
    parent_hash: BlockHash | None, blocks: tuple[StoredBlock, ...] | None, columns: StoredColumns | None = None
) -> StoredData:
    """A `StoredData` of its records, or of its columns (`blocks` None)."""
    obj: Any = _StoredDataFields()
    obj.parent_hash = parent_hash
    obj._blocks = blocks
    obj._columns = columns
    obj.__class__ = StoredData
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
        ev: Any = _EventFields()  # every record goes through here: built without the dataclass `__init__`
        ev.event_id = next(self._ids)
        ev.window_size = window
        ev.data = data
        ev.__class__ = KVCacheEvent
        pending = self._pending
        if len(pending) == self.max_size:
            self.dropped += 1
        pending.append(ev)

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
        """`stored` of one new block whose tokens are not plain ids (extra ids: pairs)."""
        blocks: list[StoredBlock] = []
        add_stored_blocks(blocks, (block_hash,), (tokens,), lora_id, (cache_level,), (priority,), mm_keys)
        self.stored(window, parent_hash, tuple(blocks))

    def stored_columns(self, window: int, parent_hash: BlockHash | None, columns: StoredColumns) -> None:
        """`stored` of the blocks `columns` describe (the ledger's usual Stored event: two
        records per run, whatever its length)."""
        if self._removed:
            self._flush_removed(window)
        self._enqueue(window, stored_data_from_columns(parent_hash, columns))

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
            data: Any = _RemovedDataFields()
            data.block_hashes = tuple(hashes)
            data.__class__ = RemovedData
            self._enqueue(window, data)

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
