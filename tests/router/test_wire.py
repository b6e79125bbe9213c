"""The wire format: vLLM's msgpack layout, both hash types, the older all-array layout."""
import msgspec
import pytest

from kvjax.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireFormatError,
    canonical_hash,
    decode_batch,
    encode_batch,
)


def test_layout_is_vllms():
    batch = KVEventBatch(1.25, [
        BlockStored([7, (1 << 64) - 1], None, [1, 2, 3, 4], 2, None, "GPU", group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemoved([b"\x01" * 32], "CPU", group_idx=0),
        AllBlocksCleared(),
    ], 3)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    # EventBatch is array_like: [ts, events, data_parallel_rank]
    assert isinstance(raw, list) and raw[0] == 1.25 and raw[2] == 3
    stored, removed, cleared = raw[1]
    # events are tagged maps; optional fields at their default are omitted
    assert stored == {"type": "BlockStored", "block_hashes": [7, (1 << 64) - 1], "parent_block_hash": None,
                      "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU", "group_idx": 0,
                      "kv_cache_spec_kind": "full_attention"}
    assert removed == {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "CPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}
    assert decode_batch(encode_batch(batch)) == batch


def test_array_layout_keeps_an_unset_rank():
    # msgspec omits defaults from maps only: an array keeps its positions, so the rank is nil
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(0.5, [AllBlocksCleared()])))
    assert raw == [0.5, [{"type": "AllBlocksCleared"}], None]


def test_reads_the_older_all_array_layout():
    old = msgspec.msgpack.encode([2.0, [["BlockStored", [5, 6], 3, [1, 2, 3, 4], 2, None, "GPU"],
                                        ["BlockRemoved", [9], "GPU"], ["AllBlocksCleared"]]])
    batch = decode_batch(old)
    assert batch.events == [BlockStored([5, 6], 3, [1, 2, 3, 4], 2, None, "GPU"), BlockRemoved([9], "GPU"),
                            AllBlocksCleared()]
    # the oldest layout had neither medium nor data-parallel rank
    batch = decode_batch(msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [1, 2], 2, 4]]]))
    assert batch.events[0].lora_id == 4 and batch.events[0].medium is None and batch.data_parallel_rank is None


@pytest.mark.parametrize("payload", [b"", b"\x01", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockExploded"}]])])
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
