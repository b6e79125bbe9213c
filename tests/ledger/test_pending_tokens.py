"""Pending tokens (`add_pending_tokens` / `set_pending_tokens`, kvjax/ledger/pending_tokens.py):
a reserved position then its id leaves the ledger exactly as `add_tokens` of that id would; bad
calls raise typed errors and change nothing; a pending id is never stored for reuse."""
from __future__ import annotations

import random

import numpy as np
import pytest
from ledger_helpers import make_manager

from kvjax import InvalidRequestError, OutOfBlocksError, Request
from kvjax.errors import DuplicateRequestError, IntegrityError, InvalidArgumentError, UnknownRequestError
from kvjax.ledger import PENDING_TOKEN, decode_batch


def _decoding(m, n, prompt_len=5, max_new=40):
    ids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        m.add_sequence(Request(rid, [1000 + i] + list(range(1, prompt_len)), max_new))
        m.set_context_position(rid, prompt_len)
    return ids


@pytest.mark.parametrize("n, small", [(3, True), (3, False), (70, True)])
def test_reserve_then_fill_equals_add_tokens(n, small):
    """Many steps of reserve + fill (stores in between) leave the same ledger as add_tokens of
    the same ids, batch by batch, through block boundaries, both add_tokens paths (row by row
    and batched), and the token store (70 rows)."""
    rng = random.Random(n)
    kw = dict(primary_blocks=n * 12 + 8, max_seq_len=64)
    a, b = make_manager(**kw), make_manager(**kw)
    ids = _decoding(a, n)
    _decoding(b, n)
    saved = decode_batch.SMALL_BATCH
    decode_batch.SMALL_BATCH = saved if small else 0
    try:
        for step in range(13):
            toks = [rng.randrange(50) for _ in ids]
            a.add_tokens(ids, toks)
            b.add_pending_tokens(ids)
            assert b.pending_tokens() == dict.fromkeys(ids, 5 + step)
            b.verify_integrity()
            b.store_new_blocks(ids)  # while pending: stores what is materialised, never the pending id
            b.set_pending_tokens(ids, np.array(toks, dtype=np.int64))
            a.store_new_blocks(ids)
            b.verify_integrity()
            assert a.snapshot() == b.snapshot()
    finally:
        decode_batch.SMALL_BATCH = saved


def test_pending_positions_and_marks():
    m = make_manager(primary_blocks=16)
    ids = _decoding(m, 2)
    m.add_pending_tokens(ids)
    assert m.pending_tokens() == {"r0": 5, "r1": 5}
    snap = m.snapshot()
    seqs = snap[2]
    assert all(s[1][-1] == PENDING_TOKEN and s[2] == 6 for s in seqs)
    m.set_pending_tokens(["r1"], [7])
    assert m.pending_tokens() == {"r0": 5}
    m.verify_integrity()


BAD_CALLS = [
    ("unknown id", lambda m: m.add_pending_tokens(["r0", "nope"]), UnknownRequestError),
    ("repeated id", lambda m: m.add_pending_tokens(["r0", "r0"]), DuplicateRequestError),
    ("already pending", lambda m: m.add_pending_tokens(["r1", "r2"]), InvalidRequestError),
    ("token after pending", lambda m: m.add_tokens(["r0", "r2"], [1, 2]), InvalidRequestError),
    ("add_token after pending", lambda m: m.add_token("r2", 1), InvalidRequestError),
    ("fill not pending", lambda m: m.set_pending_tokens(["r2", "r0"], [1, 2]), InvalidRequestError),
    ("fill negative", lambda m: m.set_pending_tokens(["r2"], [-1]), InvalidRequestError),
    ("fill too big", lambda m: m.set_pending_tokens(["r2"], [2**31]), InvalidRequestError),
    ("fill float", lambda m: m.set_pending_tokens(["r2"], [1.0]), InvalidRequestError),
    ("fill bool", lambda m: m.set_pending_tokens(["r2"], [True]), InvalidRequestError),
    ("fill float array", lambda m: m.set_pending_tokens(["r2"], np.array([1.0])), InvalidArgumentError),
    ("fill length", lambda m: m.set_pending_tokens(["r2", "r1"], [1]), InvalidArgumentError),
    ("fill unknown", lambda m: m.set_pending_tokens(["x"], [1]), UnknownRequestError),
    ("fill repeated", lambda m: m.set_pending_tokens(["r2", "r2"], [1, 1]), DuplicateRequestError),
    ("ids not a list", lambda m: m.add_pending_tokens("r0"), InvalidArgumentError),
]


