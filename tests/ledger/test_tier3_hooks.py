"""The ledger's tier-3 hooks (`kvjax.ledger.tier3`, `kvjax.ledger.restores`): host notices, the
evict guard, host pins and restores, each with `verify_integrity()` after the calls, and a
seeded random driver with a model of which host slots are pinned."""
from __future__ import annotations

import pytest
from ledger_helpers import cached_ids, free_order, make_manager, plan_ops

from kvjax import InvalidArgumentError, InvalidRequestError, OutOfBlocksError, Request, UnknownBlockError
from kvjax.config import RECURRENT_STATES
from kvjax.ledger import HostNotice, HostNoticeKind

R = range


def seed(m, rid, tokens):
    """Admit a request and remove it, storing its blocks for reuse."""
    m.add_sequence(Request(rid, list(tokens)))
    m.remove_sequence(rid)


def fill_host(m):
    """Seed chain A (blocks 0, 1 cached), then admit 4 fresh blocks: A's blocks are offloaded
    into host slots 0 and 1. Returns the notices of that admission."""
    seed(m, "a", R(9))
    m.take_transfers()
    m.take_host_notices()
    m.add_sequence(Request("b", list(R(100, 116))))
    notes = m.take_host_notices()
    m.remove_sequence("b", store_for_reuse=False)
    return notes


def test_notices_off_by_default_and_cheap():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    seed(m, "a", R(9))
    m.add_sequence(Request("b", list(R(100, 116))))
    assert all(wm.tier3 is None for wm in m._bm.windows)  # nothing built until first used
    m.verify_integrity()


def test_stored_notice_per_offload_with_hash_and_host_slot():
    m = make_manager(primary_blocks=4, secondary_blocks=2, event_buffer_max_size=64)
    m.enable_host_notices()
    notes = fill_host(m)
    assert [(n.kind, n.window, n.host_slot, n.block_id) for n in notes] == [
        (HostNoticeKind.STORED, 64, 0, 1),
        (HostNoticeKind.STORED, 64, 1, 0),
    ]
    assert [n.block_hash for n in notes] == [m.inspector.block_hash(1), m.inspector.block_hash(0)]
    assert notes[0].block_hash != notes[1].block_hash
    assert m.take_host_notices() == []  # taken once
    m.verify_integrity()


def test_hit_notice_on_onboard_and_partial_copy():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    m.enable_host_notices()
    stored = fill_host(m)
    by_slot = {n.host_slot: n.block_hash for n in stored}
    m.add_sequence(Request("c", list(R(9))))  # matches both host blocks: two onboards
    notes = m.take_host_notices()
    assert [(n.kind, n.host_slot, n.block_hash) for n in notes] == [
        (HostNoticeKind.HIT, 1, by_slot[1]),
        (HostNoticeKind.HIT, 0, by_slot[0]),
    ]
    m.verify_integrity()


def test_evicting_notice_comes_before_the_slot_is_overwritten():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    m.enable_host_notices()
    stored = fill_host(m)
    m.take_transfers()
    seed(m, "d", R(200, 209))  # cached chain D on primary, A's two blocks on host
    m.take_host_notices()
    m.take_transfers()
    m.add_sequence(Request("e", list(R(300, 316))))  # offloads D: A's host blocks are evicted
    notes = m.take_host_notices()
    kinds = [(n.kind, n.host_slot) for n in notes]
    ev, st = HostNoticeKind.EVICTING, HostNoticeKind.STORED
    assert kinds == [(ev, 0), (st, 0), (ev, 1), (st, 1)]
    evicted = [n.block_hash for n in notes if n.kind == HostNoticeKind.EVICTING]
    assert sorted(evicted, key=repr) == sorted((n.block_hash for n in stored), key=repr)
    ops = plan_ops(m)
    assert [op[0] for op in ops] == ["OFFLOAD", "OFFLOAD"] and [op[3] for op in ops] == [0, 1]
    m.verify_integrity()


