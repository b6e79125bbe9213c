"""The decode step's store paths against the general ones, on twin ledgers driven by the same
seeded engine-like run (shared prefixes, so some stores find their key cached already;
speculative tokens and rewinds; pins; requests that finish, storing or not; evictions in a
small pool) and compared op by op:

- a decode block stored by `RadixTree.extend_leaf` (the shortcut that skips the tree walk)
  against the full walk (`RadixTree.insert`), the shortcut switched off in the twin;
- `store_new_blocks(ids)` against one `store_new_block` call per id."""
from __future__ import annotations

import random

import pytest
from ledger_helpers import make_config

from kvjax import CacheConfig, KVCacheManager, Request
from kvjax.errors import InvalidArgumentError, KVCacheError, UnknownRequestError
from kvjax.ledger import decode_batch, radix_tree
from kvjax.ledger.radix_tree import RadixTree
from kvjax.request import RetentionConfig, TokenRangeRetention

TPB = 4


def _config(windows: tuple[int, ...] | None, events: bool = True) -> CacheConfig:
    return CacheConfig(
        tokens_per_block=TPB, num_layers=1 if windows is None else len(windows), num_kv_heads=1, head_dim=8,
        max_seq_len=96, primary_blocks=48, event_buffer_max_size=100_000 if events else 0, attention_windows=windows,
    )  # fmt: skip


class _Spy:
    """Counts what `extend_leaf` answered (and answers False when `off`: the full walk)."""

    def __init__(self, off: bool) -> None:
        self.off = off
        self.taken = self.refused = 0

    def install(self, tree: RadixTree, monkeypatch_obj) -> None:
        real = tree.extend_leaf

        def extend_leaf(*args):
            if self.off:
                return False
            ok = real(*args)
            self.taken += ok
            self.refused += not ok
            return ok

        monkeypatch_obj.setattr(tree, "extend_leaf", extend_leaf)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("windows", [None, (96, 12)])
@pytest.mark.parametrize("run_limit", [6, radix_tree.RUN_LIMIT])
def test_extend_leaf_leaves_the_ledger_as_the_walk_does(seed, windows, run_limit, monkeypatch):
    """(`run_limit`: how long a leaf run may grow in place; 6 makes runs fill up, so the
    shortcut must refuse a full one as `insert` starts a new node there.)"""
    monkeypatch.setattr(radix_tree, "RUN_LIMIT", run_limit)
    rng = random.Random(seed)
    fast, walk = KVCacheManager(_config(windows)), KVCacheManager(_config(windows))
    spy = _Spy(off=False)
    spy.install(fast._bm.tree, monkeypatch)
    _Spy(off=True).install(walk._bm.tree, monkeypatch)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice((3, 8, 13)))] for _ in range(3)]
    retention = RetentionConfig([TokenRangeRetention(0, 8, 70)], decode_priority=30)
    live: dict[int, int] = {}  # request id -> draft tokens it may rewind
    next_id = 0

    def both(op: str, *args, **kwargs) -> None:
        """The same call on both ledgers: the same answer (or refusal) and the same state."""
        results = []
        for m in (fast, walk):
            try:
                results.append(("ok", getattr(m, op)(*args, **kwargs)))
            except KVCacheError as e:  # out of blocks, a rewind too deep: refused alike
                results.append((type(e).__name__, str(e)))
        assert results[0] == results[1], (op, args)
        assert fast.snapshot() == walk.snapshot(), (op, args)

    for step in range(400):
        r = rng.random()
        if (r < 0.12 or not live) and len(live) < 6:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            drafts = rng.choice((0, 0, 2))
            ret = retention if rng.random() < 0.3 else None
            req = [Request(next_id, prompt, max_new_tokens=40, num_draft_tokens=drafts, retention=ret) for _ in range(2)]
            results = []
            for m, q in zip((fast, walk), req, strict=True):
                try:
                    results.append(m.add_sequence(q))
                    m.store_context_blocks(next_id)
                except KVCacheError:  # out of blocks: refused alike
                    results.append(None)
            assert results[0] == results[1]
            assert fast.snapshot() == walk.snapshot()
            if results[0] is not None:
                live[next_id] = drafts
            next_id += 1
        elif r < 0.2:
            rid = rng.choice(list(live))
            both("remove_sequence", rid, store_for_reuse=rng.random() < 0.8)
            del live[rid]
        elif r < 0.25:
            rid = rng.choice(list(live))
            if live[rid]:  # rejected draft tokens
                both("rewind", rid, rng.randrange(1, live[rid] + 1))
        elif r < 0.28:
            both("store_blocks_for_reuse", rng.choice(list(live)), pin=rng.random() < 0.3)
        else:
            for rid in list(live):
                # a repeated token run makes later requests' decode blocks match earlier ones
                tok = rng.randrange(4) if rng.random() < 0.5 else rng.randrange(50)
                both("add_token", rid, tok)
                both("store_new_block", rid)
        if step % 50 == 0:
            fast.verify_integrity()
            walk.verify_integrity()
    for m in (fast, walk):
        m.flush_iteration_events()
        m.verify_integrity()
    assert fast.get_latest_events() == walk.get_latest_events()
    assert spy.taken > 20 and spy.refused > 0  # both of the shortcut's answers were exercised


