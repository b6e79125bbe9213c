"""Write and prefetch policies on deterministic traces."""
from __future__ import annotations

from collections import OrderedDict

import pytest

from kvjax.kv_store import PrefetchDecision, PrefetchPolicy, WritePolicy

# five requests, each a chain of two blocks, over a host tier of four blocks
TRACE = [["a", "b"], ["a", "c"], ["d", "e"], ["f", "g"], ["a", "b"]]


def replay(policy: WritePolicy, trace=TRACE, host_blocks: int = 4) -> dict[str, int]:
    """A host tier (LRU) in front of a store; every computed block is offloaded to host, store
    puts complete at once. Counts what each policy costs and saves."""
    host: OrderedDict[str, None] = OrderedDict()
    store: set[str] = set()
    n = dict(host_writes=0, store_writes=0, restores=0, recomputes=0)

    def write(keys):
        for k in keys:
            store.add(k)
        n["store_writes"] += len(keys)
        policy.on_store_result(keys, [True] * len(keys))

    def admit(k, from_store):
        if len(host) == host_blocks:
            victim, _ = host.popitem(last=False)
            write(policy.on_host_evicted([victim]))
        host[k] = None
        n["host_writes"] += 1
        write(policy.on_host_stored([k], from_store=from_store))

    for request in trace:
        for k in request:
            if k in host:
                host.move_to_end(k)
                write(policy.on_hit([k]))
            elif k in store:
                n["restores"] += 1
                admit(k, True)
            else:
                n["recomputes"] += 1
                admit(k, False)
    assert policy.tracked() == len(host)  # state only for host blocks
    return n


def test_write_through_mirrors_every_host_block():
    assert replay(WritePolicy("write_through")) == dict(host_writes=9, store_writes=7, restores=2, recomputes=7)


def test_write_through_selective_writes_only_reused_blocks():
    p = WritePolicy("write_through_selective")
    assert replay(p) == dict(host_writes=9, store_writes=1, restores=1, recomputes=8)
    assert p.puts_requested == 1


def test_write_back_writes_on_host_eviction():
    assert replay(WritePolicy("write_back")) == dict(host_writes=9, store_writes=5, restores=2, recomputes=7)


def test_selective_threshold_is_configurable():
    p = WritePolicy("write_through_selective", selective_uses=3)
    assert p.on_host_stored(["x"]) == [] and p.on_hit(["x"]) == [] and p.on_hit(["x"]) == ["x"]
    assert p.on_hit(["x"]) == []  # in flight: never asked twice


def test_evicted_while_put_in_flight_is_tracked_until_the_result():
    """sglang's partial-restore bug: a host block evicted before its backup finished. The policy
    does not forget it, and asks for no second put; the engine keeps the slot pinned meanwhile."""
    p = WritePolicy("write_through")
    assert p.on_host_stored(["x", "y"]) == ["x", "y"]
    assert p.on_host_evicted(["x"]) == [] and p.tracked() == 2
    p.on_store_result(["x", "y"], [True, True])
    assert p.tracked() == 1  # x leaves with its result; y stays on host


def test_failed_puts():
    p = WritePolicy("write_through")
    assert p.on_host_stored(["x"]) == ["x"]
    p.on_store_result(["x"], [False])
    assert p.on_hit(["x"]) == ["x"]  # retried on the next use
    p.on_store_result(["x"], [True])
    assert p.on_hit(["x"]) == []
    p.on_store_removed(["x"])  # the store evicted it: the host copy is written again on its next use
    assert p.on_hit(["x"]) == ["x"]
    wb = WritePolicy("write_back")
    wb.on_host_stored(["y"])
    assert wb.on_host_evicted(["y"]) == ["y"]
    wb.on_store_result(["y"], [False])
    assert wb.tracked() == 0  # a failed write-back is dropped with the block


def test_blocks_from_the_store_are_never_written_back():
    for name in ("write_through", "write_through_selective", "write_back"):
        p = WritePolicy(name)
        assert p.on_host_stored(["r"], from_store=True) == []
        assert p.on_hit(["r"]) == [] and p.on_hit(["r"]) == [] and p.on_host_evicted(["r"]) == []


