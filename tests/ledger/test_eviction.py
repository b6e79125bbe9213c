"""FreeQueues: 101 priority queues per cache level as intrusive lists over block ids, victim =
front of the lowest non-empty queue, O(1) claim/take/release, retention expiry through
refresh() (TensorRT-LLM's eviction and retention rules, docs/semantics.md)."""
import pytest
from ledger_helpers import FakeClock

from kvjax import OutOfBlocksError
from kvjax.ledger.block_columns import PRIMARY, SECONDARY, BlockColumns
from kvjax.ledger.free_queues import NOT_FREE, FreeQueues


def make(num_primary=4, num_secondary=2, offload_min=30, clock=None):
    clock = clock or FakeClock()
    cols = BlockColumns(num_primary, num_secondary)
    prim = list(range(num_primary))
    sec = list(range(num_primary, num_primary + num_secondary))
    return FreeQueues(cols.level, num_primary, offload_min, clock), prim, sec, clock, cols


def ids(q, level=PRIMARY):
    return q.free_blocks(level)


def test_initial_queues_in_id_order_at_default_priority():
    q, prim, sec, _, _ = make()
    assert ids(q) == [0, 1, 2, 3] and ids(q, SECONDARY) == [4, 5]
    assert q.num_free == [4, 2]
    assert all(q.priority[b] == 35 and q.queue[b] != NOT_FREE for b in prim + sec)
    assert q.queue_ids(PRIMARY, 35) == [0, 1, 2, 3]


def test_pop_victim_is_front_of_lowest_nonempty_queue():
    q, prim, _, _, _ = make()
    for b in prim:
        q.claim(b)
    q.set_priority(2, 80)
    q.set_priority(0, 10)
    q.set_priority(3, 10)
    q.set_priority(1, 35)
    for b in (2, 3, 1, 0):
        q.release(b)
    assert ids(q) == [3, 0, 1, 2]  # queue 10 (release order), then 35, then 80
    victim, can_offload = q.pop_victim(PRIMARY)
    assert victim == 3 and not can_offload  # priority 10 < 30
    assert q.free_blocks(PRIMARY)[0] == 0  # the next victim
    assert q.pop_victim(PRIMARY)[0] == 0
    assert q.pop_victim(PRIMARY) == (1, True)  # 35 >= 30
    assert q.pop_victim(PRIMARY) == (2, True)
    assert q.num_free[PRIMARY] == 0 and q.nonempty[PRIMARY] == 0
    with pytest.raises(OutOfBlocksError):
        q.pop_victim(PRIMARY)


def test_can_offload_threshold_and_never_from_secondary():
    q, prim, sec, _, _ = make(offload_min=50)
    for b in prim:
        q.claim(b)
    q.set_priority(0, 50)
    q.set_priority(1, 49)
    q.release(1)
    q.release(0)
    assert q.pop_victim(PRIMARY) == (1, False)
    assert q.pop_victim(PRIMARY) == (0, True)  # priority >= threshold
    assert q.pop_victim(SECONDARY) == (sec[0], False)  # secondary victims are never offloaded


def test_claim_sets_priority_only_if_given_and_always_overwrites_duration():
    q, _, _, _, _ = make()
    q.set_duration(1, 5.0)
    q.claim(1, 70, 3.0)
    assert q.queue[1] == NOT_FREE and q.priority[1] == 70 and q.duration[1] == 3.0
    assert ids(q) == [0, 2, 3] and q.num_free[PRIMARY] == 3
    q.claim(1)  # in use: a no-op on the queues; priority kept, duration cleared (TRT claimBlock)
    assert q.priority[1] == 70 and 1 not in q.duration and q.num_free[PRIMARY] == 3


def test_take_keeps_priority_and_duration():
    q, _, _, clock, _ = make()
    q.claim(0, 60, 10.0)
    q.release(0)
    assert q.expiry[0] == clock.t + 10.0
    q.take(0)
    assert q.queue[0] == NOT_FREE and q.priority[0] == 60 and q.duration[0] == 10.0 and 0 not in q.expiry
    clock.advance(20)
    assert q.refresh() == 0  # the pending expiry was cancelled by take
    assert q.priority[0] == 60


def test_release_back_and_front():
    q, prim, _, _, _ = make()
    for b in prim:
        q.claim(b)
    q.release(2)
    q.release(0)
    q.release(3, to_front=True)
    q.release(1)
    assert ids(q) == [3, 2, 0, 1]


