"""The wire format: vLLM 0.33's msgpack layout (decoded with vLLM's own structs), both hash
types, and the older layouts a router must still read."""
from typing import Any

import msgspec
import pytest
from kv_helpers import RandomDriver, small_config

from kvjax import KVCacheManager
from kvjax.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    LedgerEventAdapter,
    WireFormatError,
    canonical_hash,
    decode_batch,
    encode_batch,
)


# ---------------------------------------------------------------- vLLM 0.33's structs
# Declared field for field (names, order, defaults, array_like / omit_defaults / tag) from
# vllm/distributed/kv_events.py of vLLM 0.33.0; ExternalBlockHash is `bytes | int`
# (vllm/v1/core/kv_cache_utils.py). Its decoder rejects an event missing a field without default.
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
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


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(VKVEventBatch)


def test_vllm_decodes_every_event_kvjax_sends():
    batch = KVEventBatch(1.25, [
        BlockStored([7, (1 << 64) - 1], None, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0,
                    kv_cache_spec_kind="full_attention"),
        BlockStored([b"\x02" * 32], 7, [5, 6], 2, 3, "CPU", "adapter-a", extra_keys=[("img", 0)], group_idx=1,
                    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64),
        BlockRemoved([b"\x01" * 32], "CPU", group_idx=0),
        AllBlocksCleared(),
    ], 3)
    got = VLLM_DECODER.decode(encode_batch(batch))
    assert msgspec.to_builtins(got) == msgspec.to_builtins(batch)  # every field, same values
    assert [type(e).__name__ for e in got.events] == ["VBlockStored", "VBlockStored", "VBlockRemoved",
                                                      "VAllBlocksCleared"]
    # and the other way: what vLLM 0.33 encodes (its new optional fields set) kvjax decodes
    back = decode_batch(msgspec.msgpack.encode(got))
    assert back == batch
    theirs = VKVEventBatch(2.0, [VBlockStored([1], None, [1, 2], 2, None, "STORAGE", None, locality="REMOTE",
                                              ownership="fs0", session_id="s", lookahead_token_ids=[[3]]),
                                 VBlockRemoved([1], "STORAGE", locality="REMOTE", ownership="fs0")], 0)
    mine = decode_batch(msgspec.msgpack.encode(theirs))
    assert msgspec.to_builtins(mine) == msgspec.to_builtins(theirs)


def test_vllm_decodes_a_serving_ledgers_stream():
    """A seeded serving run (stores, reuse, eviction, offload, onboard): every batch the adapter
    makes decodes with vLLM's structs to the same events."""
    cfg = small_config()
    led = KVCacheManager(cfg)
    ad = LedgerEventAdapter(cfg, data_parallel_rank=0)
    drv = RandomDriver(led, seed=11)
    kinds = set()
    for _ in range(60):
        drv.step()
        batch = ad.convert(led.get_latest_events(), ts=1.0)
        if batch is None:
            continue
        got = VLLM_DECODER.decode(encode_batch(batch))
        assert msgspec.to_builtins(got) == msgspec.to_builtins(batch)
        kinds.update((type(e).__name__, getattr(e, "medium", None)) for e in got.events)
    assert {("VBlockStored", "GPU"), ("VBlockStored", "CPU"), ("VBlockRemoved", "GPU")} <= kinds


def test_lora_name_is_always_on_the_wire():
    # vLLM 0.33 declares lora_name without a default: an event without it does not decode there
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(1.0, [BlockStored([1], None, [1], 1, None, "GPU", None)])))
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1],
                         "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None}
    del raw[1][0]["lora_name"]
    with pytest.raises(msgspec.ValidationError, match="lora_name"):
        VLLM_DECODER.decode(msgspec.msgpack.encode(raw))


def test_layout_is_vllms():
    batch = KVEventBatch(1.25, [
        BlockStored([7, (1 << 64) - 1], None, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0,
                    kv_cache_spec_kind="full_attention"),
        BlockRemoved([b"\x01" * 32], "CPU", group_idx=0),
        AllBlocksCleared(),
    ], 3)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    # EventBatch is array_like: [ts, events, data_parallel_rank]
    assert isinstance(raw, list) and raw[0] == 1.25 and raw[2] == 3
    stored, removed, cleared = raw[1]
    # events are tagged maps in declaration order; optional fields at their default are omitted
    assert list(stored.items()) == [("type", "BlockStored"), ("block_hashes", [7, (1 << 64) - 1]),
                                    ("parent_block_hash", None), ("token_ids", [1, 2, 3, 4]), ("block_size", 2),
                                    ("lora_id", None), ("medium", "GPU"), ("lora_name", None), ("group_idx", 0),
                                    ("kv_cache_spec_kind", "full_attention")]
    assert removed == {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "CPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(batch)) == batch


def test_array_layout_keeps_an_unset_rank():
    # msgspec omits defaults from maps only: an array keeps its positions, so the rank is nil
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(0.5, [AllBlocksCleared()])))
    assert raw == [0.5, [{"type": "AllBlocksCleared"}], None]


