"""Waiting-queue order against a real ledger (no model): FCFS keeps arrival order; LPM puts
the longest cached prefix first, keeps paused requests first, and promotes a request that has
waited `max_wait_steps` steps ahead of every cache hit (starvation guard)."""
import pytest

from kvjax import CacheConfig, KVCacheManager
from kvjax.engine import CapacityScheduler, LiveRequest, QueuePolicy, SchedulerConfig, SchedulerPolicy, WorkItem
from kvjax.engine.config import EngineConfig
from kvjax.engine.request_state import Admission

TPB = 4


def ledger():
    return KVCacheManager(CacheConfig(tokens_per_block=TPB, num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=128,
                                      primary_blocks=64))


def req(rid, tokens, arrival=0, max_new=4):
    tokens = list(tokens)
    return LiveRequest(WorkItem(rid, tuple(tokens), max_new), tokens, arrival, 0.0, 0, order=-1)


def cache_prefix(led, tokens):
    from kvjax import Request

    led.add_sequence(Request("seed", list(tokens) + [9999]))
    led.set_context_position("seed", len(tokens) + 1)
    led.remove_sequence("seed")


def scheduler(led, queue_policy, **kw):
    return CapacityScheduler(SchedulerConfig(policy=SchedulerPolicy.GUARANTEED_NO_EVICT, max_batch_size=1,
                                             max_num_tokens=256, queue_policy=queue_policy, **kw), led)


PREFIX = list(range(1000, 1024))  # 6 blocks


@pytest.fixture
def queue():
    led = ledger()
    cache_prefix(led, PREFIX)
    fresh = req("fresh", range(2000, 2010), arrival=0)
    half = req("half", PREFIX[:12] + [1, 2, 3], arrival=1)
    full = req("full", PREFIX + [4, 5], arrival=2)
    return led, [fresh, half, full]


def test_fcfs_admits_in_arrival_order(queue):
    led, waiting = queue
    s = scheduler(led, "fcfs").schedule([], waiting, step=3)
    assert [r.request_id for r in s.admit] == ["fresh"]


def test_lpm_admits_the_longest_cached_prefix_first(queue):
    led, waiting = queue
    sched = scheduler(led, QueuePolicy.LPM)
    assert [r.request_id for r in sched.order_waiting(waiting, step=3)] == ["full", "half", "fresh"]
    assert [r.request_id for r in sched.schedule([], waiting, step=3).admit] == ["full"]
    assert [r.request_id for r in sched.schedule([], waiting).admit] == ["full"]  # no step: nobody starves


def test_lpm_starvation_guard(queue):
    led, waiting = queue
    sched = scheduler(led, "lpm", max_wait_steps=10)
    assert [r.request_id for r in sched.order_waiting(waiting, step=9)] == ["full", "half", "fresh"]
    # fresh arrived at step 0: at step 10 it has waited 10 steps and goes first; half (arrived
    # at 1) joins it at step 11, behind it (arrival order among the starved)
    assert [r.request_id for r in sched.order_waiting(waiting, step=10)] == ["fresh", "full", "half"]
    assert [r.request_id for r in sched.order_waiting(waiting, step=11)] == ["fresh", "half", "full"]
    assert [r.request_id for r in sched.schedule([], waiting, step=10).admit] == ["fresh"]


def test_lpm_keeps_paused_requests_first(queue):
    led, waiting = queue
    paused = req("paused", range(3000, 3005), arrival=0)
    paused.admissions.append(Admission(5, 0, False))
    order = scheduler(led, "lpm").order_waiting([paused] + waiting, step=3)
    assert [r.request_id for r in order] == ["paused", "full", "half", "fresh"]


def test_queue_policy_config():
    assert EngineConfig.from_dict({"queue_policy": "lpm", "max_wait_steps": 5}).scheduler.queue_policy is QueuePolicy.LPM
    assert EngineConfig().scheduler.queue_policy is QueuePolicy.FCFS
    with pytest.raises(ValueError, match="queue policy must be one of"):
        EngineConfig.from_dict({"queue_policy": "random"})
    with pytest.raises(ValueError, match="max_wait_steps"):
        SchedulerConfig(max_wait_steps=0)