# ---------------------------------------------------------------------------- store_new_blocks
class _CandidateSpy:
    """Counts `store_new_blocks` calls that took the store-hint pre-check, and the rows it let
    through against the rows asked."""

    def __init__(self, monkeypatch_obj) -> None:
        self.calls = self.rows = self.kept = 0
        real = decode_batch.store_candidates

        def store_candidates(bm, live, ids):
            out = real(bm, live, ids)
            if out is not None:
                self.calls += 1
                self.rows += len(ids)
                self.kept += len(out)
            return out

        monkeypatch_obj.setattr(decode_batch, "store_candidates", store_candidates)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("windows", "events"), [(None, False), (None, True), ((96, 12), False)])
@pytest.mark.parametrize("append", ["add_token", "add_tokens"])
def test_store_new_blocks_is_store_new_block_of_each(seed, windows, events, append, monkeypatch):
    """The batched call against one call per id, on twin ledgers driven like an engine's steps
    (chunked prefills part-way through, drafts and rewinds, retention wishes, pins, finished
    requests, an id repeated in the list), compared after every step. With `add_tokens`, the
    step's id list usually stays the same from step to step, as a decode batch's does, so the
    batched store takes its store-hint pre-check whenever the ledger keeps that batch (one
    full-attention window): requests that stored nothing new are then skipped unread."""
    spy = _CandidateSpy(monkeypatch)
    rng = random.Random(seed)
    order: list[int] = []
    batched, looped = KVCacheManager(_config(windows, events)), KVCacheManager(_config(windows, events))
    retention = RetentionConfig([TokenRangeRetention(0, 8, 70)], decode_priority=30)
    live: dict[int, int] = {}  # request id -> draft tokens it may rewind
    for step in range(300):
        r = rng.random()
        if (r < 0.12 or not live) and len(live) < 6:
            rid = step
            prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]  # few ids: prefixes repeat
            drafts = rng.choice((0, 2))
            chunk = rng.randrange(len(prompt) + 1) if rng.random() < 0.3 else None
            ret = retention if rng.random() < 0.25 else None
            answers = []
            for m in (batched, looped):
                try:
                    req = Request(rid, prompt, max_new_tokens=40, num_draft_tokens=drafts, retention=ret)
                    answers.append(m.add_sequence(req))
                    if chunk is not None:  # a chunked prefill part-way through: its KV ends there
                        m.set_context_position(rid, chunk)
                except KVCacheError as e:
                    answers.append(type(e).__name__)
            assert answers[0] == answers[1]
            if type(answers[0]) is int:
                live[rid] = drafts
        elif r < 0.18:
            rid, store = rng.choice(list(live)), rng.random() < 0.8
            for m in (batched, looped):
                m.remove_sequence(rid, store_for_reuse=store)
            del live[rid]
        elif r < 0.22:
            rid = rng.choice(list(live))
            if live[rid]:
                n = rng.randrange(1, live[rid] + 1)
                answers = []
                for m in (batched, looped):
                    try:
                        m.rewind(rid, n)
                        answers.append("ok")
                    except KVCacheError as e:
                        answers.append(type(e).__name__)
                assert answers[0] == answers[1]
        elif r < 0.25:
            pin = rng.random() < 0.5
            rid = rng.choice(list(live))
            assert batched.store_blocks_for_reuse(rid, pin=pin) == looped.store_blocks_for_reuse(rid, pin=pin)
        else:
            if set(order) != set(live) or rng.random() < 0.2:  # the batch changed, or is reordered
                order = list(live)
                rng.shuffle(order)
            ids = list(order)
            toks = [rng.randrange(6) for _ in ids]
            together = append == "add_tokens"
            if together:
                answers = []
                for m in (batched, looped):
                    try:
                        m.add_tokens(ids, toks)  # atomic: a refusal changes nothing
                        answers.append("ok")
                    except KVCacheError as e:
                        answers.append(type(e).__name__)
                assert answers[0] == answers[1]
                together = answers[0] == "ok"
            if not together:
                for rid, tok in zip(ids, toks, strict=True):
                    for m in (batched, looped):
                        try:
                            m.add_token(rid, tok)
                        except KVCacheError:
                            pass
            if ids and rng.random() < 0.2:
                ids.append(ids[0])  # a repeated id stores nothing more
            batched.store_new_blocks(ids)
            for rid in ids:
                looped.store_new_block(rid)
        assert batched.snapshot() == looped.snapshot(), step
        batched.verify_integrity()  # store hints included
    looped.verify_integrity()
    if append == "add_tokens" and windows is None:
        assert spy.calls > 10 and spy.kept < spy.rows  # the pre-check ran, and skipped rows
    else:
        assert spy.calls == 0  # per-token calls keep no batch; two windows never take it
    if events:
        for m in (batched, looped):
            m.flush_iteration_events()
        assert batched.get_latest_events() == looped.get_latest_events()