# ---------------------------------------------------------------- older layouts
# kvjax before this layout (and vLLM releases that gave lora_name a default): map events,
# lora_name omitted when None.
class OldKvjaxEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldKvjaxEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class OldBlockRemoved(OldKvjaxEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class OldAllBlocksCleared(OldKvjaxEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]
    data_parallel_rank: int | None = None


def test_reads_older_kvjax_map_events_without_lora_name():
    old = OldBatch(3.0, [OldBlockStored([5, b"\x07" * 32], None, [1, 2, 3, 4], 2, 9, "GPU", group_idx=1,
                                        kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8),
                         OldBlockStored([6], 5, [1, 2], 2, None, "CPU", "named"),
                         OldBlockRemoved([5], "GPU", group_idx=1), OldAllBlocksCleared()], 2)
    payload = msgspec.msgpack.encode(old)
    assert "lora_name" not in msgspec.msgpack.decode(payload)[1][0]
    batch = decode_batch(payload)
    assert batch == KVEventBatch(3.0, [
        BlockStored([5, b"\x07" * 32], None, [1, 2, 3, 4], 2, 9, "GPU", None, group_idx=1,
                    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8),
        BlockStored([6], 5, [1, 2], 2, None, "CPU", "named"),
        BlockRemoved([5], "GPU", group_idx=1), AllBlocksCleared()], 2)
    # re-encoded, it is vLLM 0.33's layout
    assert VLLM_DECODER.decode(encode_batch(batch)).events[0].lora_id == 9


# The first vLLM releases' structs (vllm/distributed/kv_events.py of vLLM 0.9.0): everything
# array_like, no medium, no data-parallel rank.
class V09Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V09BlockStored(V09Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class V09BlockRemoved(V09Event, tag="BlockRemoved"):
    block_hashes: list[int]


class V09AllBlocksCleared(V09Event, tag="AllBlocksCleared"):
    pass


class V09Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[V09BlockStored | V09BlockRemoved | V09AllBlocksCleared]


def test_reads_the_older_all_array_layouts():
    old = msgspec.msgpack.encode(V09Batch(1.0, [V09BlockStored([5], None, [1, 2], 2, 4), V09BlockRemoved([5]),
                                                V09AllBlocksCleared()]))
    batch = decode_batch(old)
    assert batch == KVEventBatch(1.0, [BlockStored([5], None, [1, 2], 2, 4, None, None), BlockRemoved([5], None),
                                       AllBlocksCleared()])
    # the later all-array releases added medium, lora_name, extra keys, group and cache spec
    later = msgspec.msgpack.encode([2.0, [["BlockStored", [5, 6], 3, [1, 2, 3, 4], 2, None, "GPU", "l", None, 0,
                                           "full_attention", None],
                                          ["BlockRemoved", [9], "GPU"], ["AllBlocksCleared"]], 1])
    batch = decode_batch(later)
    assert batch.events == [BlockStored([5, 6], 3, [1, 2, 3, 4], 2, None, "GPU", "l", group_idx=0,
                                        kv_cache_spec_kind="full_attention"),
                            BlockRemoved([9], "GPU"), AllBlocksCleared()]
    assert batch.data_parallel_rank == 1


@pytest.mark.parametrize("payload", [b"", b"\x01", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockExploded"}]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])])
def test_garbage_is_a_typed_error(payload):
    with pytest.raises(WireFormatError):
        decode_batch(payload)


def test_canonical_hash():
    assert canonical_hash(-1) == (1 << 64) - 1  # the same bits sent as a signed i64
    assert canonical_hash(5) == 5 and canonical_hash(bytearray(b"ab")) == b"ab"
    with pytest.raises(ValueError):
        canonical_hash(1 << 64)
    with pytest.raises(TypeError):
        canonical_hash(True)
    with pytest.raises(TypeError):
        canonical_hash("abc")