@pytest.mark.parametrize("name, call, error", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_change_nothing(name, call, error):
    m = make_manager(primary_blocks=16)
    _decoding(m, 3)
    m.add_pending_tokens(["r2"])
    before = m.snapshot()
    with pytest.raises(error):
        call(m)
    assert m.snapshot() == before
    m.verify_integrity()


def test_out_of_blocks_changes_nothing():
    """Two requests each at a block boundary, one free block: refused atomically."""
    m = make_manager(primary_blocks=5, tokens_per_block=4)
    ids = _decoding(m, 2, prompt_len=8, max_new=4)  # 2 blocks each, 1 free
    before = m.snapshot()
    with pytest.raises(OutOfBlocksError):
        m.add_pending_tokens(ids)
    assert m.snapshot() == before and m.pending_tokens() == {}


def test_beams_refused():
    m = make_manager(primary_blocks=16, max_beam_width=2)
    m.add_sequence(Request("b", [1, 2, 3, 4, 5], 8, beam_width=2))
    m.set_context_position("b", 5)
    before = m.snapshot()
    with pytest.raises(InvalidRequestError, match="one beam"):
        m.add_pending_tokens(["b"])
    assert m.snapshot() == before


@pytest.mark.parametrize("fill", [False, True])
def test_removed_with_pending_never_stores_it(fill):
    """A request removed (stored for reuse) while its newest token is pending, or right after
    its id arrived, stores only what is materialised: a new request with the same tokens
    reuses everything before the pending position, never the position itself."""
    m = make_manager(primary_blocks=16, tokens_per_block=4)
    m.add_sequence(Request("a", [1, 2, 3, 4, 5, 6, 7], 8))
    m.set_context_position("a", 7)
    m.add_tokens(["a"], [8])  # positions 0..7: two full blocks, position 7's KV not yet written
    m.add_pending_tokens(["a"])  # position 8 opens block 2
    if fill:
        m.set_pending_tokens(["a"], [9])
    m.remove_sequence("a", store_for_reuse=True)
    m.verify_integrity()
    p = m.add_sequence(Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4))
    assert p == 8  # positions 0..7 (written by completed steps) only
    m.verify_integrity()


def test_rewind_drops_pending():
    m = make_manager(primary_blocks=16)
    _decoding(m, 1)
    m.add_pending_tokens(["r0"])
    m.rewind("r0", 1)
    assert m.pending_tokens() == {}
    m.add_tokens(["r0"], [3])
    m.verify_integrity()


def test_integrity_catches_a_lost_mark():
    """verify_integrity notices a pending position whose mark was overwritten (a corruption only
    a bug inside the ledger could make; written here through the token list)."""
    m = make_manager(primary_blocks=16)
    _decoding(m, 1)
    m.add_pending_tokens(["r0"])
    seq = m._seqs["r0"]  # a deliberate corruption
    assert seq.tokens is not None
    seq.tokens[-1] = 5
    with pytest.raises(IntegrityError, match="pending"):
        m.verify_integrity()


def test_a_pending_token_inside_a_store_prefix():
    """A sequence moved into the token store with its pending token inside the row's prefix
    (its tokens encoded whole) still gets the id written where the mark was."""
    m = make_manager(primary_blocks=16)
    _decoding(m, 1)
    m.add_pending_tokens(["r0"])
    seq = m._seqs["r0"]
    seq.prompt_path = None  # no reusable prompt encoding: the move encodes every token as the prefix
    with pytest.raises(InvalidRequestError):
        m.add_tokens(["r0"], [1])  # refused; the batched path moved the tokens into the store first
    assert seq.tokens is None and seq.store.base_of[seq.row] == 6
    m.verify_integrity()
    m.set_pending_tokens(["r0"], [42])
    assert seq.token_list()[-1] == 42
    m.verify_integrity()
