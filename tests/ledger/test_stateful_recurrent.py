"""The ledger with a recurrent-state window (a hybrid model's cache) under random operation
sequences: a hypothesis stateful machine and a seeded slice of benchmarks/hybrid_longrun.py,
both checking the slot-content model of that driver (every step reads its own state and never
writes a snapshot, a pinned or another request's block; cached snapshots hold what their tree
path spells; placeholders show the null slot; events mirror the tree; `verify_integrity()`).
Then regression tests of the ledger bugs the driver found."""
from __future__ import annotations

import pathlib
import random
import sys

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import hybrid_longrun as H  # noqa: E402

from kvjax import InvalidRequestError, Request  # noqa: E402

R = H.R


class HybridLedgerMachine(RuleBasedStateMachine):
    @initialize(
        tpb=st.sampled_from([4, 2, 1]),
        interval=st.sampled_from([1, 2, 3]),
        secondary=st.booleans(),
        reuse=st.sampled_from([True, True, False]),
        rec=st.integers(6, 12),
        attn=st.integers(14, 26),
    )
    def init(self, tpb, interval, secondary, reuse, rec, attn):
        self.d = H.HybridDriver(H.hybrid_config(tpb, interval, secondary, reuse, (rec, attn)))

    @rule(r=st.randoms(use_true_random=False))
    def admit(self, r):
        (self.d.admit if len(self.d.live) < 6 else self.d.remove)(r)

    @rule(r=st.randoms(use_true_random=False))
    def prefill_chunk(self, r):
        self.d.prefill_chunk(r)

    @rule(r=st.randoms(use_true_random=False))
    def decode(self, r):
        self.d.decode(r)

    @rule(r=st.randoms(use_true_random=False))
    def rewind(self, r):
        self.d.rewind(r)

    @rule(r=st.randoms(use_true_random=False))
    def store(self, r):
        self.d.store(r)

    @rule(r=st.randoms(use_true_random=False))
    def remove(self, r):
        self.d.remove(r)

    @rule(r=st.randoms(use_true_random=False))
    def unpin(self, r):
        self.d.unpin(r)

    @rule(r=st.randoms(use_true_random=False))
    def bad_call(self, r):
        self.d.bad_call(r)

    @invariant()
    def everything_holds(self):
        if hasattr(self, "d"):
            self.d.check_all()


TestHybridLedger = HybridLedgerMachine.TestCase
TestHybridLedger.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)


def test_hybrid_long_run_slice_has_no_violations():
    violations, stats, examples = H.run(1500, seed=2, episode_ops=500)
    assert dict(violations) == {}, examples
    for what in ("admissions with reuse", "drafts rejected", "recurrent offload", "recurrent onboard", "pins",
                 "abandoned steps", "rewinds", "bad calls"):
        assert stats[what] > 0, (what, stats)


def test_the_driver_catches_a_step_that_writes_a_snapshot():
    """The model is not vacuous: a step handed a cached snapshot's slot to write is caught."""
    d = H.HybridDriver(H.hybrid_config(4, 1, False, True, (12, 24)))
    rng = random.Random(0)
    while not any(i.prompt_len >= 8 for i in d.live.values()):
        d.admit(rng)
    info = next(i for i in d.live.values() if i.prompt_len >= 8)
    while not info.prefilled:
        d.prefill_chunk(rng)
    d.m.store_context_blocks(info.rid)
    snaps = d.m.inspector.cached_block_ids(R)
    assert snaps
    real = d.m.begin_recurrent_step

    def bad(ids, ends=None):
        s = real(ids, ends)
        s.write_slots[0] = d.m.block(min(snaps), R).slot
        return s

    d.m.begin_recurrent_step = bad
    with pytest.raises(H.Violation, match="step writes slot"):
        d.forward([info.rid])


# --------------------------------------------------------------------------- regressions
def hybrid(reuse: bool):
    return H.HybridDriver(H.hybrid_config(4, 2, False, reuse, (10, 24))).m


def run_prompt(m, rid, n):
    m.add_sequence(Request(rid, list(range(n)), max_new_tokens=20))
    m.set_context_position(rid, 0)
    while m.recurrent_state_position(rid) < n:
        end = m.recurrent_next_chunk_end(rid)
        m.begin_recurrent_step([rid])
        m.set_context_position(rid, end)
        if end == n:
            break
    m.add_token(rid, 1)


def test_pinning_a_live_request_leaves_its_write_block_unpinned():
    """Found by the driver: pins took the off-chain write block too, so the next step wrote a
    pinned block (and `verify_integrity` failed)."""
    m = hybrid(True)
    run_prompt(m, "a", 7)
    m.begin_recurrent_step(["a"])
    m.add_token("a", 2)
    ids = m.store_blocks_for_reuse("a", pin=True)
    step = m.begin_recurrent_step(["a"])
    pinned_slots = {m.block(b, R).slot for b in ids[R]}
    assert int(step.write_slots[0]) not in pinned_slots
    m.verify_integrity()


def test_reuse_off_a_pinned_state_is_not_updated_in_place():
    """Found by the driver: with reuse off a step updated the pinned live state in place."""
    m = hybrid(False)
    run_prompt(m, "a", 6)
    s = m.begin_recurrent_step(["a"])
    assert s.read_slots[0] == s.write_slots[0]  # in place
    m.add_token("a", 2)
    ids = m.store_blocks_for_reuse("a", pin=True)
    free = m.num_free_blocks(R)
    assert m.needed_blocks_one_step("a", window=R) == 1
    s = m.begin_recurrent_step(["a"])
    pinned = {m.block(b, R).slot for b in ids[R]}
    assert int(s.read_slots[0]) in pinned and int(s.write_slots[0]) not in pinned
    assert m.num_free_blocks(R) == free - 1
    m.verify_integrity()
    m.add_token("a", 3)
    s = m.begin_recurrent_step(["a"])  # the fresh block is the live state now: in place again
    assert s.read_slots[0] == s.write_slots[0] and int(s.read_slots[0]) not in pinned
    m.unpin_blocks(ids)
    m.verify_integrity()


def test_reuse_off_a_rewind_cannot_undo_a_done_in_place_step():
    """Found by the driver: with reuse off, a rewind to exactly a done step's end made it not
    done again, though its state had already overwritten the one it read."""
    m = hybrid(False)
    run_prompt(m, "a", 6)
    m.begin_recurrent_step(["a"])  # [6, 7)
    m.add_token("a", 2)  # done
    m.add_token("a", 3)
    before = m.snapshot()
    with pytest.raises(InvalidRequestError):
        m.rewind("a", 2)  # to 7 tokens: the step over [6, 7) would no longer be done
    assert m.snapshot() == before