def test_unknown_keys_and_bad_names():
    p = WritePolicy("write_back")
    assert p.on_hit(["never-seen"]) == [] and p.on_host_evicted(["never-seen"]) == []
    p.on_store_result(["never-seen"], [True])
    with pytest.raises(ValueError, match="write policy"):
        WritePolicy("write_around")
    with pytest.raises(ValueError, match="selective_uses"):
        WritePolicy("write_through_selective", selective_uses=0)


def test_min_hit_length_gates_lookups_and_fetches():
    p = PrefetchPolicy("best_effort", tokens_per_block=16, min_hit_tokens=256)
    assert not p.should_consult(255) and p.should_consult(256)
    assert not p.should_fetch(15) and p.should_fetch(16) and not p.should_fetch(0)
    q = PrefetchPolicy("best_effort", tokens_per_block=16, min_hit_tokens=0)
    assert not q.should_consult(15) and q.should_consult(16) and q.should_fetch(1)


def run_prefetch(policy: PrefetchPolicy, arrivals_ms: list[int], ready_ms: int) -> tuple[int, int]:
    """Poll a prefetch every millisecond (integer clock: exact); block i arrives at
    arrivals_ms[i] (in order). Returns (millisecond it stopped, blocks used)."""
    for t in range(100_000):
        done = sum(1 for a in arrivals_ms if a <= t)
        d = policy.decide(elapsed_s=t / 1000, blocks=len(arrivals_ms), done_prefix=done, scheduler_ready=t >= ready_ms)
        if d.stop:
            return t, d.use_blocks
    raise AssertionError("the prefetch never stopped")


ARRIVALS = [50 * (i + 1) for i in range(10)]  # a slow store: the last block arrives at 500 ms


def test_prefetch_policies_on_one_trace():
    kw = dict(tokens_per_block=16, timeout_base_s=0.2, timeout_per_block_s=0.01025)  # deadline 302.5 ms
    assert run_prefetch(PrefetchPolicy("best_effort", **kw), ARRIVALS, ready_ms=120) == (120, 2)
    assert run_prefetch(PrefetchPolicy("wait_complete", **kw), ARRIVALS, ready_ms=120) == (500, 10)
    assert run_prefetch(PrefetchPolicy("timeout", **kw), ARRIVALS, ready_ms=120) == (303, 6)
    assert run_prefetch(PrefetchPolicy("timeout", **kw), [10] * 10, ready_ms=0) == (10, 10)


def test_prefetch_decisions():
    p = PrefetchPolicy("best_effort", tokens_per_block=16)
    assert p.decide(elapsed_s=0, blocks=4, done_prefix=4, scheduler_ready=False) == PrefetchDecision(True, 4)
    assert p.decide(elapsed_s=9, blocks=4, done_prefix=1, scheduler_ready=False) == PrefetchDecision(False, 0)
    t = PrefetchPolicy("timeout", tokens_per_block=16, timeout_base_s=1.0, timeout_per_block_s=0.5)
    assert t.deadline_s(4) == 3.0
    assert t.decide(elapsed_s=2.99, blocks=4, done_prefix=3, scheduler_ready=True) == PrefetchDecision(False, 0)
    assert t.decide(elapsed_s=3.0, blocks=4, done_prefix=3, scheduler_ready=False) == PrefetchDecision(True, 3)
    with pytest.raises(ValueError, match="done_prefix"):
        t.decide(elapsed_s=0, blocks=4, done_prefix=5, scheduler_ready=True)
    for bad in ({"name": "eager"}, {"tokens_per_block": 0}, {"min_hit_tokens": -1}, {"timeout_base_s": -1.0},
                {"timeout_per_block_s": float("nan")}):
        kw = {"name": "timeout", "tokens_per_block": 16, **bad}
        with pytest.raises(ValueError):
            PrefetchPolicy(**kw)