def test_evict_guard_keeps_host_block_pinned_and_falls_back_to_drop():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    asked = []

    def guard(window, h, slot):
        asked.append(slot)
        return True  # keep every host block (a write-back whose put is not issued yet)

    m.enable_host_notices(evict_guard=guard)
    fill_host(m)
    seed(m, "d", R(200, 209))
    m.take_host_notices()
    m.take_transfers()
    m.add_sequence(Request("e", list(R(300, 316))))
    # both host blocks were kept and are now host-pinned; D's blocks are dropped, not offloaded
    assert asked == [0, 1]
    assert m.host_slot_pins() == {0: 1, 1: 1}
    assert m.num_free_secondary_blocks() == 0
    assert [n.kind for n in m.take_host_notices()] == []
    assert [op[0] for op in plan_ops(m)] == []
    m.verify_integrity()
    m.remove_sequence("e", store_for_reuse=False)
    m.unpin_host_slots(None, [0, 1])
    assert m.host_slot_pins() == {} and m.num_free_secondary_blocks() == 2
    m.verify_integrity()


def test_host_pins_nest_and_block_eviction():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    m.enable_host_notices()
    fill_host(m)
    m.pin_host_slots(None, [0])
    m.pin_host_slots(None, [0])
    assert m.host_slot_pins() == {0: 2}
    m.verify_integrity()
    seed(m, "d", R(200, 209))
    m.take_host_notices()
    m.add_sequence(Request("e", list(R(300, 316))))
    # only slot 1 is usable: D's first victim goes there (A's block evicted), then the
    # second victim evicts the first from it; slot 0 is never touched
    notes = m.take_host_notices()
    assert [(n.kind, n.host_slot) for n in notes] == [(HostNoticeKind.EVICTING, 1), (HostNoticeKind.STORED, 1)] * 2
    m.verify_integrity()
    m.unpin_host_slots(None, [0])
    assert m.host_slot_pins() == {0: 1}
    m.unpin_host_slots(None, [0])
    assert m.host_slot_pins() == {}
    with pytest.raises(InvalidRequestError):
        m.unpin_host_slots(None, [0])
    m.verify_integrity()


def test_every_host_block_pinned_offload_drops_the_victim():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    fill_host(m)
    m.pin_host_slots(None, [0, 1])
    seed(m, "d", R(200, 209))
    m.take_transfers()
    host = {b for b in cached_ids(m) if m.block(b).level == 1}
    assert len(host) == 2 and len(cached_ids(m)) == 4  # A on host, D on primary
    m.iteration_stats()
    m.add_sequence(Request("e", list(R(300, 316))))
    assert plan_ops(m) == []  # no offload: D's cached blocks were dropped as with no host tier
    assert cached_ids(m) == host
    it = m.iteration_stats()
    assert (it.offloaded_blocks, it.evicted_blocks) == (0, 2)
    m.verify_integrity()


def test_pinned_host_block_is_onboarded_with_its_pin_following_the_slot():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    fill_host(m)
    m.pin_host_slots(None, [0, 1])
    m.take_transfers()
    assert m.add_sequence(Request("c", list(R(9)))) == 8  # both matched, though pinned
    ops = plan_ops(m)
    assert [op[0] for op in ops] == ["ONBOARD", "ONBOARD"] and sorted(op[2] for op in ops) == [0, 1]
    # the host slots stay pinned: owned now by the onboard targets, not by c's blocks
    assert m.host_slot_pins() == {0: 1, 1: 1}
    assert m.num_free_secondary_blocks() == 0
    assert all(m.block(b).level == 0 for b in m.block_ids("c")[0])
    m.verify_integrity()
    m.unpin_host_slots(None, [0, 1])
    assert m.num_free_secondary_blocks() == 2
    m.verify_integrity()


def test_host_pin_bad_input_changes_nothing():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    fill_host(m)
    snap = m.snapshot()
    for bad, err in [
        ([2], UnknownBlockError),
        ([-1], UnknownBlockError),
        ([0, 7], UnknownBlockError),
        (["0"], InvalidArgumentError),
        ([True], InvalidArgumentError),
        ([0.0], InvalidArgumentError),
        ("01", InvalidArgumentError),
        (5, InvalidArgumentError),
    ]:
        with pytest.raises(err):
            m.pin_host_slots(None, bad)
        assert m.snapshot() == snap
    with pytest.raises(InvalidRequestError):
        m.unpin_host_slots(None, [0])
    with pytest.raises(InvalidArgumentError):
        m.pin_host_slots(32, [0])
    assert m.snapshot() == snap
    m.pin_host_slots(None, [0])
    snap = m.snapshot()
    with pytest.raises(InvalidRequestError):
        m.unpin_host_slots(None, [0, 0])  # one pin, two unpins: refused whole
    assert m.snapshot() == snap


