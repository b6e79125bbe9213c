"""The slot table behind `block_table` / `block_offsets`, and the batched `add_tokens`.

A seeded random driver admits, grows (one token at a time and in batches), rewinds, removes
(rows are recycled) and checks, after every operation, every live request's table row against
a model built from the public block ids and each block's slot: padding and placeholders are
the null slot and no row ever shows a slot the request does not hold. A twin ledger takes the
same operations with `add_token` one by one: `add_tokens` must leave the same ledger, and a
failing batch must raise what the first failing `add_token` raises while changing nothing.
"""
from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from ledger_helpers import make_config

from kvjax import DuplicateRequestError, InvalidArgumentError, KVCacheError, KVCacheManager, Request, UnknownRequestError
from kvjax.errors import OutOfBlocksError
from kvjax.ledger import decode_batch
from kvjax.ledger.decode_batch import int_array
from kvjax.ledger.validation import max_table_width

CONFIGS = {
    "one_window": dict(tokens_per_block=4, max_seq_len=48, primary_blocks=24, secondary_blocks=4, event_buffer_max_size=4096),
    "beams": dict(tokens_per_block=2, max_seq_len=24, primary_blocks=20, max_beam_width=2, event_buffer_max_size=4096),
    "swa": dict(
        tokens_per_block=2, max_seq_len=32, primary_blocks=18, secondary_blocks=2, num_layers=2, attention_windows=(32, 5),
        max_beam_width=2,
    ),
}


def model_table(m: KVCacheManager, ids, window, max_blocks=None) -> np.ndarray:
    """The table as it must be: each beam's block ids mapped to their slots (placeholders and
    padding: the null slot), built from public reads only."""
    null = m.config.primary_blocks_for(window)
    rows = []
    for rid in ids:
        for beam in m.block_ids(rid, window):
            rows.append([null if b < 0 else m.block(b, window).slot for b in beam])
    width = max((len(r) for r in rows), default=0) if max_blocks is None else max_blocks
    out = np.full((len(rows), width), null, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def check_tables(m: KVCacheManager, rng: random.Random) -> None:
    ids = m.request_ids
    rng.shuffle(ids)
    ids = ids[: rng.randrange(len(ids) + 1)]
    for w in m.windows:
        want = model_table(m, ids, w)
        got = m.block_table(ids, w)
        assert got.dtype == np.int32 and np.array_equal(got, want), (w, ids)
        wide = min(want.shape[1] + rng.randrange(1, 6), max_table_width(m.config))
        assert np.array_equal(m.block_table(ids, w, max_blocks=wide), model_table(m, ids, w, wide))
        if want.shape[1]:
            with pytest.raises(InvalidArgumentError):
                m.block_table(ids, w, max_blocks=want.shape[1] - 1)
    width = min(max((model_table(m, ids, w).shape[1] for w in m.windows), default=0) + 2, max_table_width(m.config))
    from kvjax.offsets import kvcache_index_offsets

    want_offsets = kvcache_index_offsets(m.config, {w: model_table(m, ids, w, width) for w in m.windows})
    assert np.array_equal(m.block_offsets(ids, max_blocks=width), want_offsets)


def replay(config, history) -> KVCacheManager:
    m = KVCacheManager(config)
    for op in history:
        op(m)
    return m


def sequential(ids, tokens):
    def run(m: KVCacheManager) -> None:
        for rid, t in zip(ids, tokens, strict=True):
            m.add_token(rid, t)

    return run


def batched(ids, tokens):
    return lambda m: m.add_tokens(ids, tokens)


def outcome(op, m: KVCacheManager):
    try:
        op(m)
    except KVCacheError as e:
        return type(e)
    return None


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("small_batch", ["row by row", "numpy"])
def test_random_driver_tables_and_batched_growth(name, seed, small_batch, monkeypatch):
    """`small_batch`: steps of at most `SMALL_BATCH` rows that only append take the row-by-row
    path (the default for this driver's batches), or none does (the cached batch's numpy path)."""
    if small_batch == "numpy":
        monkeypatch.setattr(decode_batch, "SMALL_BATCH", 0)
    rng = random.Random(f"{name}-{seed}")
    config = make_config(**CONFIGS[name])
    a, b = KVCacheManager(config), KVCacheManager(config)  # a: add_tokens, b: add_token one by one
    history: list = []
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    next_id = 0
    batches = failures = 0

    def both(op):
        ra, rb = outcome(op, a), outcome(op, b)
        assert ra == rb
        if ra is None:
            history.append(op)

    for step in range(160):
        live = a.request_ids
        r = rng.random()
        if r < 0.2 or not live:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 12)] + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
            beam = rng.choice([1, 2]) if config.max_beam_width > 1 else 1
            req = Request(next_id, prompt, max_new_tokens=8, beam_width=beam, num_draft_tokens=rng.choice([0, 0, 2]))
            next_id += 1
            both(lambda m, req=req: m.add_sequence(req))
        elif r < 0.3:
            rid = rng.choice(live)
            store = rng.random() < 0.7
            both(lambda m, rid=rid, store=store: m.remove_sequence(rid, store_for_reuse=store))
        elif r < 0.38:
            rid = rng.choice(live)
            n = rng.randrange(3)
            both(lambda m, rid=rid, n=n: m.rewind(rid, n))
        elif r < 0.45:
            rid = rng.choice(live)
            tok = rng.randrange(50)
            both(lambda m, rid=rid, tok=tok: m.add_token(rid, tok))
        else:  # a decode step: add_tokens on a, add_token row by row on b
            ids = rng.sample(live, rng.randrange(1, len(live) + 1))
            tokens: list = [rng.randrange(50) for _ in ids]
            spoil = rng.random()
            if spoil < 0.05:
                ids.insert(rng.randrange(len(ids) + 1), "nobody")
                tokens.insert(len(tokens), 1)
            elif spoil < 0.1:
                tokens[rng.randrange(len(tokens))] = rng.choice([-1, 2**31, True, 1.5])
            elif spoil < 0.15:
                tokens[rng.randrange(len(tokens))] = [rng.randrange(50), rng.randrange(50)]  # per beam
            as_array = rng.random() < 0.5 and all(type(t) is int and 0 <= t < 2**31 for t in tokens)
            arg = np.array(tokens, dtype=rng.choice([np.int32, np.int64])) if as_array else tokens
            before = a.snapshot()
            got = outcome(batched(ids, arg), a)
            if got is None:
                want = outcome(sequential(ids, tokens), b)
                assert want is None, f"add_token raised {want} where add_tokens succeeded"
                history.append(sequential(ids, tokens))
                batches += 1
            else:
                failures += 1
                assert a.snapshot() == before, "a failing add_tokens changed the ledger"
                assert outcome(sequential(ids, tokens), b) is got
                b = replay(config, history)  # b went part way: rebuild it
        if a.request_ids:
            check_tables(a, rng)
        if step % 8 == 0:
            a.verify_integrity()
            assert a.snapshot() == b.snapshot()
    a.verify_integrity()
    assert a.snapshot() == b.snapshot()
    assert batches > 10