def test_store_new_blocks_checks_every_id_first():
    m = KVCacheManager(_config(None))
    for rid in ("a", "b"):
        m.add_sequence(Request(rid, list(range(10)), max_new_tokens=8))
        for t in range(7):
            m.add_token(rid, t)
    before = m.snapshot()
    with pytest.raises(UnknownRequestError):
        m.store_new_blocks(["a", "ghost", "b"])  # "a" has blocks to store: none is
    with pytest.raises(InvalidArgumentError):
        m.store_new_blocks("ab")
    assert m.snapshot() == before
    m.store_new_blocks(("a", "b"))
    assert m.snapshot() != before
    m.verify_integrity()


def test_store_new_blocks_stops_at_what_a_failed_transfer_left_valid():
    """After a failed partial copy the request's KV is valid only up to the cut: the batched
    call stores no more than one call per id does."""
    ledgers = []
    for _ in range(2):
        m = KVCacheManager(_config(None))
        a = list(range(12))
        m.add_sequence(Request("a", a, max_new_tokens=8))
        m.store_context_blocks("a")
        m.add_sequence(Request("b", list(range(6)) + [77, 78, 79], max_new_tokens=8))  # block [4, 8) of "a" copied
        plan = m.take_transfers()
        m.transfers_failed(plan.seq)  # the copy did not arrive: "b" is valid up to token 4
        for t in (5, 6, 7, 8):
            m.add_token("b", t)
        ledgers.append(m)
    batched, looped = ledgers
    assert batched.snapshot() == looped.snapshot()
    batched.store_new_blocks(["b", "a"])
    looped.store_new_block("b")
    looped.store_new_block("a")
    assert batched.snapshot() == looped.snapshot()
    batched.verify_integrity()