def test_no_host_tier_refuses_pins():
    m = make_manager(primary_blocks=4)
    with pytest.raises(InvalidRequestError):
        m.pin_host_slots(None, [0])


# --------------------------------------------------------------------------- restores
def test_restore_commit_caches_blocks_a_later_admission_onboards():
    m = make_manager(primary_blocks=6, secondary_blocks=4, event_buffer_max_size=64)
    seed(m, "a", R(5))  # block 0 cached (tokens 0..3)
    req = Request("r", list(R(17)))  # 4 reusable full blocks: 1 local, ask 3 from tier 3
    r = m.reserve_restore(req, 3)
    assert (r.first, r.num_blocks) == (1, 3)
    slots = r.host_slots[64]
    assert len(set(slots)) == 3 and m.num_free_secondary_blocks() == 1
    m.verify_integrity()
    assert m.analyze_prefix_reuse(req).total_matched_tokens == 4  # not in the tree yet
    assert m.commit_restore(r) == 3
    m.verify_integrity()
    m.take_transfers()
    assert m.add_sequence(req) == 16
    ops = plan_ops(m)
    assert [op[0] for op in ops] == ["ONBOARD"] * 3 and [op[2] for op in ops] == slots
    m.verify_integrity()


def test_restore_partial_commit_leaves_no_block_after_a_failed_get():
    m = make_manager(primary_blocks=6, secondary_blocks=4)
    seed(m, "a", R(5))
    req = Request("r", list(R(17)))
    r = m.reserve_restore(req, 3)
    assert m.commit_restore(r.ticket, 1) == 1  # block 1 arrived, block 2's get failed
    assert m.num_free_secondary_blocks() == 4
    assert m.analyze_prefix_reuse(req).total_matched_tokens == 8
    m.verify_integrity()
    with pytest.raises(InvalidArgumentError):
        m.commit_restore(r.ticket)  # closed
    with pytest.raises(InvalidArgumentError):
        m.abort_restore(r.ticket)


def test_restore_abort_frees_everything_and_caches_nothing():
    m = make_manager(primary_blocks=6, secondary_blocks=4)
    seed(m, "a", R(5))
    before = (cached_ids(m), free_order(m, level=1))
    req = Request("r", list(R(17)))
    r = m.reserve_restore(req, 2)
    m.abort_restore(r)
    assert cached_ids(m) == before[0] and sorted(free_order(m, level=1)) == sorted(before[1])
    assert m.analyze_prefix_reuse(req).total_matched_tokens == 4
    m.verify_integrity()


def test_restore_commit_keeps_a_block_cached_meanwhile():
    m = make_manager(primary_blocks=6, secondary_blocks=4)
    seed(m, "a", R(5))
    req = Request("r", list(R(13)))
    r = m.reserve_restore(req, 2)
    seed(m, "x", R(13))  # another request computed and stored blocks 1 and 2 meanwhile
    assert m.commit_restore(r) == 0  # the cached ones stay, ours are freed
    assert m.num_free_secondary_blocks() == 4
    m.verify_integrity()


def test_restore_reserves_fewer_when_the_host_pool_is_short():
    m = make_manager(primary_blocks=6, secondary_blocks=2)
    r = m.reserve_restore(Request("r", list(R(17))), 4)
    assert (r.first, r.num_blocks) == (0, 2)
    with pytest.raises(OutOfBlocksError):
        m.reserve_restore(Request("s", list(R(17))), 1)
    m.abort_restore(r)
    m.verify_integrity()


def test_restore_bad_input_changes_nothing():
    m = make_manager(primary_blocks=6, secondary_blocks=4)
    seed(m, "a", R(5))
    snap = m.snapshot()
    req = Request("r", list(R(17)))
    for args, err in [
        ((req, 0), InvalidArgumentError),
        ((req, 4), InvalidRequestError),  # 1 local + 4 > 4 reusable full blocks
        ((req, True), InvalidArgumentError),
        ((req, 1.0), InvalidArgumentError),
        (("r", 1), InvalidRequestError),
    ]:
        with pytest.raises(err):
            m.reserve_restore(*args)
        assert m.snapshot() == snap
    for t in (0, 99, "1", None, True):
        with pytest.raises(InvalidArgumentError):
            m.commit_restore(t)
        with pytest.raises(InvalidArgumentError):
            m.abort_restore(t)
    r = m.reserve_restore(req, 2)
    snap = m.snapshot()
    for n in (-1, 3, 1.0, True):
        with pytest.raises(InvalidArgumentError):
            m.commit_restore(r, n)
        assert m.snapshot() == snap
    with pytest.raises(InvalidRequestError):
        m.pin_host_slots(None, r.host_slots[64][:1])  # reserved
    assert m.snapshot() == snap


