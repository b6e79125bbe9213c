"""The token store (`kvjax.ledger.token_store`) and the two homes of a sequence's tokens.

A seeded driver of `TokenStore` against a list per row (prefixes, pages across their
boundaries, batched appends, truncations, rows and pages handed back and out again, the page
matrix growing); and drivers of the manager that mix single `add_token` calls with batched
`add_tokens` steps (which move a sequence's tokens into the store, and back), rewinds, stores,
removals and admissions, checking every sequence's tokens against a model and the whole ledger
against a twin driven by single calls only.
"""
from __future__ import annotations

import random
import struct

import numpy as np
import pytest
from ledger_helpers import make_config

from kvjax import KVCacheManager, Request
from kvjax.errors import DuplicateRequestError, OutOfBlocksError, UnknownRequestError
from kvjax.ledger.decode_batch import SMALL_BATCH
from kvjax.ledger.token_store import PAGE, TokenStore


def _encode(tokens: list[int]) -> bytes:
    return struct.pack(f"{len(tokens)}i", *tokens)


@pytest.mark.parametrize("seed", range(6))
def test_the_store_holds_what_a_list_would(seed):
    rng = random.Random(seed)
    store = TokenStore(rows=2, pages=1)  # both grow many times
    model: dict[int, tuple[int, list[int]]] = {}  # request id -> (row, tokens)
    next_id = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.2 or not model:
            n = rng.choice([0, 1, rng.randrange(2, 3 * PAGE)])
            toks = [rng.randrange(2**31) for _ in range(n)]
            model[next_id] = (store.admit(next_id, _encode(toks), n + rng.randrange(0, 2 * PAGE)), toks)
            next_id += 1
        elif op < 0.3:
            rid = rng.choice(list(model))
            store.release(rid, model.pop(rid)[0])
        elif op < 0.45:  # one row
            rid = rng.choice(list(model))
            r, toks = model[rid]
            extra = [rng.randrange(2**31) for _ in range(rng.choice([1, rng.randrange(1, PAGE + 5)]))]
            if len(extra) == 1:
                store.append(r, extra[0])
            else:
                store.extend(r, extra)
            toks += extra
        elif op < 0.85:  # a batched step over a random subset, across page boundaries
            ids = rng.sample(list(model), rng.randrange(1, len(model) + 1))
            rows = np.array([model[i][0] for i in ids], dtype=np.intp)
            vals = np.array([rng.randrange(2**31) for _ in ids], dtype=np.int32)
            store.append_rows(rows, store.count[rows], vals)
            for i, v in zip(ids, vals.tolist(), strict=True):
                model[i][1].append(v)
        else:
            rid = rng.choice(list(model))
            r, toks = model[rid]
            n = rng.randrange(len(toks) + 1)
            store.truncate(r, n)
            del toks[n:]
        for r, toks in model.values():
            assert store.count[r] == len(toks)
            a = rng.randrange(len(toks) + 1)
            b = rng.randrange(a, len(toks) + 1)
            assert store.tokens(r, a, b) == toks[a:b]
            assert store.units(r, a, b) == _encode(toks[a:b])
        store.verify({rid: r for rid, (r, _) in model.items()})
    for r, toks in model.values():
        assert store.tokens(r, 0, len(toks)) == toks
    # memory follows the live tokens: pages in use are what the rows' tokens past their prefixes need
    in_use = store.next_page - len(store.free_pages)
    assert in_use == sum(-(-(len(t) - int(store.base[r])) // PAGE) for r, t in model.values())


def test_a_sequence_moves_into_the_store_at_its_first_batched_step_and_back_at_a_single_token():
    m = KVCacheManager(make_config(primary_blocks=200, max_seq_len=64))
    ids = list(range(SMALL_BATCH + 1))
    m.add_sequences([Request(i, [1, 2, 3, 4, 5, 6], max_new_tokens=20) for i in ids])
    assert all(m._seqs[i].tokens is not None for i in ids) and not m._live.new_in_store
    m.add_tokens(ids, [7] * len(ids))
    assert all(m._seqs[i].tokens is None for i in ids) and not m._listed and m._live.new_in_store
    m.add_sequence(Request("new", [1, 2, 3], max_new_tokens=4))  # straight into the store
    assert m._seqs["new"].tokens is None
    m.add_token(0, 8)  # a single token: back to a list; later admissions keep lists again
    assert m._seqs[0].tokens == [1, 2, 3, 4, 5, 6, 7, 8] and m._listed.keys() == {0} and not m._live.new_in_store
    m.add_sequence(Request("after", [1, 2, 3], max_new_tokens=4))
    assert m._seqs["after"].tokens == [1, 2, 3]
    for i in ids[1:]:
        assert m._seqs[i].token_list() == [1, 2, 3, 4, 5, 6, 7]
    m.verify_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_mixed_single_and_batched_steps_keep_every_token(seed):
    """Batched steps (above and below the row-by-row threshold), single tokens, rewinds,
    stores, removals and admissions, on a ledger and a twin that sees single calls only."""
    rng = random.Random(seed)
    cfg = make_config(tokens_per_block=4, primary_blocks=4000, max_seq_len=400)
    led, twin = KVCacheManager(cfg), KVCacheManager(cfg)
    model: dict[int, list[int]] = {}
    prompt_len: dict[int, int] = {}
    next_id = 0

    def admit(k: int) -> None:
        nonlocal next_id
        for _ in range(k):
            prompt = [rng.randrange(30) for _ in range(rng.randrange(1, 40))]  # shared prefixes get reused
            for m in (led, twin):
                m.add_sequence(Request(next_id, prompt, max_new_tokens=300))
            model[next_id] = list(prompt)
            prompt_len[next_id] = len(prompt)
            next_id += 1

    admit(SMALL_BATCH + 10)
    for step in range(70):
        ids = [i for i in model if len(model[i]) < 390]
        rng.shuffle(ids)
        op = rng.random()
        if op < 0.45:  # a batched step of most rows (the engine's decode step)
            ids = ids[: max(SMALL_BATCH + 1, len(ids) - rng.randrange(5))]
        elif op < 0.6:  # a small batched step
            ids = ids[: rng.randrange(1, SMALL_BATCH)]
        else:
            ids = ids[: rng.randrange(1, 12)]  # single tokens
        toks = [rng.randrange(30) for _ in ids]
        if op < 0.6:
            led.add_tokens(ids, np.array(toks, dtype=np.int32) if rng.random() < 0.5 else toks)
        else:
            for i, t in zip(ids, toks, strict=True):
                led.add_token(i, t)
        for i, t in zip(ids, toks, strict=True):
            twin.add_token(i, t)
            model[i].append(t)
        if rng.random() < 0.3:  # rejected drafts
            i = rng.choice(list(model))
            n = rng.randrange(0, len(model[i]) - prompt_len[i] + 1)
            for m in (led, twin):
                m.rewind(i, n)
            del model[i][len(model[i]) - n :]
        led.store_new_blocks(list(model))
        for i in model:
            twin.store_new_block(i)
        if rng.random() < 0.25:
            for i in rng.sample(list(model), 3):
                for m in (led, twin):
                    m.remove_sequence(i)
                del model[i]
            admit(rng.randrange(1, 5))
        for i, toks in model.items():
            assert led._seqs[i].token_list() == toks and led._seqs[i].num_tokens == len(toks)
        assert led.snapshot() == twin.snapshot(), step
        led.verify_integrity()
    twin.verify_integrity()
    assert led._tok.row_of_id and any(s.tokens is None for s in led._seqs.values())  # both homes were used


@pytest.mark.parametrize("many", [False, True])
def test_a_failing_batched_step_moves_no_tokens_and_fails_as_the_first_failing_row(many):
    """An unknown id after a request that needs a block none is free for: `add_tokens` raises
    what `add_token` of the first row would (`OutOfBlocksError`), whichever home the request's
    tokens have, and moves no tokens into the store. With `many` rows it takes the batched
    path (past the row-by-row threshold)."""
    fillers = [f"f{i}" for i in range(SMALL_BATCH + 5)] if many else []
    m = KVCacheManager(make_config(tokens_per_block=4, primary_blocks=len(fillers) + 4, max_seq_len=64))
    m.add_sequence(Request("a", [1, 2, 3, 4], max_new_tokens=8))  # its next token starts a block
    m.add_sequence(Request("b", list(range(10, 21)), max_new_tokens=8))  # takes the last free blocks, room for 1 more token
    m.add_sequences([Request(f, [5, 6], max_new_tokens=1) for f in fillers])
    assert m.num_free_blocks() == 0
    m._tok.limit[-1] = 10**6  # a free row's column entry must never be read for a listed request
    before = m.snapshot()
    with pytest.raises(OutOfBlocksError):
        m.add_tokens(["a", *fillers, "ghost"], [5] * (len(fillers) + 2))
    with pytest.raises(UnknownRequestError):
        m.add_tokens(["b", *fillers, "ghost"], [5] * (len(fillers) + 2))
    with pytest.raises(DuplicateRequestError):
        m.add_tokens(["b", *fillers, "b"], [5] * (len(fillers) + 2))
    assert m.snapshot() == before and m._listed.keys() == {"a", "b", *fillers} and not m._live.new_in_store
    m._tok.limit[-1] = 0
    m.verify_integrity()