@pytest.mark.parametrize("events", [False, True])
def test_a_reused_partial_block_stored_by_a_decode_step_takes_the_requests_retention(events):
    """A block reused in place from a partial match keeps the cached block's priority until
    the request stores it; completed by decode tokens and stored by `store_new_blocks`, it
    must take the request's retention exactly as `store_new_block` gives it. (Its old run
    cannot grow in place, so this is the batched call's `store` path.)"""
    ledgers = []
    for _ in range(2):
        m = KVCacheManager(_config(None, events))
        keep = RetentionConfig([TokenRangeRetention(0, 8, 70)])
        m.add_sequence(Request("a", [1, 2, 3, 4, 5, 6], max_new_tokens=4, retention=keep))
        m.remove_sequence("a")  # stores [1, 2, 3, 4] and the partial [5] (6 has no KV) at priority 70
        assert m.add_sequence(Request("b", [1, 2, 3, 4, 5, 6, 9], max_new_tokens=8)) == 5
        m.store_context_blocks("b")
        for t in (10, 11):
            m.add_token("b", t)  # [5, 6, 9, 10] is full and its KV written
        ledgers.append(m)
    batched, looped = ledgers
    reused = batched.block_ids("b")[0][1]
    assert batched.block(reused).priority == 70  # kept from the cached block until stored
    batched.store_new_blocks(["b"])
    looped.store_new_block("b")
    assert batched.snapshot() == looped.snapshot()
    assert batched.block(reused).priority == looped.block(reused).priority
    batched.verify_integrity()


def test_a_run_that_lost_its_tail_does_not_grow_back_in_place():
    """A leaf run whose last position was evicted must not take a new position in place: that
    position would get the evicted one's position id, and a storing cursor still naming the
    evicted position (a request whose own block for that key stayed private, because another
    request's block held the key) would take it for its own. Here request b's next stored
    block then hung under request c's prefix, and a request with c's prefix reused it: 12
    tokens of KV computed after another prompt. A new node (fresh ids) makes b's store walk
    again, which stores b's block under b's own prefix."""
    m = KVCacheManager(make_config(tokens_per_block=4, primary_blocks=8, max_seq_len=32))
    k0, k1, y = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    # admitted together, so neither reuses the other: b's blocks stay private when a's are stored
    m.add_sequences([Request("a", k0 + k1 + [0], max_new_tokens=8), Request("b", k0 + k1 + [0], max_new_tokens=8)])
    m.store_context_blocks("a")
    m.store_context_blocks("b")  # b's cursor: the position holding a's block for k1
    a0 = m.block_ids("a")[0][0]  # a's k0 block: the one left cached below
    m.remove_sequence("a")
    m.add_sequence(Request("d", list(range(20, 29)), max_new_tokens=0))  # the never-used blocks and a's third
    m.add_sequence(Request("e", [40, 41], max_new_tokens=0))  # the next victim: a's k1 block, the run's tail
    assert m.inspector.cached_block_ids() == {a0}
    m.remove_sequence("d", store_for_reuse=False)
    m.remove_sequence("e", store_for_reuse=False)
    m.add_sequence(Request("c", k0 + y + [0], max_new_tokens=4))
    m.store_context_blocks("c")  # y after k0: where k1 was
    for t in (31, 32, 33, 34):
        m.add_token("b", t)
    m.store_new_block("b")
    b2 = m.block_ids("b")[0][2]
    assert [k.tokens for k in m.inspector.cached_path(b2)] == [tuple(k0), tuple(k1), (0, 31, 32, 33)]
    m.remove_sequence("c")
    assert m.add_sequence(Request("f", k0 + y + [0, 31, 32, 33, 7], max_new_tokens=0)) == 8  # k0 and y only
    m.verify_integrity()