def test_a_recycled_row_shows_nothing_of_its_last_owner():
    m = KVCacheManager(make_config(primary_blocks=16))
    m.add_sequence(Request("long", list(range(30))))  # 8 blocks
    wide = m.block_table(["long"], max_blocks=10)
    assert (wide[0, :8] != 16).all()
    m.remove_sequence("long")
    m.add_sequence(Request("short", [1, 2, 3]))  # takes the row "long" gave back
    row = m.block_table(["short"], max_blocks=10)[0]
    assert row[0] == m.block(m.block_ids("short")[0][0]).slot and (row[1:] == 16).all()
    m.verify_integrity()


def test_tables_wider_than_the_slot_matrix_are_padded_with_the_null_slot():
    """`max_blocks` beyond the slot matrix's width (16 columns until a row needs more): the
    gather pads past the matrix; every entry past a row's blocks is the null slot, and the
    table is the caller's copy."""
    m = KVCacheManager(make_config(tokens_per_block=2, max_seq_len=256, primary_blocks=64))
    m.add_sequence(Request("short", [1, 2, 3, 4, 5]))  # 3 blocks
    widest = max_table_width(m.config)
    assert widest == 128
    for ids, want_width in ((["short"], 16), (["short", "long"], 32)):
        if want_width == 32:
            m.add_sequence(Request("long", list(range(100, 140))))  # 20 blocks: the matrix doubles to 32
        for max_blocks in (want_width, want_width + 1, widest):
            got = m.block_table(ids, max_blocks=max_blocks)
            assert got.shape == (len(ids), max_blocks) and got.dtype == np.int32
            assert np.array_equal(got, model_table(m, ids, None, max_blocks)), (ids, max_blocks)
    got[:] = 0  # the caller's copy: writing it changes nothing in the ledger
    assert np.array_equal(m.block_table(["short", "long"], max_blocks=widest), model_table(m, ["short", "long"], None, widest))
    m.verify_integrity()


