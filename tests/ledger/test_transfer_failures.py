"""Failed transfers lose nothing and serve nothing stale.

Plans are numbered; the newest plan can be reported once, applied or failed (wholly or by op).
A failure drops the blocks whose content did not arrive from the tree and cuts back every live
request that relied on them; replaying the plan minus its failed ops on a slot-content model
and recomputing from the cut-back length must leave every request reading its own tokens.
"""
from __future__ import annotations

import pytest
from ledger_helpers import SlotModel, make_config, plan_ops, tag

from kvjax import InvalidArgumentError, KVCacheManager, Request, TransferKind
from kvjax.errors import TransferSequenceError
from kvjax.ledger import PLACEHOLDER_BLOCK_ID

LOST = ("lost",)  # what a failed op leaves in its destination


def replay(model: SlotModel, plan, failed=()) -> None:
    """Apply `plan` to the slot model; failed ops leave garbage in their destination."""
    for i, op in enumerate(plan):
        if i in failed:
            model.lose(op.kind, op.pool, op.dst, op.num_tokens, LOST[0])
        else:
            model.apply_op(*op)


def write(m: KVCacheManager, model: SlotModel, rid, tokens, positions) -> None:
    w = m.windows[0]
    row = m.block_table([rid])[0]
    for i in positions:
        model.write(w, int(row[i // model.tpb]), i % model.tpb, tag(None, None, tokens, i))


def check_reads_own_tokens(m: KVCacheManager, model: SlotModel, rid, tokens, upto) -> None:
    w = m.windows[0]
    ids = m.block_ids(rid)[0]
    for i in range(upto):
        if ids[i // model.tpb] == PLACEHOLDER_BLOCK_ID:
            continue
        blk = m.block(ids[i // model.tpb])
        got = model.read(w, blk.level, blk.slot)[i % model.tpb]
        assert got == tag(None, None, tokens, i), f"{rid} position {i}: {got}"


def offloaded_chain(tokens, **cfg):
    """A ledger whose cache holds `tokens` (stored, then offloaded to secondary memory)."""
    m = KVCacheManager(make_config(**cfg))
    model = SlotModel(m.config)
    m.add_sequence(Request("seed", tokens))
    replay(model, m.take_transfers())
    write(m, model, "seed", tokens, range(len(tokens)))
    m.remove_sequence("seed")
    filler = list(range(1000, 1000 + 4 * m.num_free_blocks()))
    m.add_sequence(Request("filler", filler))  # evicts the chain: offloaded
    replay(model, m.take_transfers())
    write(m, model, "filler", filler, range(len(filler)))
    m.remove_sequence("filler", store_for_reuse=False)
    assert m.stats().offloaded_blocks >= len(tokens) // 4
    return m, model


# --------------------------------------------------------------------------- protocol
def test_plans_are_numbered_and_reported_once():
    m = KVCacheManager(make_config())
    p1, p2 = m.take_transfers(), m.take_transfers()
    assert (p1.seq, p2.seq) == (1, 2)
    before = m.snapshot()
    for bad in (p1, 1, 0, 3):  # acknowledged by the next take, never issued
        with pytest.raises(TransferSequenceError):
            m.transfers_failed(bad)
        with pytest.raises(TransferSequenceError):
            m.transfers_applied(bad)
    assert m.snapshot() == before
    m.transfers_applied(p2)
    with pytest.raises(TransferSequenceError, match="already reported applied"):
        m.transfers_applied(p2)  # a plan applied twice
    with pytest.raises(TransferSequenceError):
        m.transfers_failed(p2)
    assert m.take_transfers().seq == 3


def test_failure_reported_twice_or_after_the_next_plan():
    m, _ = offloaded_chain(list(range(9)), secondary_blocks=4)
    m.add_sequence(Request("a", list(range(9))))
    plan = m.take_transfers()
    assert len(plan)
    m.transfers_failed(plan, [0])
    before = m.snapshot()
    with pytest.raises(TransferSequenceError, match="already reported failed"):
        m.transfers_failed(plan, [1])
    with pytest.raises(TransferSequenceError):
        m.transfers_applied(plan)
    assert m.snapshot() == before
    m.take_transfers()
    with pytest.raises(TransferSequenceError, match="acknowledged"):
        m.transfers_failed(plan)


def test_require_transfer_acks_catches_a_skipped_plan():
    m = KVCacheManager(make_config(primary_blocks=4, secondary_blocks=4), require_transfer_acks=True)
    m.take_transfers()  # empty plans need no report
    m.take_transfers()
    m.add_sequence(Request("s", list(range(9))))
    m.remove_sequence("s")
    m.add_sequence(Request("t", list(range(100, 113))))  # offloads
    plan = m.take_transfers()
    assert len(plan)
    before = m.snapshot()
    with pytest.raises(TransferSequenceError, match="neither reported"):
        m.take_transfers()
    assert m.snapshot() == before
    m.transfers_applied(plan)
    assert m.take_transfers().seq == plan.seq + 1


def test_bad_op_indices():
    m, _ = offloaded_chain(list(range(9)), secondary_blocks=4)
    m.add_sequence(Request("a", list(range(9))))
    plan = m.take_transfers()
    before = m.snapshot()
    for bad in ([len(plan)], [-1], [0, 0], [], [0.0], "0", 0):
        with pytest.raises(InvalidArgumentError):
            m.transfers_failed(plan, bad)
    assert m.snapshot() == before


# --------------------------------------------------------------------------- what a failure does
def test_failed_onboard_cuts_back_and_leaves_the_tree():
    tokens = list(range(13))
    m, model = offloaded_chain(tokens, secondary_blocks=4)
    p = m.add_sequence(Request("a", tokens))
    assert p == 12
    plan = m.take_transfers()
    kinds = [TransferKind(int(k)) for k in plan.kind]
    assert kinds.count(TransferKind.ONBOARD) == 3
    first = kinds.index(TransferKind.ONBOARD)
    onboarded = [m.block_ids("a")[0][i] for i in range(3)]
    failed = {first + 1}  # the second block's onboard fails
    replay(model, plan, failed)
    out = m.transfers_failed(plan, sorted(failed))
    assert out.recompute_from == {"a": 4} and not out.readmit and out.dropped_blocks == 1
    assert m.request_stats("a").prepopulated_tokens == 4
    assert not m.block(onboarded[1]).is_cached and m.block(onboarded[0]).is_cached
    m.verify_integrity()
    write(m, model, "a", tokens, range(4, 13))  # the engine recomputes from 4...
    check_reads_own_tokens(m, model, "a", tokens, 13)
    m.store_context_blocks("a")  # (before the engine reports progress, nothing new is stored)
    # nothing stale is ever matched: a twin reuses block 0 only
    assert m.add_sequence(Request("twin", tokens)) == 4
    m.remove_sequence("twin", store_for_reuse=False)
    m.set_context_position("a", 13)  # ...and reports it like a prefill chunk
    m.store_context_blocks("a")
    assert m.add_sequence(Request("twin2", tokens)) == 12
    replay(model, m.take_transfers())
    check_reads_own_tokens(m, model, "twin2", tokens, 12)


def test_failed_partial_copy_cuts_back_to_the_block_start():
    m = KVCacheManager(make_config())
    model = SlotModel(m.config)
    a = list(range(12))
    m.add_sequence(Request("a", a))
    write(m, model, "a", a, range(12))
    m.store_context_blocks("a")
    b = list(range(6)) + [77, 78, 79]
    assert m.add_sequence(Request("b", b)) == 6  # block [4, 8) of "a" partially copied
    plan = m.take_transfers()
    assert [op[0] for op in plan_ops_of(plan)] == ["COPY"]
    replay(model, plan, {0})
    out = m.transfers_failed(plan.seq)
    assert out.recompute_from == {"b": 4} and out.dropped_blocks == 0
    write(m, model, "b", b, range(4, 9))
    check_reads_own_tokens(m, model, "b", b, 9)
    check_reads_own_tokens(m, model, "a", a, 12)
    m.verify_integrity()


def test_failed_offload_is_never_matched():
    tokens = list(range(9))
    m = KVCacheManager(make_config(primary_blocks=4, secondary_blocks=4))
    m.add_sequence(Request("s", tokens))
    m.remove_sequence("s")
    m.add_sequence(Request("t", list(range(100, 113))))  # evicts: the chain is offloaded
    plan = m.take_transfers()
    offloads = [i for i, op in enumerate(plan) if TransferKind(op.kind) is TransferKind.OFFLOAD]
    assert offloads
    out = m.transfers_failed(plan)
    assert out.recompute_from == {} and out.dropped_blocks == len(offloads)
    m.verify_integrity()
    m.remove_sequence("t", store_for_reuse=False)
    assert m.add_sequence(Request("again", tokens)) == 0  # the lost copies are gone
    assert m.stats().onboarded_blocks == 0


def test_failure_propagates_through_later_ops_and_later_admissions():
    """An offload fails; before it is reported, a second admission onboards from the lost
    secondary slot (an op not yet taken) and a third request matches the block in full."""
    tokens = list(range(9))
    m = KVCacheManager(make_config(primary_blocks=4, secondary_blocks=4))
    model = SlotModel(m.config)
    m.add_sequence(Request("s", tokens))
    write(m, model, "s", tokens, range(9))
    m.remove_sequence("s")
    t = list(range(100, 113))
    m.add_sequence(Request("t", t))  # offloads the chain
    plan = m.take_transfers()
    replay(model, plan, set(range(len(plan))))  # every op of it failed
    write(m, model, "t", t, range(13))
    m.remove_sequence("t", store_for_reuse=False)
    assert m.add_sequence(Request("u", tokens)) == 8  # onboards the (lost) chain: pending ops
    assert m.add_sequence(Request("v", tokens)) == 8  # full match of the onboarded blocks
    out = m.transfers_failed(plan)
    assert out.recompute_from == {"u": 0, "v": 0}
    replay(model, m.take_transfers())
    for rid in ("u", "v"):  # both recompute into the blocks they share (same tokens, same KV)
        write(m, model, rid, tokens, range(9))
        check_reads_own_tokens(m, model, rid, tokens, 9)
        m.set_context_position(rid, 9)
    m.verify_integrity()
    m.store_context_blocks("u")  # storing after the recompute works again
    m.remove_sequence("v", store_for_reuse=False)
    assert m.add_sequence(Request("w", tokens)) == 8
    replay(model, m.take_transfers())
    check_reads_own_tokens(m, model, "w", tokens, 8)


def test_sliding_window_request_that_cannot_recompute_in_place_is_readmitted():
    tokens = list(range(25))
    m, model = offloaded_chain(tokens, secondary_blocks=8, primary_blocks=8, attention_windows=(8,))
    assert m.add_sequence(Request("a", tokens)) == 24
    ids = m.block_ids("a")[0]
    assert ids[:4] == [PLACEHOLDER_BLOCK_ID] * 4  # blocks the first new query cannot see: placeholders
    plan = m.take_transfers()
    last = max(i for i, op in enumerate(plan) if TransferKind(op.kind) is TransferKind.ONBOARD)
    out = m.transfers_failed(plan, [last])  # block [20, 24) lost: the query at 20 needs [13, 20]
    assert out.recompute_from == {"a": 20} and out.readmit == {"a"}
    m.verify_integrity()
    replay(model, plan, {last})
    m.remove_sequence("a")  # stores only what is still valid: [16, 20) stays, [20, 24) is gone
    assert m.add_sequence(Request("a", tokens)) == 20
    replay(model, m.take_transfers())
    check_reads_own_tokens(m, model, "a", tokens, 20)


def test_lost_pinned_block_is_reported():
    tokens = list(range(9))
    m, _ = offloaded_chain(tokens, secondary_blocks=4)
    m.add_sequence(Request("a", tokens))
    plan = m.take_transfers()
    ids = m.store_blocks_for_reuse("a", pin=True)
    out = m.transfers_failed(plan)
    assert set(out.lost_pinned_blocks[m.windows[0]]) == set(ids[:2])
    m.verify_integrity()


def plan_ops_of(plan):
    return [(TransferKind(op.kind).name, op.pool, op.src, op.dst, op.num_tokens) for op in plan]


def test_plan_ops_helper_agrees():
    m = KVCacheManager(make_config())
    assert plan_ops(m) == []


def test_failed_rewind_copy_recomputes_the_kept_newest_token():
    """A rewind into a shared block copies the kept tokens first; if that copy fails, even the
    newest kept token (computed as a draft) must be recomputed."""
    m = KVCacheManager(make_config())
    model = SlotModel(m.config)
    toks = list(range(8)) + [50, 51, 52]
    m.add_sequence(Request("a", toks[:8], max_new_tokens=8))
    write(m, model, "a", toks, range(8))
    for t in toks[8:]:
        m.add_token("a", t)
    write(m, model, "a", toks, range(8, 11))
    m.take_transfers()
    m.store_blocks_for_reuse("a", pin=True)  # block [8, 10) cached with 2 tokens, and pinned
    m.rewind("a", 2)  # keeps 9 tokens: position 8 of the shared block is copied first
    plan = m.take_transfers()
    assert [op[0] for op in plan_ops_of(plan)] == ["COPY"]
    replay(model, plan, {0})
    out = m.transfers_failed(plan)
    assert out.recompute_from == {"a": 8}
    write(m, model, "a", toks, [8])
    check_reads_own_tokens(m, model, "a", toks, 9)
    m.set_context_position("a", 9)
    m.verify_integrity()