def test_a_cursor_on_another_requests_block_is_checked_every_step():
    """The store hint skips a row only while its cursor sits on the request's own block (which
    no eviction can take). Request b's cursor sits on request a's block for the same key (b's
    own stayed private: they were admitted together). Once a's block is evicted, b must store
    its own block there in the very next `store_new_blocks`, even in a step where b completed
    no block and the call takes the pre-check (the cached `add_tokens` batch: c starts a block)."""
    k0, k1 = [1, 2, 3, 4], [5, 6, 7, 8]
    ledgers = []
    for batched in (True, False):
        m = KVCacheManager(make_config(tokens_per_block=4, primary_blocks=11, max_seq_len=32))
        m.add_sequences([Request("a", k0 + k1 + [0], max_new_tokens=8), Request("b", k0 + k1 + [0], max_new_tokens=8)])
        m.add_sequence(Request("c", list(range(50, 58)), max_new_tokens=8))
        for rid in ("a", "b", "c"):
            m.store_context_blocks(rid)  # b's cursor: the position of a's block for k1
        a0 = m.block_ids("a")[0][0]
        m.remove_sequence("a")
        m.add_sequence(Request("d", list(range(20, 36)), max_new_tokens=0))  # never-used blocks and a's third
        m.add_sequence(Request("e", [40, 41], max_new_tokens=0))  # the next victim: a's k1 block
        assert m.inspector.cached_block_ids() & {a0, *m.block_ids("b")[0]} == {a0}
        m.remove_sequence("d", store_for_reuse=False)
        m.remove_sequence("e", store_for_reuse=False)
        m.add_tokens(["b", "c"], [31, 60])  # b appends inside its last block; c starts one
        if batched:
            m.store_new_blocks(["b", "c"])
        else:
            m.store_new_block("b")
            m.store_new_block("c")
        b1 = m.block_ids("b")[0][1]
        assert b1 in m.inspector.cached_block_ids()  # b's own k1 block, under a's k0
        m.verify_integrity()
        ledgers.append(m)
    assert ledgers[0].snapshot() == ledgers[1].snapshot()


def test_an_engine_step_with_admissions_keeps_the_store_pre_check(monkeypatch):
    """An engine's step: `add_tokens` of the decode batch, admissions, the forward, then
    `store_new_blocks` of the same ids. Admitting new requests in between keeps the cached
    batch (they are in no batch), so the store still skips the rows with nothing new, and ends
    where one `store_new_block` per id does."""
    spy = _CandidateSpy(monkeypatch)
    rng = random.Random(3)
    ledgers = [KVCacheManager(make_config(tokens_per_block=4, primary_blocks=1200, max_seq_len=64)) for _ in range(2)]
    ids = list(range(80))  # above `SMALL_BATCH`: every step keeps its batch
    prompts = {i: [rng.randrange(50) for _ in range(5 + i % 7)] for i in range(100)}
    for m in ledgers:
        m.add_sequences([Request(i, prompts[i], max_new_tokens=20) for i in ids])
    for step in range(12):
        toks = [rng.randrange(50) for _ in ids]
        joining = [Request(100 + 10 * step + j, prompts[rng.randrange(100)], max_new_tokens=4) for j in range(2)]
        for k, m in enumerate(ledgers):
            m.add_tokens(ids, toks)
            m.add_sequences(joining)
            if k == 0:
                m.store_new_blocks(list(ids))
            else:
                for i in ids:
                    m.store_new_block(i)
            for r in joining:
                m.remove_sequence(r.request_id)
        assert ledgers[0].snapshot() == ledgers[1].snapshot(), step
    ledgers[0].verify_integrity()
    assert spy.calls == 12 and spy.kept < spy.rows // 2


def test_a_run_keeps_its_longer_last_block_when_its_holder_offers_fewer_tokens():
    """The same along a run: a's blocks [5, 6] and [100, 1] were stored as one run, then a's
    rejected drafts leave it with three materialised tokens. Leaving, it offers [5, 6] and the
    partial [100]: the run is not split, and [100, 1] is still reused in full."""
    m = KVCacheManager(make_config(tokens_per_block=2, primary_blocks=16, max_seq_len=16))
    m.add_sequence(Request("a", [5, 6, 100, 1], max_new_tokens=6, num_draft_tokens=2))
    for t in (0, 2):  # drafts: the verify forward writes [100, 1] and [0]
        m.add_token("a", t)
    m.store_new_block("a")
    m.rewind("a", 2)  # rejected: a is [5, 6, 100, 1] again
    second = m.block_ids("a")[0][1]
    before = m.inspector.tree_size()
    m.remove_sequence("a")
    assert [k.tokens for k in m.inspector.cached_path(second)] == [(5, 6), (100, 1)]
    assert m.inspector.tree_size() == before  # no split, no new position
    assert m.add_sequence(Request("b", [5, 6, 100, 1, 9], max_new_tokens=1)) == 4
    m.verify_integrity()