def test_offloaded_victim_is_queued_at_its_new_cache_level():
    q, _, sec, _, cols = make()
    victim, _ = q.pop_victim(PRIMARY)
    spare, _ = q.pop_victim(SECONDARY)
    assert (victim, spare) == (0, sec[0])
    cols.swap_memory(victim, spare)  # the offload: block 0 now owns secondary memory
    q.push(victim)  # still free (cached), in the secondary queues now; the spare is claimed
    assert cols.level[0] == SECONDARY and cols.level[sec[0]] == PRIMARY
    assert (cols.slot[0], cols.slot[sec[0]]) == (0, 0)
    assert ids(q) == [1, 2, 3] and ids(q, SECONDARY) == [sec[1], 0]
    assert q.num_free == [3, 2]


def test_expiry_moves_blocks_to_back_of_default_queue():
    q, prim, _, clock, _ = make()
    for b in prim:
        q.claim(b)
    q.claim(0, 80, 10.0)
    q.claim(1, 80, 20.0)
    q.claim(2, 35, 5.0)  # priority 35: a duration means nothing, no expiry armed
    q.claim(3, 35)
    for b in prim:
        q.release(b)
    assert ids(q) == [2, 3, 0, 1]
    assert 2 not in q.expiry and q.expiry[0] == clock.t + 10.0
    assert q.pending_expiries() == [0, 1]
    clock.advance(9.5)
    assert q.refresh() == 0
    clock.advance(0.5)  # expiry is inclusive: expired at now >= release + duration
    assert q.refresh() == 1
    assert q.priority[0] == 35 and ids(q) == [2, 3, 0, 1]
    assert q.queue_ids(PRIMARY, 35) == [2, 3, 0]  # to the back of queue 35
    clock.advance(100)
    assert q.refresh() == 1 and q.priority[1] == 35
    assert q.refresh() == 0 and q.pending_expiries() == []


def test_expiry_ignored_for_claimed_blocks_and_rearmed_on_release():
    q, _, _, clock, _ = make()
    q.claim(0, 90, 10.0)
    q.release(0)
    q.claim(0, 90, 10.0)  # back in use before expiring
    clock.advance(50)
    assert q.refresh() == 0 and q.priority[0] == 90  # in use: durations run from release
    q.release(0)  # re-armed from now
    clock.advance(9)
    assert q.refresh() == 0
    clock.advance(1)
    assert q.refresh() == 1 and q.priority[0] == 35


def test_free_counts_and_bitmask_consistency():
    q, _, _, _, _ = make()
    q.claim(0, 0)
    q.claim(1, 100)
    q.release(0)
    q.release(1)
    assert q.nonempty[PRIMARY] == (1 << 0) | (1 << 35) | (1 << 100)
    assert ids(q) == [0, 2, 3, 1]
    q.take(0)
    assert q.nonempty[PRIMARY] == (1 << 35) | (1 << 100)
    assert q.num_free == [3, 2]


def test_release_many_matches_release_one_by_one():
    a, prim, _, _, _ = make(num_primary=6)
    b, _, _, _, _ = make(num_primary=6)
    for q in (a, b):
        for blk in prim:
            q.claim(blk, 10 * (blk % 3) + 20)
    a.release_many([5, 3, 1, 0, 2, 4])
    for blk in [5, 3, 1, 0, 2, 4]:
        b.release(blk)
    assert ids(a) == ids(b) == [3, 0, 1, 4, 5, 2]
    assert (a.prev, a.next, a.queue) == (b.prev, b.next, b.queue)


@pytest.mark.parametrize("count", [1, 3, 5, 8])
def test_claim_victims_equals_successive_pops_and_default_retention(count):
    """The bulk claim admission uses: the same victims in the same order as `count` pops, each
    left at the default priority with its duration and armed expiry gone."""
    import random

    def build():
        clock = FakeClock()
        q, prim, _, _, _ = make(num_primary=10, clock=clock)
        rng = random.Random(4)
        for b in prim:
            q.claim(b)
        for b in rng.sample(prim, len(prim)):  # mixed priorities and durations, some armed
            q.claim(b, rng.choice([10, 35, 80]), rng.choice([None, 5.0]))
            q.release(b)
        return q

    a, b = build(), build()
    assert a.armed  # some victims have an expiry to cancel
    popped = []
    for _ in range(count):
        v, _ = a.pop_victim(PRIMARY)
        a.set_retention(v, 35, None)
        popped.append(v)
    assert b.claim_victims(PRIMARY, count) == popped
    assert a.free_blocks(PRIMARY) == b.free_blocks(PRIMARY) and a.num_free == b.num_free and a.nonempty == b.nonempty
    assert list(a.priority) == list(b.priority) and a.duration == b.duration
    assert a.armed == b.armed and a.expiry == b.expiry
    with pytest.raises(OutOfBlocksError):
        b.claim_victims(PRIMARY, b.num_free[PRIMARY] + 1)