def test_recurrent_window_refuses_pins_and_restores():
    m = make_manager(
        primary_blocks={64: 8, RECURRENT_STATES: 4},
        secondary_blocks=2,
        attention_windows=(64, RECURRENT_STATES),
        recurrent_state_bytes=64,
        num_layers=2,
    )
    with pytest.raises(InvalidRequestError):
        m.pin_host_slots(RECURRENT_STATES, [0])
    with pytest.raises(InvalidRequestError):
        m.reserve_restore(Request("r", list(R(9))), 1)
    m.pin_host_slots(64, [0])  # the attention window takes host pins
    m.unpin_host_slots(64, [0])
    m.verify_integrity()


def test_restore_commit_emits_stored_events_on_the_host_tier():
    from kvjax.ledger.events import StoredData

    m = make_manager(primary_blocks=6, secondary_blocks=4, event_buffer_max_size=64)
    seed(m, "a", R(5))
    m.flush_iteration_events()
    m.get_latest_events()
    r = m.reserve_restore(Request("r", list(R(17))), 3)
    m.commit_restore(r)
    m.flush_iteration_events()
    stored = [e.data for e in m.get_latest_events() if isinstance(e.data, StoredData)]
    assert len(stored) == 1
    assert stored[0].parent_hash == m.inspector.block_hash(0)
    assert [b.tokens for b in stored[0].blocks] == [tuple(R(4, 8)), tuple(R(8, 12)), tuple(R(12, 16))] or [
        tuple(t.token_id for t in b.tokens) for b in stored[0].blocks
    ] == [tuple(R(4, 8)), tuple(R(8, 12)), tuple(R(12, 16))]
    assert [b.cache_level for b in stored[0].blocks] == [1, 1, 1]


# --------------------------------------------------------------------------- random driver
# two shared first blocks, each followed by three tails (prompts of 9..18 tokens)
PROMPTS = [
    list(R(p * 100, p * 100 + 4)) + list(R(1000 + 7 * k, 1000 + 7 * k + n)) for p in (0, 1) for k, n in ((0, 9), (1, 14), (2, 5))
]


