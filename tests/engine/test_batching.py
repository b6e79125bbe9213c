"""Forward batches: bucketed shapes, slot mappings that follow the ledger's block tables,
left-padded rows, padding rows that attend to nothing; a step's one forward (`build_step`) and
the shapes it can take (`forward_shapes`)."""
import numpy as np
import pytest

from kvjax import CacheConfig, KVCacheManager, Request
from kvjax.device.buckets import bucket
from kvjax.engine import (
    Buckets,
    EngineConfig,
    Row,
    SchedulerConfig,
    StepShape,
    build_batch,
    build_step,
    forward_shapes,
    padding_step,
)
from kvjax.engine.batching import ROW_SEQ_LEN, ROW_TABLES, TOK_ID, TOK_POSITION, TOK_SLOTS, prefill_fits, table_width

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


# ---------------------------------------------------------------------- one forward per step
def test_step_batch_packs_decode_then_prefill_rows(led):
    """Decode rows first (bucketed from min_batch), then the prefill rows, one flat token batch."""
    led.add_sequence(Request("c", list(range(20, 29)), max_new_tokens=4))  # 3 blocks
    decode = [Row("b", [52], 2)]  # b decodes its position 2
    prefill = [Row("a", list(range(5, 11)), 4), Row("c", [20, 21, 22], 0)]
    batch = build_step(led, decode, prefill, Buckets(min_batch=2, min_chunk=4, min_blocks=2, prefill_rows=2))
    assert batch.shape == StepShape(2, 2, 8, 16) and batch.shape.rows == 4 and batch.shape.tokens == 2 + 16  # 64 / 4
    assert (batch.num_decode, batch.num_prefill, batch.num_rows) == (1, 2, 3)
    np.testing.assert_array_equal(batch.real_rows, [0, 2, 3])
    (w,) = led.windows
    table = led.block_table(["b", "a", "c"], w)
    np.testing.assert_array_equal(batch.rows[:, ROW_SEQ_LEN], [3, 0, 10, 3])  # row 1: decode padding
    tables = batch.rows[:, ROW_TABLES:]
    assert tables.shape == (4, 16) and (tables[1] == 32).all()  # padding row: null slot
    assert (tables[0, 1:] == 32).all() and (tables[2, 3:] == 32).all()  # past a row's blocks: null slot
    np.testing.assert_array_equal(tables[0, :1], table[0, :1])
    np.testing.assert_array_equal(tables[2, :3], table[1, :3])
    tok = batch.tokens
    assert tok.shape == (18, 2 + 1)
    assert tok[0, TOK_ID] == 52 and tok[0, TOK_POSITION] == 2 and tok[0, TOK_SLOTS] == table[0, 0] * TPB + 2
    assert tok[1, TOK_POSITION] == -1 and tok[1, TOK_SLOTS] == -1  # the padding decode row writes nothing
    a = tok[2:10]  # prefill row "a": positions 2..9, the first two columns padding
    np.testing.assert_array_equal(a[:, TOK_ID], [0, 0, 5, 6, 7, 8, 9, 10])
    np.testing.assert_array_equal(a[:, TOK_POSITION], np.arange(2, 10))
    assert (a[:2, TOK_SLOTS] == -1).all()
    for p in range(4, 10):
        assert a[p - 2, TOK_SLOTS] == table[1, p // TPB] * TPB + p % TPB
    c = tok[10:18]
    np.testing.assert_array_equal(c[5:, TOK_ID], [20, 21, 22])
    np.testing.assert_array_equal(c[5:, TOK_SLOTS], table[2, 0] * TPB + np.arange(3))


def test_step_batch_rejects_what_one_forward_cannot_hold(led):
    b = Buckets(prefill_rows=1)
    with pytest.raises(ValueError, match="at least one row"):
        build_step(led, [], [], b)
    with pytest.raises(ValueError, match="one token each"):
        build_step(led, [Row("a", [9, 10], 8)], [], b)
    with pytest.raises(ValueError, match="exceed prefill_rows=1"):
        build_step(led, [], [Row("a", [1], 0), Row("b", [50], 0)], b)
    with pytest.raises(RuntimeError, match="no block"):
        build_step(led, [Row("b", [1], 5)], [], b)  # position 5: block 1 not allocated


def test_forward_shapes_are_exactly_the_reachable_ones():
    """Every shape build_step can produce for some content of a step the scheduler may build
    (brute force over the decode rows, prefill rows and longest chunk, the prefill group within
    `prefill_fits`), and no other; one table width."""
    cfg = EngineConfig(SchedulerConfig(max_batch_size=6, max_num_tokens=40),
                       Buckets(min_batch=2, min_chunk=8, min_blocks=2, prefill_rows=3))
    cc = CacheConfig(tokens_per_block=TPB, num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=62, primary_blocks=8)
    shapes = forward_shapes(cfg, cc)
    assert len(set(shapes)) == len(shapes) and shapes == sorted(shapes)
    assert {s.blocks for s in shapes} == {table_width(cc)} == {16}  # ceil(62 / 4), not a bucket
    reachable = set()
    for nd in range(7):
        for npf in range(4):
            for longest in range(1 if npf else 0, 41 if npf else 1):
                fits = npf == 0 or prefill_fits(npf, longest, cfg.buckets, 40)
                if 0 < nd + npf <= 6 and nd + longest + max(npf - 1, 0) <= 40 and fits:
                    reachable.add((bucket(nd, 2) if nd else 0, bucket(npf) if npf else 0,
                                   bucket(longest, 8) if npf else 0))
    assert {s[:3] for s in shapes} == reachable and len(shapes) == len(reachable)
    assert max(s.prefill_rows * s.chunk for s in shapes) == 64  # bucket(40): no [4, 32] or [2, 64] group


def test_prefill_fits_caps_the_padded_prefill_group():
    b = Buckets(min_chunk=16, prefill_rows=4)
    assert prefill_fits(1, 256, b, 256) and prefill_fits(1, 200, b, 200)  # a lone chunk always fits
    assert prefill_fits(2, 128, b, 256) and not prefill_fits(2, 129, b, 256)  # [2, 256] pads past 256
    assert prefill_fits(4, 64, b, 256) and prefill_fits(3, 64, b, 256) and not prefill_fits(3, 65, b, 256)
    assert not prefill_fits(5, 16, b, 256)  # prefill_rows
    assert prefill_fits(1, 8, b, 8) and not prefill_fits(2, 3, b, 8)  # cap bucket(8, min_chunk) = 16 < [2, 16]
    with pytest.raises(ValueError):
        prefill_fits(0, 5, b, 256)


def test_padding_step_has_the_shape_and_writes_nothing():
    cc = CacheConfig(tokens_per_block=TPB, num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=64, primary_blocks=8)
    batch = padding_step(StepShape(2, 1, 8, 4), cc)
    assert batch.shape == (2, 1, 8, 4) and batch.num_rows == 0 and batch.windows == (64,)
    assert batch.rows.shape == (3, 4 + 4) and batch.tokens.shape == (10, 3)
    assert (batch.rows[:, ROW_SEQ_LEN] == 0).all() and (batch.rows[:, ROW_TABLES:] == 8).all()
    assert (batch.tokens[:, TOK_SLOTS] == -1).all()
    for bad in ((0, 0, 0, 4), (1, 1, 0, 4), (1, 0, 8, 4), (1, 0, 0, 0)):
        with pytest.raises(ValueError, match="not a step shape"):
            padding_step(StepShape(*bad), cc)
