"""Forward batches: bucketed shapes, slot mappings that follow the ledger's block tables,
left-padded rows, padding rows that attend to nothing."""
import numpy as np
import pytest

from kvjax import CacheConfig, KVCacheManager, Request
from kvjax.engine import Buckets, Row, build_batch

TPB = 4


@pytest.fixture
def led():
    m = KVCacheManager(CacheConfig(tokens_per_block=TPB, num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=64,
                                   primary_blocks=32))
    m.add_sequence(Request("a", list(range(1, 11)), max_new_tokens=4))  # 3 blocks
    m.add_sequence(Request("b", list(range(50, 53)), max_new_tokens=4))  # 1 block
    return m


def test_prefill_rows_are_left_padded_and_bucketed(led):
    rows = [Row("a", list(range(5, 11)), 4), Row("b", [50, 51, 52], 0)]  # a: positions 4..9, b: 0..2
    batch = build_batch(led, rows, Buckets(min_batch=4, min_chunk=4, min_blocks=2))
    assert batch.shape == (2, 8, 4)  # prefill rows bucket from 1; chunk 6 -> 8; 3 blocks -> 4
    np.testing.assert_array_equal(batch.seq_lens, [10, 3])
    np.testing.assert_array_equal(batch.tokens[0], [0, 0, 5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(batch.positions[0], np.arange(2, 10))
    (w,) = led.windows
    table = led.block_table(["a", "b"], w)
    slots = batch.slots[w].reshape(2, 8)
    assert (slots[0, :2] == -1).all() and (slots[1, :5] == -1).all()
    for p in range(4, 10):
        assert slots[0, p - 2] == table[0, p // TPB] * TPB + p % TPB
    np.testing.assert_array_equal(batch.tables[w][0, :3], table[0, :3])
    assert batch.tables[w][0, 3] == 32 and (batch.tables[w][1, 1:] == 32).all()  # null slot padding


def test_decode_rows_use_the_decode_bucket(led):
    batch = build_batch(led, [Row("a", [10], 9), Row("b", [52], 2)], Buckets(min_batch=4, min_blocks=8), chunk_bucket=1)
    assert batch.shape == (4, 1, 8) and batch.num_rows == 2
    np.testing.assert_array_equal(batch.seq_lens, [10, 3, 0, 0])  # padding rows see no key
    (w,) = led.windows
    assert (batch.slots[w][2:] == -1).all() and (batch.tables[w][2:] == 32).all()


def test_rows_need_real_blocks(led):
    with pytest.raises(RuntimeError, match="no block for positions"):
        build_batch(led, [Row("b", [1], 5)], Buckets(), chunk_bucket=1)  # position 5: block 1 not allocated
    with pytest.raises(ValueError, match="shorter than the longest row"):
        build_batch(led, [Row("a", [1, 2], 8)], Buckets(), chunk_bucket=1)
    with pytest.raises(ValueError):
        Buckets(min_chunk=0)