@pytest.mark.parametrize("vswa", [False, True], ids=["full", "vswa"])
@pytest.mark.parametrize("seed_", [0, 1, 2, 3])
def test_random_driver_keeps_pins_and_restores_consistent(seed_, vswa):
    """Admissions, removals, tokens, offloads, host pins (by the engine and the evict guard),
    restores (commit / abort) and evictions, with `verify_integrity()` after every operation,
    a model of the host pins, and: a pinned host slot is never an op's destination, never
    evicted, and needed_blocks_one_step's guarantee holds with host-pinned matches."""
    import random

    from kvjax.transfer_plan import TransferKind

    rng = random.Random(seed_)
    kw = dict(num_layers=2, attention_windows=(8, 64), event_buffer_max_size=4096) if vswa else {}
    m = make_manager(primary_blocks=10, secondary_blocks=5, max_seq_len=64, **kw)
    win = 64 if vswa else None  # the driver pins host slots of the full-attention window
    model: dict[int, int] = {}
    keep = seed_ % 2 == 1  # half the runs with an evict guard that keeps some host blocks

    def guard(window, h, slot):
        k = keep and window == (win or 64) and rng.random() < 0.15
        if k:
            model[slot] = model.get(slot, 0) + 1
        return k

    m.enable_host_notices(evict_guard=guard)
    tickets: list[int] = []
    live: list[str] = []
    n = 0
    seen = dict.fromkeys(("pinned_hit", "committed", "refused", "evicting"), 0)
    for step in range(500):
        pinned_before = {s for s, c in model.items() if c}
        op = rng.random()
        if op < 0.3:
            n += 1
            req = Request(f"r{n}", rng.choice(PROMPTS), max_new_tokens=8)
            fits = all(m.needed_blocks_one_step(req, window=w) <= m.num_free_blocks(w) for w in m.windows)
            try:
                m.add_sequence(req)
                live.append(req.request_id)
            except OutOfBlocksError:
                assert not fits, "needed_blocks_one_step promised room"
                seen["refused"] += 1
        elif op < 0.45 and live:
            rid = live.pop(rng.randrange(len(live)))
            m.remove_sequence(rid, store_for_reuse=rng.random() < 0.8)
        elif op < 0.55 and live:
            rid = rng.choice(live)
            try:
                m.add_token(rid, rng.randrange(50))
            except (OutOfBlocksError, InvalidRequestError):
                pass
        elif op < 0.69 and any(model.values()):
            s = rng.choice([s for s, c in model.items() if c])
            m.unpin_host_slots(win, [s])
            model[s] -= 1
        elif op < 0.82:
            try:
                r = m.reserve_restore(Request("q", rng.choice(PROMPTS)), rng.randrange(1, 4))
                tickets.append(r.ticket)
                assert not set(r.host_slots[win or 64]) & pinned_before
            except (OutOfBlocksError, InvalidRequestError):
                pass
        elif op < 0.9 and tickets:
            t = tickets.pop(rng.randrange(len(tickets)))
            if rng.random() < 0.7:
                seen["committed"] += m.commit_restore(t, rng.choice([None, 0, 1]) if rng.random() < 0.5 else None)
            else:
                m.abort_restore(t)
        else:
            m.refresh_blocks()
        plan = m.take_transfers()  # applied each step, as an engine does
        for kind, pool, dst in zip(plan.kind, plan.pool, plan.dst, strict=True):
            if kind == int(TransferKind.OFFLOAD) and m.config.pools[int(pool)].window == (win or 64):
                assert int(dst) not in pinned_before  # a pinned host slot is never overwritten
        m.transfers_applied(plan)
        # the engine polls notices after each call: a stored block's put pins its slot
        for note in m.take_host_notices():
            ours = note.window == (win or 64)
            assert note.kind != HostNoticeKind.EVICTING or not ours or note.host_slot not in pinned_before
            seen["pinned_hit"] += note.kind == HostNoticeKind.HIT and ours and note.host_slot in pinned_before
            seen["evicting"] += note.kind == HostNoticeKind.EVICTING
            if note.kind == HostNoticeKind.STORED and ours and rng.random() < 0.5:
                m.pin_host_slots(win, [note.host_slot])
                model[note.host_slot] = model.get(note.host_slot, 0) + 1
        m.verify_integrity()
        assert m.host_slot_pins(win) == {s: c for s, c in model.items() if c}, step
    if vswa:  # two windows share the primary pool pressure: pinned hits are rarer there
        seen.pop("pinned_hit")
    assert all(seen.values()), seen  # the driver reached every path
    for t in tickets:
        m.abort_restore(t)
    for s, c in list(model.items()):
        m.unpin_host_slots(win, [s] * c)
    for rid in live:
        m.remove_sequence(rid)
    m.verify_integrity()
    assert m.num_free_secondary_blocks() == 5 and m.host_slot_pins(win) == {}


def test_reset_prefix_cache_keeps_host_pinned_blocks_cached():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    fill_host(m)
    m.pin_host_slots(None, [0])
    pinned = {b for b in cached_ids(m) if m.block(b).level == 1 and m.block(b).slot == 0}
    m.reset_prefix_cache()
    assert cached_ids(m) == pinned
    m.verify_integrity()


def test_notice_records_are_frozen():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    m.enable_host_notices()
    note = fill_host(m)[0]
    assert isinstance(note, HostNotice)
    with pytest.raises(AttributeError):
        note.host_slot = 1  # type: ignore[misc]


@pytest.mark.parametrize("corrupt", ["slot_pins", "block_pins", "reserved"])
def test_verify_integrity_catches_broken_host_pins(corrupt):
    from kvjax.errors import IntegrityError

    m = make_manager(primary_blocks=6, secondary_blocks=4)
    seed(m, "a", R(5))
    r = m.reserve_restore(Request("r", list(R(13))), 1)
    m.pin_host_slots(None, [s for s in R(4) if s not in r.host_slots[64]][:1])
    m.verify_integrity()
    wm = m._bm.windows[0]
    t = wm.tier3
    if corrupt == "slot_pins":
        t.pins[r.host_slots[64][0]] += 1
    elif corrupt == "block_pins":
        b = next(iter(t.reserved))
        wm.refs.pin[b] += 1
        wm.refs.ref[b] += 1
    else:
        t.reserved.clear()
    with pytest.raises(IntegrityError):
        m.verify_integrity()
