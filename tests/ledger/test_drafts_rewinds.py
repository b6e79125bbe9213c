"""Draft tokens, rewinds and pins.

* Sliding windows keep every block that a position the next forward still computes can see:
  up to `num_draft_tokens` unverified drafts plus the newest token (docs/semantics.md).
* A rewind never leaves a placeholder inside the next query's window: rewinds of at most
  `num_draft_tokens` tokens always succeed; a longer one that would need a released block
  raises `InvalidRequestError` and changes nothing.
* A rewind that would rewrite a pinned block copies it first (COPY in the transfer plan), so
  pinned KV stays identical until unpinned.

Every scenario runs a slot-content model (`SlotModel`) that replays each transfer plan and
writes each forward's KV, then reads every position each query's window covers.
"""
from __future__ import annotations

import random

import pytest
from ledger_helpers import SlotModel, make_config, tag

from kvjax import InvalidRequestError, KVCacheManager, OutOfBlocksError, Request
from kvjax.ledger import PLACEHOLDER_BLOCK_ID

R = range


class Engine:
    """A minimal engine over one manager: replays plans into a slot model, writes each forward's
    KV, and checks what every query of a forward reads (no placeholder in its window, every
    position it sees holds exactly this request's tokens)."""

    def __init__(self, **cfg):
        self.config = make_config(**cfg)
        self.m = KVCacheManager(self.config)
        self.model = SlotModel(self.config)
        self.tokens: dict = {}
        self.computed: dict = {}  # rid -> positions whose KV is written

    def _tables(self, rid):
        multi = len(self.config.windows) > 1
        return {w: self.m.block_ids(rid, w if multi else None)[0] for w in self.config.windows}

    def admit(self, rid, prompt, **kw):
        p = self.m.add_sequence(Request(rid, list(prompt), **kw))
        self.tokens[rid] = list(prompt)
        self.computed[rid] = p
        self.forward(rid)
        return p

    def add(self, rid, *tokens):
        for t in tokens:
            self.m.add_token(rid, t)
            self.tokens[rid].append(t)

    def forward(self, rid):
        """Compute KV for every position from the first uncomputed one to the newest."""
        self.model.apply(self.m.take_transfers())
        toks, tpb = self.tokens[rid], self.config.tokens_per_block
        lo, hi = self.computed[rid], len(toks)
        tables = self._tables(rid)
        for w, ids in tables.items():
            for q in range(lo, hi):
                for i in range(max(0, q - w + 1), q + 1):
                    bid = ids[i // tpb]
                    assert bid != PLACEHOLDER_BLOCK_ID, f"window {w}: query {q} sees a placeholder at position {i}"
                    blk = self.m.block(bid, w if len(tables) > 1 else None)
                    assert blk.level == 0
                    if i < lo:  # written by an earlier forward: must be this request's KV
                        got = self.model.read(w, 0, blk.slot)[i % tpb]
                        assert got == tag(None, None, toks, i), f"window {w}: query {q} reads {got} at {i}"
            for i in range(lo, hi):
                self.model.write(
                    w, self.m.block(ids[i // tpb], w if len(tables) > 1 else None).slot, i % tpb, tag(None, None, toks, i)
                )
        self.computed[rid] = hi

    def rewind(self, rid, n):
        """Rewind, replay the plan it made; returns that plan as readable tuples."""
        self.m.rewind(rid, n)
        plan = self.m.take_transfers()
        self.model.apply(plan)
        del self.tokens[rid][len(self.tokens[rid]) - n :]
        self.computed[rid] = min(self.computed[rid], len(self.tokens[rid]))
        return [(op.kind.name, op.pool, op.src, op.dst, op.num_tokens) for op in plan]

    def step(self, rid, token, drafts, accepted):
        """One speculative step: the newest token plus `drafts` draft tokens, one verify
        forward, then the rejected drafts rewound."""
        self.add(rid, token, *drafts)
        self.forward(rid)
        self.rewind(rid, len(drafts) - accepted)


# --------------------------------------------------------------------------- behaviour 1
def test_swa_keeps_the_blocks_the_earliest_draft_query_sees():
    e = Engine(attention_windows=(8,), primary_blocks=16)
    e.admit("a", R(12), max_new_tokens=20, num_draft_tokens=3)
    e.add("a", 100, 101, 102, 103)  # newest token (position 12) + three drafts
    # the verify forward's first query (position 12) sees positions 5..12: block 1 must be real
    assert e.m.block_ids("a")[0][:2] == [PLACEHOLDER_BLOCK_ID, 1]
    e.forward("a")
    e.m.verify_integrity()


@pytest.mark.parametrize("window,drafts", [(8, 3), (9, 4), (5, 2), (8, 7), (16, 1)])
def test_speculative_decoding_under_sliding_windows(window, drafts):
    """Random accept counts: every verify forward reads only real blocks holding this
    request's tokens, and rejecting drafts never fails."""
    rng = random.Random(window * 10 + drafts)
    e = Engine(num_layers=2, attention_windows=(64, window), primary_blocks=48, max_seq_len=64)
    e.admit("a", R(13), max_new_tokens=48, num_draft_tokens=drafts)
    while len(e.tokens["a"]) + drafts + 1 <= 60:
        e.step("a", rng.randrange(50), [rng.randrange(50) for _ in range(drafts)], rng.randint(0, drafts))
        e.m.verify_integrity()
    # the sliding window holds at most ceil((window + drafts) / tpb) + 1 blocks
    held = sum(1 for b in e.m.block_ids("a", window)[0] if b != PLACEHOLDER_BLOCK_ID)
    assert held <= -(-(window + drafts) // 4) + 1


def test_chunked_prefill_keeps_the_blocks_the_next_chunk_sees():
    e = Engine(attention_windows=(8,), primary_blocks=16)
    e.m.add_sequence(Request("a", list(R(20)), max_new_tokens=4))
    e.tokens["a"], e.computed["a"] = list(R(20)), 0
    e.m.set_context_position("a", 0)
    e.add("a", 7)  # a token added while the prompt is still being prefilled
    assert PLACEHOLDER_BLOCK_ID not in e.m.block_ids("a")[0]  # chunk 0 sees from position 0
    e.forward("a")


# --------------------------------------------------------------------------- behaviour 2
def test_rewind_into_a_released_window_block_raises_and_changes_nothing():
    e = Engine(attention_windows=(8,), primary_blocks=16)
    e.admit("a", R(12), max_new_tokens=20)  # no drafts: nothing kept for rewinds
    for t in R(100, 108):
        e.add("a", t)
        e.forward("a")
    assert e.m.block_ids("a")[0][:3] == [PLACEHOLDER_BLOCK_ID] * 3  # 20 tokens: 0..11 released
    before = e.m.snapshot()
    for n in (1, 4):  # the next query (position 18 or 15) would see position 11 or 8
        with pytest.raises(InvalidRequestError, match="released"):
            e.m.rewind("a", n)
        assert e.m.snapshot() == before
    e.m.verify_integrity()


def test_rewinds_within_the_draft_count_always_succeed():
    """Down to (longest length so far) - num_draft_tokens, a rewind never refuses (a verify
    step always ends longer than the previous one, so speculative decoding stays inside)."""
    rng = random.Random(7)
    for window in (5, 8, 9, 12):
        e = Engine(attention_windows=(window,), primary_blocks=24)
        e.admit("a", R(10), max_new_tokens=50, num_draft_tokens=3)
        longest = 10
        for _ in range(120):
            floor = max(10, longest - 3)
            if (rng.random() < 0.6 or len(e.tokens["a"]) == floor) and len(e.tokens["a"]) < 58:
                e.add("a", rng.randrange(50))
                e.forward("a")
                longest = max(longest, len(e.tokens["a"]))
            else:
                e.rewind("a", rng.randint(1, len(e.tokens["a"]) - floor))
                e.add("a", rng.randrange(50))  # the next step's token: its query reads the window
                e.forward("a")
        e.m.verify_integrity()


def test_deeper_rewinds_succeed_or_refuse_cleanly():
    rng = random.Random(3)
    refused = 0
    for window in (5, 8, 9):
        e = Engine(attention_windows=(window,), primary_blocks=24)
        e.admit("a", R(10), max_new_tokens=50, num_draft_tokens=rng.randint(0, 3))
        for _ in range(100):
            if rng.random() < 0.6 and len(e.tokens["a"]) < 58:
                e.add("a", rng.randrange(50))
                e.forward("a")
            elif len(e.tokens["a"]) > 10:
                before = e.m.snapshot()
                try:
                    e.rewind("a", rng.randint(1, len(e.tokens["a"]) - 10))
                except InvalidRequestError as err:
                    assert "released" in str(err) and e.m.snapshot() == before
                    refused += 1
                    continue
                e.add("a", rng.randrange(50))
                e.forward("a")  # whatever was kept, the next forward reads no placeholder
        e.m.verify_integrity()
    assert refused > 0


def test_set_context_position_into_released_blocks_raises():
    e = Engine(attention_windows=(8,), primary_blocks=16)
    e.admit("a", R(12), max_new_tokens=20)
    for t in R(100, 106):
        e.add("a", t)  # 18 tokens: blocks 0, 1 released
    before = e.m.snapshot()
    with pytest.raises(InvalidRequestError, match="released"):
        e.m.set_context_position("a", 4)  # a chunk starting at 4 would see positions 0..4
    assert e.m.snapshot() == before
    with pytest.raises(InvalidRequestError, match="released"):
        e.m.set_context_position("a", 11)  # would see 4..11: block 1 is released too
    assert e.m.snapshot() == before
    e.m.set_context_position("a", 12)  # the prompt is done: generation continues
    e.m.verify_integrity()


# --------------------------------------------------------------------------- behaviour 3
def _pinned_engine(store):
    e = Engine(primary_blocks=8)
    e.admit("a", R(6), max_new_tokens=10, num_draft_tokens=4)
    e.add("a", 6, 7, 8, 9)
    e.forward("a")  # 10 tokens: blocks 0, 1, 2 (2 holds positions 8, 9)
    if store:
        e.m.store_blocks_for_reuse("a", pin=True)
    else:
        e.m.pin_blocks("a")
    pinned = {b: list(e.model.read(64, 0, e.m.block(b).slot)) for b in (0, 1, 2)}
    return e, pinned


@pytest.mark.parametrize("store", [False, True])
def test_rewind_into_a_pinned_block_copies_it_first(store):
    e, pinned = _pinned_engine(store)
    ops = e.rewind("a", 3)  # 7 tokens: block 1 keeps 3 positions, position 7 will be rewritten
    ids = e.m.block_ids("a")[0]
    assert ids[0] == 0 and ids[1] not in pinned
    assert ops == [("COPY", 0, 1, ids[1], 3)]
    # the copy reads the pinned block's first three positions
    assert e.model.read(64, 0, e.m.block(ids[1]).slot) == pinned[1][:3] + [None]
    e.add("a", 50, 51)
    e.forward("a")
    for b, content in pinned.items():  # pinned KV is byte-identical until unpinned
        assert e.model.read(64, 0, e.m.block(b).slot) == content
        assert e.m.block(b).ref_count >= 1
    e.m.unpin_blocks([0, 1, 2])
    e.m.verify_integrity()


def test_rewind_to_a_pinned_block_boundary_needs_no_copy():
    e, pinned = _pinned_engine(store=False)
    assert e.rewind("a", 2) == []  # 8 tokens: block 2 released (still pinned), block 1 untouched
    assert e.m.block_ids("a") == [[0, 1]]
    assert e.m.block(2).ref_count == 1  # the pin alone
    e.m.unpin_blocks([0, 1, 2])
    e.m.verify_integrity()


def test_rewind_copy_of_a_pinned_block_without_a_free_block_raises():
    e = Engine(primary_blocks=3)
    e.admit("a", R(6), max_new_tokens=6, num_draft_tokens=3)
    e.add("a", 6, 7, 8)
    e.forward("a")  # 9 tokens: all three blocks in use
    e.m.pin_blocks("a")
    before = e.m.snapshot()
    with pytest.raises(OutOfBlocksError):
        e.m.rewind("a", 2)  # block 1 would be rewritten; block 2 stays pinned: nothing to copy into
    assert e.m.snapshot() == before


@pytest.mark.parametrize(
    ("window", "drafts", "prompt_len", "max_new"), [(8, 3, 10, 30), (9, 4, 5, 40), (5, 2, 12, 20), (16, 7, 6, 40)]
)
def test_remaining_blocks_cover_the_blocks_drafts_keep(window, drafts, prompt_len, max_new):
    """A pool of `remaining_blocks_to_completion` blocks serves a speculative request to the end
    (each step: newest token + all drafts, all rejected but one)."""
    probe = KVCacheManager(make_config(attention_windows=(window,), primary_blocks=64))
    req = Request("a", list(R(prompt_len)), max_new_tokens=max_new, num_draft_tokens=drafts)
    need = probe.remaining_blocks_to_completion(req)
    e = Engine(attention_windows=(window,), primary_blocks=need)
    e.admit("a", R(prompt_len), max_new_tokens=max_new, num_draft_tokens=drafts)
    while len(e.tokens["a"]) + drafts + 1 <= prompt_len + max_new:
        e.step("a", 1, [2] * drafts, 1)
    e.m.verify_integrity()
