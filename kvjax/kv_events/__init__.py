"""KV-cache events on the wire, in vLLM's format (docs/kv_events.md).

`wire` declares the msgspec structs and the msgpack encoding; `LedgerEventAdapter` turns a
kvjax ledger's events into them (medium, group and data-parallel rank filled in);
`ZmqEventPublisher` sends batches on a ZeroMQ PUB socket with a ROUTER replay socket;
`KVEventSubscriber` reads a stream in order, replaying gaps.
"""
from kvjax.kv_events.adapter import LedgerEventAdapter
from kvjax.kv_events.publisher import END_SEQ, ZmqEventPublisher, is_bind_endpoint
from kvjax.kv_events.subscriber import KVEventSubscriber
from kvjax.kv_events.wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
    WireEventBase,
    WireFormatError,
    canonical_hash,
    decode_batch,
    encode_batch,
)

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEventBatch",
    "KVEventSubscriber",
    "LedgerEventAdapter",
    "WireEventBase",
    "WireFormatError",
    "ZmqEventPublisher",
    "canonical_hash",
    "decode_batch",
    "encode_batch",
    "is_bind_endpoint",
]
