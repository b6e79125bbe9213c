"""The KVStore contract, checked on every built-in store (memory, file, Redis)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kvjax.kv_store import KVStore, StoreBufferError, StoreClosedError, StoreKeyError


def blocks(n: int, shape=(2, 4, 8), dtype=np.float32, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


def test_is_a_kvstore(any_store):
    assert isinstance(any_store, KVStore)


def test_round_trip_fills_caller_buffers_in_place(any_store):
    keys = [f"k{i}" for i in range(4)]
    src = blocks(4)
    assert any_store.batch_put(keys, src) == [True] * 4
    host = np.zeros((4, 2, 4, 8), np.float32)  # a host pool: get into views of its blocks
    views = [host[i] for i in range(4)]
    assert any_store.batch_get_into(keys, views) == [True] * 4
    for i in range(4):
        np.testing.assert_array_equal(host[i], src[i])


def test_bfloat16_and_bytes_like_buffers(any_store):
    a = np.arange(64, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(4, 16)
    assert any_store.batch_put(["bf", "raw"], [a, b"\x01\x02\x03"]) == [True, True]
    out = np.zeros_like(a)
    raw = bytearray(3)
    assert any_store.batch_get_into(["bf", "raw"], [out, memoryview(raw)]) == [True, True]
    assert out.tobytes() == a.tobytes() and bytes(raw) == b"\x01\x02\x03"


def test_batch_exists_is_the_longest_present_prefix(any_store):
    any_store.batch_put(["a", "b", "d"], [b"1", b"2", b"4"])
    assert any_store.batch_exists(["a", "b", "c", "d"]) == 2
    assert any_store.batch_exists(["c", "a"]) == 0
    assert any_store.batch_exists(["a", "b", "d"]) == 3
    assert any_store.batch_exists([]) == 0


def test_missing_and_size_mismatch_are_per_key_failures(any_store):
    any_store.batch_put(["a", "b"], [b"x" * 16, b"y" * 16])
    bufs = [bytearray(16), bytearray(8), bytearray(16)]
    assert any_store.batch_get_into(["a", "b", "nope"], bufs) == [True, False, False]
    assert bytes(bufs[0]) == b"x" * 16


def test_put_replaces_whole_value(any_store):
    any_store.batch_put(["a"], [b"old-value"])
    any_store.batch_put(["a"], [b"new"])
    buf = bytearray(3)
    assert any_store.batch_get_into(["a"], [buf]) == [True] and bytes(buf) == b"new"
    assert any_store.batch_get_into(["a"], [bytearray(9)]) == [False]


def test_remove_counts_present_keys(any_store):
    any_store.batch_put(["a", "b"], [b"1", b"2"])
    assert any_store.remove(["a", "zz"]) == 1
    assert any_store.batch_exists(["a"]) == 0 and any_store.batch_exists(["b"]) == 1


@pytest.mark.parametrize("bad", ["", "a/b", "../x", ".hidden", "a b", "x" * 201, "é"])
def test_bad_keys_are_refused_before_anything_is_written(any_store, bad):
    with pytest.raises(StoreKeyError):
        any_store.batch_put(["ok", bad], [b"1", b"2"])
    assert any_store.batch_exists(["ok"]) == 0
    with pytest.raises(StoreKeyError):
        any_store.batch_exists([bad])
    with pytest.raises(StoreKeyError):
        any_store.batch_get_into([bad], [bytearray(1)])


def test_bad_batches_are_refused_before_anything_is_written(any_store):
    with pytest.raises(StoreKeyError):
        any_store.batch_put("abc", [b"1", b"2", b"3"])  # a str is not a list of keys
    with pytest.raises(StoreKeyError):
        any_store.batch_put(["a", "a"], [b"1", b"2"])
    with pytest.raises(StoreBufferError):
        any_store.batch_put(["a", "b"], [b"1"])
    with pytest.raises(StoreBufferError):
        any_store.batch_put(["a", "b"], [b"1", 7])
    assert any_store.batch_exists(["a"]) == 0
    any_store.batch_put(["a"], [b"12345678"])
    strided = np.zeros(16, np.uint8)[::2]
    with pytest.raises(StoreBufferError):
        any_store.batch_get_into(["a"], [strided])
    with pytest.raises(StoreBufferError):
        any_store.batch_get_into(["a"], [b"\0" * 8])  # read-only
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(StoreBufferError):
        any_store.batch_get_into(["a"], [ro])
    with pytest.raises(StoreBufferError, match="objects"):
        any_store.batch_put(["b"], [np.array([b"x"] * 8, dtype=object)])


def test_closed_store_refuses_calls(any_store):
    any_store.close()
    with pytest.raises(StoreClosedError):
        any_store.batch_exists(["a"])
    with pytest.raises(StoreClosedError):
        any_store.batch_put(["a"], [b"1"])