@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize("windows", [(400,), (400, 9)])
def test_long_admitted_rows_hold_the_matched_then_the_fresh_blocks(beams, windows):
    """A long prompt's row (many matched blocks, a partial match, fresh ones, and with a
    sliding window leading placeholders) is written in one call, in bulk past a few entries:
    each beam's ids are the cached prefix's blocks then its own, its table row their slots."""
    m = KVCacheManager(make_config(
        tokens_per_block=4, max_seq_len=400, primary_blocks=300, num_layers=len(windows), attention_windows=windows,
        max_beam_width=2,
    ))  # fmt: skip
    first = list(range(1000, 1130))  # 32 full blocks and 2 tokens
    m.add_sequence(Request("first", first))
    m.store_context_blocks("first")
    for n_match, tail in ((120, [7] * 37), (126, [8] * 5), (8, [9] * 90)):  # whole blocks; a partial one; few
        rid = ("next", n_match)
        prompt = first[:n_match] + tail
        assert m.add_sequence(Request(rid, prompt, beam_width=beams)) == n_match
        k = n_match // 4
        for w in m.windows:
            cached = m.block_ids("first", w)[0]
            rows = m.block_ids(rid, w)
            for row in rows:
                assert len(row) == -(-len(prompt) // 4)
                # a sliding window leaves the matched blocks its first query cannot see as placeholders
                gaps = 0 if w == 400 else sum((d + 1) * 4 <= n_match - w + 1 for d in range(k))
                assert all(b < 0 for b in row[:gaps]) and all(b >= 0 for b in row[gaps:])
                assert row[gaps:k] == cached[gaps:k]
                assert not set(row[k:]) & set(cached)  # the rest is the request's own
            assert rows[0][: len(rows[0]) - 1] == rows[-1][: len(rows[0]) - 1]  # beams share all but the last
            assert np.array_equal(m.block_table([rid, "first"], w), model_table(m, [rid, "first"], w))
        m.verify_integrity()


def test_a_reused_request_id_shows_its_new_rows_in_a_changing_batch():
    """Block tables of an id list never seen before come from the table's row directory (one
    lookup per id): a request id removed and admitted again must show the new request's
    slots, never the old one's, and ids the directory does not hold (unknown) still raise."""
    m = KVCacheManager(make_config(primary_blocks=16))
    m.add_sequence(Request("a", [1, 2, 3, 4, 5, 6]))
    m.add_sequence(Request("b", [7, 8, 9]))
    m.add_sequence(Request("c", [10, 11, 12, 13, 14]))
    assert np.array_equal(m.block_table(["a", "b", "c"]), model_table(m, ["a", "b", "c"], None))
    m.remove_sequence("a", store_for_reuse=False)
    m.add_sequence(Request("d", [20, 21, 22, 23, 24, 25, 26, 27, 28]))  # may take a's row back
    m.add_sequence(Request("a", [30]))  # the same id, another request
    for ids in (["c", "a", "b", "d"], ["a", "d"], ["b", "c", "a"]):
        assert np.array_equal(m.block_table(ids), model_table(m, ids, None)), ids
    with pytest.raises(UnknownRequestError):
        m.block_table(["c", "gone"])
    m.verify_integrity()


def test_add_tokens_errors_change_nothing():
    m = KVCacheManager(make_config(primary_blocks=6))
    m.add_sequence(Request("a", [1, 2, 3, 4]))
    m.add_sequence(Request("b", [11, 12, 13, 14, 15, 16, 17, 18]))
    m.add_sequence(Request("c", [9, 9, 9, 9]))
    before = m.snapshot()
    for ids, tokens, error in [
        (["a", "a"], [1, 2], DuplicateRequestError),
        (["a", "zz"], [1, 2], UnknownRequestError),
        (["a"], [1, 2], InvalidArgumentError),
        (["a", "b", "c"], np.array([[1, 2, 3]]), InvalidArgumentError),
        (["a", "b", "c"], [1, 2, 3], OutOfBlocksError),  # the third request finds no block left
    ]:
        with pytest.raises(error):
            m.add_tokens(ids, tokens)
        assert m.snapshot() == before
    m.add_tokens(["a", "b"], np.array([5, 6]))  # both start a block: the last two free ones
    assert m.num_free_blocks() == 0 and len(m.block_ids("a")[0]) == 2 and len(m.block_ids("b")[0]) == 3
    m.verify_integrity()


def test_a_sliding_window_detach_frees_the_block_a_later_row_takes():
    """Capacity is counted row by row as add_token would: a block released by one row's
    sliding-window detach is there for a later row to take, not for an earlier one."""
    cfg = make_config(tokens_per_block=2, max_seq_len=32, primary_blocks=6, attention_windows=(3,))
    for order, error in ((["a", "b"], None), (["b", "a"], OutOfBlocksError)):
        m = KVCacheManager(cfg)
        m.add_sequence(Request("a", [1, 2, 3, 4, 5]))  # 3 blocks; its next token slides block 0 out
        m.add_sequence(Request("b", [11, 12, 13, 14, 15, 16]))  # 3 blocks; its next token needs a 4th
        assert m.num_free_blocks() == 0
        before = m.snapshot()
        if error is None:
            m.add_tokens(order, [7, 17])
            assert m.block_ids("a")[0][0] < 0 and len(m.block_ids("b")[0]) == 4
            check_tables(m, random.Random(0))
            m.verify_integrity()
        else:
            with pytest.raises(error):
                m.add_tokens(order, [17, 7])
            assert m.snapshot() == before


@pytest.mark.parametrize("dtype", [np.int64, np.intp, np.int32])
def test_int_array_equals_numpy_and_refuses_what_does_not_fit(dtype):
    vals = [0, 1, -5, 2**31 - 1, -(2**31)]
    got = int_array(vals, dtype)
    assert got.dtype == np.dtype(dtype) and got.flags.writeable
    np.testing.assert_array_equal(got, np.array(vals, dtype=dtype))
    assert int_array(iter(vals), dtype).tolist() == vals  # any iterable
    assert int_array([], dtype).shape == (0,)
    with pytest.raises(struct.error):  # never wrapped into range
        int_array([np.iinfo(dtype).max + 1], dtype)