def test_a_shared_block_keeps_its_longer_key_when_a_holder_offers_fewer_tokens():
    """Request a's speculative tokens were stored, then rewound: a holds its first block, full
    and cached, but has materialised only one of its tokens. Request b matched that block in
    full. When a leaves it offers the block as the partial [100]: the block stays under
    [100, 1] (its KV never changed, so the longer key is true), b's cursor and store hint stay
    valid, and a later request still reuses the whole block. Before, the block moved under the
    shorter key and the tree forgot token 1 until b stored it again (a Removed and a Stored
    event each way)."""
    ledgers = []
    for batched in (True, False):
        m = KVCacheManager(make_config(tokens_per_block=2, primary_blocks=16, max_seq_len=16, event_buffer_max_size=64))
        m.add_sequence(Request("a", [100, 1], max_new_tokens=6, num_draft_tokens=3))
        for t in (0, 2, 3):  # drafts: their forward writes [100, 1] and [0, 2]
            m.add_token("a", t)
        m.store_new_block("a")
        m.rewind("a", 3)  # all rejected: a is [100, 1] again, its first block still cached in full
        m.add_sequence(Request("b", [100, 1, 0], max_new_tokens=4))  # matches [100, 1]
        m.add_sequence(Request("c", [50, 51, 52, 53], max_new_tokens=4))
        b0 = m.block_ids("b")[0][0]
        m.flush_iteration_events()
        m.get_latest_events()
        m.remove_sequence("a")  # offers its block as the partial [100] (token 1 has no KV for a)
        assert [k.tokens for k in m.inspector.cached_path(b0)] == [(100, 1)]
        m.flush_iteration_events()
        assert [e for e in m.get_latest_events() if e.data.__class__.__name__ != "UpdatedData"] == []
        m.verify_integrity()
        m.add_tokens(["b", "c"], [7, 54])  # b appends in its block; c starts one
        if batched:
            m.store_new_blocks(["b", "c"])
        else:
            m.store_new_block("b")
            m.store_new_block("c")
        assert [k.tokens for k in m.inspector.cached_path(b0)] == [(100, 1)]
        assert m.add_sequence(Request("d", [100, 1, 5], max_new_tokens=1)) == 2  # the whole block
        assert m.block_ids("d")[0][0] == b0
        m.verify_integrity()
        ledgers.append(m)
    assert ledgers[0].snapshot() == ledgers[1].snapshot()


@pytest.mark.parametrize("windows", [(3,), (64, 3)])
@pytest.mark.parametrize("store", ["batched", "one", "removal"])
@pytest.mark.parametrize("every", [1, 3])
def test_a_window_narrower_than_a_block_stores_past_its_released_blocks(windows, store, every):
    """A sliding window narrower than a block releases a sequence's newest full block before
    that block is stored (3 tokens of window, 4 per block: once 3 more tokens follow a block,
    nothing can see it). Storing then walks a run that ends in placeholders, which the tree
    prunes; the store used to index the pruned position for the sequence's cursor and raise
    `IndexError` (storing every third step). Every prompt length and decode length here, storing
    every step or every third one, stores without an error and leaves a consistent ledger."""
    cases = 0
    for prompt_len in range(1, 14):
        for steps in range(8):
            m = KVCacheManager(make_config(attention_windows=windows, num_layers=len(windows), primary_blocks=8))
            m.add_sequence(Request("a", list(range(100, 100 + prompt_len))))
            m.store_new_blocks(["a"])
            for t in range(steps):
                m.add_token("a", t)
                if t % every == every - 1:  # a store every step, or every other one
                    if store == "batched":
                        m.store_new_blocks(["a"])
                    elif store == "one":
                        m.store_new_block("a")
                m.verify_integrity()
            m.remove_sequence("a", store_for_reuse=True)
            m.verify_integrity()
            cases += 1
    assert cases == 13 * 8
