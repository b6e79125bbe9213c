"""LRUEvictionPolicy: 101 priority queues per cache level, victim = front of the lowest
non-empty queue, O(1) claim/take/release/requeue, retention expiry through refresh()
(trtllm.md §1.8, SPEC §3 "Eviction" and "Retention")."""
import pytest

from kvjax import OutOfBlocksError
from kvjax.ledger.block import NOT_FREE, PRIMARY, SECONDARY, Block
from kvjax.ledger.eviction import LRUEvictionPolicy
from ledger_helpers import FakeClock


def make(num_primary=4, num_secondary=2, offload_min=30, clock=None):
    clock = clock or FakeClock()
    prim = [Block(i, 64, i, PRIMARY) for i in range(num_primary)]
    sec = [Block(num_primary + j, 64, j, SECONDARY) for j in range(num_secondary)]
    return LRUEvictionPolicy([prim, sec], offload_min, clock), prim, sec, clock


def ids(policy, level=PRIMARY):
    return [b.block_id for b in policy.free_blocks(level)]


def test_initial_queues_in_id_order_at_default_priority():
    p, prim, sec, _ = make()
    assert ids(p) == [0, 1, 2, 3] and ids(p, SECONDARY) == [4, 5]
    assert p.num_free == [4, 2]
    assert all(b.priority == 35 and b.free_level != NOT_FREE for b in prim + sec)
    assert [b.block_id for b in p.queues[PRIMARY][35]] == [0, 1, 2, 3]


def test_pop_victim_is_front_of_lowest_nonempty_queue():
    p, prim, _, _ = make()
    for b in prim:
        p.claim(b)
    prim[2].priority = 80
    prim[0].priority = 10
    prim[3].priority = 10
    prim[1].priority = 35
    for b in (prim[2], prim[3], prim[1], prim[0]):
        p.release(b)
    assert ids(p) == [3, 0, 1, 2]  # queue 10 (release order), then 35, then 80
    victim, can_offload = p.pop_victim(PRIMARY)
    assert victim is prim[3] and not can_offload  # priority 10 < 30
    assert p.peek_victim(PRIMARY) == (prim[0], False)
    assert p.pop_victim(PRIMARY)[0] is prim[0]
    assert p.pop_victim(PRIMARY) == (prim[1], True)  # 35 >= 30
    assert p.pop_victim(PRIMARY) == (prim[2], True)
    assert p.num_free[PRIMARY] == 0 and p.nonempty[PRIMARY] == 0
    with pytest.raises(OutOfBlocksError):
        p.pop_victim(PRIMARY)
    with pytest.raises(OutOfBlocksError):
        p.peek_victim(PRIMARY)


def test_can_offload_threshold_and_never_from_secondary():
    p, prim, sec, _ = make(offload_min=50)
    for b in prim:
        p.claim(b)
    prim[0].priority = 50
    prim[1].priority = 49
    p.release(prim[1])
    p.release(prim[0])
    assert p.pop_victim(PRIMARY) == (prim[1], False)
    assert p.pop_victim(PRIMARY) == (prim[0], True)  # priority >= threshold
    assert p.pop_victim(SECONDARY) == (sec[0], False)  # secondary victims are never offloaded


def test_claim_sets_priority_only_if_given_and_always_overwrites_duration():
    p, prim, _, _ = make()
    b = prim[1]
    b.duration = 5.0
    p.claim(b, 70, 3.0)
    assert b.free_level == NOT_FREE and b.priority == 70 and b.duration == 3.0
    assert ids(p) == [0, 2, 3] and p.num_free[PRIMARY] == 3
    p.claim(b)  # in use: a no-op on the queues; priority kept, duration cleared (TRT claimBlock)
    assert b.priority == 70 and b.duration is None and p.num_free[PRIMARY] == 3


def test_take_keeps_priority_and_duration():
    p, prim, _, clock = make()
    b = prim[0]
    p.claim(b, 60, 10.0)
    p.release(b)
    assert b.expiry == clock.t + 10.0
    p.take(b)
    assert b.free_level == NOT_FREE and b.priority == 60 and b.duration == 10.0 and b.expiry is None
    clock.advance(20)
    assert p.refresh() == 0  # the pending expiry was cancelled by take
    assert b.priority == 60


def test_release_back_and_front():
    p, prim, _, _ = make()
    for b in prim:
        p.claim(b)
    p.release(prim[2])
    p.release(prim[0])
    p.release(prim[3], to_front=True)
    p.release(prim[1])
    assert ids(p) == [3, 2, 0, 1]


def test_requeue_follows_cache_level():
    p, prim, sec, _ = make()
    b = prim[0]
    b.swap_memory(sec[0])  # offload-style swap: b now owns secondary memory
    p.requeue(b)
    p.requeue(sec[0])
    assert b.level == SECONDARY and sec[0].level == PRIMARY
    assert ids(p) == [1, 2, 3, 4] and ids(p, SECONDARY) == [5, 0]
    assert p.num_free == [4, 2]


def test_expiry_moves_blocks_to_back_of_default_queue():
    p, prim, _, clock = make()
    for b in prim:
        p.claim(b)
    p.claim(prim[0], 80, 10.0)
    p.claim(prim[1], 80, 20.0)
    p.claim(prim[2], 35, 5.0)  # priority 35: a duration means nothing, no expiry armed
    p.claim(prim[3], 35)
    for b in prim:
        p.release(b)
    assert ids(p) == [2, 3, 0, 1]
    assert prim[2].expiry is None and prim[0].expiry == clock.t + 10.0
    assert sorted(b.block_id for b in p.pending_expiries()) == [0, 1]
    clock.advance(9.5)
    assert p.refresh() == 0
    clock.advance(0.5)  # expiry is inclusive: expired at now >= release + duration
    assert p.refresh() == 1
    assert prim[0].priority == 35 and ids(p) == [2, 3, 0, 1]
    assert [b.block_id for b in p.queues[PRIMARY][35]] == [2, 3, 0]  # to the back of queue 35
    clock.advance(100)
    assert p.refresh() == 1 and prim[1].priority == 35
    assert p.refresh() == 0 and p.pending_expiries() == []


def test_expiry_ignored_for_claimed_blocks_and_rearmed_on_release():
    p, prim, _, clock = make()
    b = prim[0]
    p.claim(b, 90, 10.0)
    p.release(b)
    p.claim(b, 90, 10.0)  # back in use before expiring
    clock.advance(50)
    assert p.refresh() == 0 and b.priority == 90  # in use: durations run from release
    p.release(b)  # re-armed from now
    clock.advance(9)
    assert p.refresh() == 0
    clock.advance(1)
    assert p.refresh() == 1 and b.priority == 35


def test_free_counts_and_bitmask_consistency():
    p, prim, sec, _ = make()
    p.claim(prim[0], 0)
    p.claim(prim[1], 100)
    p.release(prim[0])
    p.release(prim[1])
    assert p.nonempty[PRIMARY] == (1 << 0) | (1 << 35) | (1 << 100)
    assert ids(p) == [0, 2, 3, 1]
    p.take(prim[0])
    assert p.nonempty[PRIMARY] == (1 << 35) | (1 << 100)
    assert p.num_free == [3, 2]
