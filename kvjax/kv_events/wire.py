"""vLLM's KV-events wire format, declared as msgspec structs.

Payloads are msgpack. An `EventBatch` is `array_like` (encoded as the array
`[ts, events, data_parallel_rank]`); each event is a tagged struct encoded as a map whose `type`
key names the class (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). `omit_defaults` drops
an event's optional fields left at their defaults; the fields vLLM declares without a default
(`BlockStored.lora_name` among them) are always sent, because vLLM's own decoder rejects an
event that lacks one. This is field for field the layout of vLLM 0.33's
`vllm/distributed/kv_events.py`, read by vLLM's own subscriber, llm-d's KV-cache manager and
Dynamo's KV router. `decode_batch` also reads the older layouts: map events without
`lora_name` (earlier vLLM releases and earlier kvjax) and the tagged arrays of the first vLLM
releases, so a router can follow replicas of any generation.

Block hashes (`ExternalBlockHash`) are `int | bytes`: kvjax's 64-bit chained hashes go out as
unsigned ints; a 32-byte digest goes out as bytes.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kvjax.errors import KVCacheError

MEDIUM_GPU = "GPU"  # the primary (device) tier
MEDIUM_CPU = "CPU"  # the secondary (pinned host) tier
MEDIUM_STORAGE = "STORAGE"  # the third tier: an external store (kvjax.kv_store; vLLM's name)

KIND_FULL_ATTENTION = "full_attention"
KIND_SLIDING_WINDOW = "sliding_window"

_M64 = (1 << 64) - 1

BlockHash = int | bytes


class WireFormatError(KVCacheError, ValueError):
    """A payload that is not a KV-event batch in vLLM's wire format (either layout)."""


def canonical_hash(h: Any) -> BlockHash:
    """A block hash as the wire and the index key it: ints as unsigned 64-bit values (some
    producers send the same bits as a signed i64), bytes unchanged."""
    if isinstance(h, bool):
        raise TypeError(f"a block hash is an int or bytes, got {h!r}")
    if isinstance(h, int):
        if not -(1 << 63) <= h <= _M64:
            raise ValueError(f"an int block hash must fit 64 bits, got {h}")
        return h & _M64
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    raise TypeError(f"a block hash is an int or bytes, got {type(h).__name__}")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class WireEventBase(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events (the tag is the class name)."""


class BlockStored(WireEventBase):
    """Consecutive blocks of one chain: `block_hashes[0]`'s parent is `parent_block_hash`
    (None at the root), each later block's parent is the block before it; `token_ids` holds
    `block_size` tokens per block, in order. The fields before `extra_keys` have no default,
    as in vLLM: they are always encoded. kvjax leaves the last four (vLLM's offloading tiers,
    sessions and lookahead hashing) unset."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(WireEventBase):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(WireEventBase):
    """Every block of the publisher is gone (a fresh or reset cache)."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[WireEvent]


# ---------------------------------------------------------------------- older layouts
# Map events that may lack fields vLLM 0.33 requires: kvjax before it, and vLLM releases that
# gave `lora_name` a default (omitted when None). Decoded only when the strict layout fails.
class _MapBlockStored(WireEventBase, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _MapKVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapBlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def _from_map_event(e) -> WireEvent:
    if isinstance(e, _MapBlockStored):
        return BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium,
                           e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window,
                           e.locality, e.ownership, e.session_id, e.lookahead_token_ids)
    return e


# vLLM releases before the map layout declared the events `array_like` too:
# ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...];
# the first ones stopped after lora_id and sent no data-parallel rank.
class _ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayKVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


def _from_array_event(e) -> WireEvent:
    if isinstance(e, _ArrayBlockStored):
        return BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium,
                           e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
    if isinstance(e, _ArrayBlockRemoved):
        return BlockRemoved(e.block_hashes, e.medium, e.group_idx)
    return AllBlocksCleared()


# ---------------------------------------------------------------------- encode / decode
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_OLDER: tuple[tuple[msgspec.msgpack.Decoder, Any], ...] = (
    (msgspec.msgpack.Decoder(_MapKVEventBatch), _from_map_event),
    (msgspec.msgpack.Decoder(_ArrayKVEventBatch), _from_array_event),
)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of one batch (what the PUB socket sends after topic and sequence)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload in any layout (vLLM 0.33's first, then the older ones); raises
    `WireFormatError` for anything else."""
    try:
        return _decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as first:
        for decoder, convert in _OLDER:
            try:
                old = decoder.decode(payload)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            return KVEventBatch(old.ts, [convert(e) for e in old.events], old.data_parallel_rank)
        raise WireFormatError(f"not a KV-event batch: {first}") from None
