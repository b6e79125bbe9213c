"""The capacity scheduler against a real ledger (no model): what each policy admits, reserves,
pauses and defers, with block counts worked out by hand (4 tokens per block)."""
import pytest

from kvjax import CacheConfig, KVCacheManager
from kvjax.engine import CapacityScheduler, LiveRequest, Phase, SchedulerConfig, SchedulerPolicy, WorkItem

GNE, MAX_UTIL = SchedulerPolicy.GUARANTEED_NO_EVICT, SchedulerPolicy.MAX_UTILIZATION
TPB = 4


def ledger(primary=16, reuse=True):
    return KVCacheManager(CacheConfig(tokens_per_block=TPB, num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=128,
                                      primary_blocks=primary, enable_block_reuse=reuse))


def req(rid, tokens, max_new=10):
    tokens = list(tokens)
    return LiveRequest(WorkItem(rid, tuple(tokens), max_new), tokens, 0, 0.0, 0, order=-1)


_order = iter(range(10**6))


def admit(led, reqs, *, done=True):
    """What the engine does on admission; `done` also finishes prefill (stores the context)."""
    pre = led.add_sequences([r.ledger_request() for r in reqs])
    for r, p in zip(reqs, pre, strict=True):
        r.context, r.context_pos, r.phase, r.order = list(r.prompt), p, Phase.CONTEXT, next(_order)
        led.set_context_position(r.request_id, p)
        if done:
            finish_prefill(led, r)
    return pre


def finish_prefill(led, r, token=1):
    r.context_pos = len(r.context)
    led.set_context_position(r.request_id, r.context_pos)
    led.store_context_blocks(r.request_id)
    r.phase, r.output, r.pending = Phase.GENERATION, [token], token


def decode(led, r, token=2):
    """One decode step: the pending token enters the ledger, a new one is sampled."""
    led.add_token(r.request_id, r.pending)
    r.output.append(token)
    r.pending = token


def scheduler(led, policy, **kw):
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_num_tokens", 256)
    return CapacityScheduler(SchedulerConfig(policy=policy, **kw), led)


def distinct(n, start):
    return range(start * 1000, start * 1000 + n)


def test_guaranteed_no_evict_reserves_blocks_to_completion():
    led = ledger(primary=16)
    waiting = [req(f"r{i}", distinct(10, i + 1), max_new=10) for i in range(5)]  # 20 tokens = 5 blocks each
    s = scheduler(led, GNE).schedule([], waiting)
    assert [r.request_id for r in s.admit] == ["r0", "r1", "r2"]  # 3 x 5 = 15 <= 16; a 4th needs 20
    admit(led, s.admit)
    assert led.num_free_blocks() == 16 - 9  # prompts hold 3 blocks each
    s = scheduler(led, GNE).schedule(s.admit, waiting[3:])
    assert s.admit == [] and not s.pause  # 3 x 2 blocks reserved for generation + 5 > 7 free
    assert [r.request_id for r in s.generation] == ["r0", "r1", "r2"]


def test_max_utilization_admits_on_next_step_needs():
    led = ledger(primary=16)
    waiting = [req(f"r{i}", distinct(10, i + 1), max_new=10) for i in range(6)]
    s = scheduler(led, MAX_UTIL).schedule([], waiting)
    assert [r.request_id for r in s.admit] == ["r0", "r1", "r2", "r3", "r4"]  # 5 x 3 prompt blocks


def test_max_utilization_pauses_the_most_recently_started():
    led = ledger(primary=12)
    running = [req(f"r{i}", distinct(8, i + 1), max_new=20) for i in range(3)]  # 2 blocks each
    admit(led, running)
    for _ in range(4):  # each grows to 12 tokens = 3 blocks: 9 in use
        for r in running:
            decode(led, r)
    for r in running[:2]:  # two more tokens each: 14 tokens = 4 blocks -> 11 in use
        decode(led, r)
        decode(led, r)
    assert led.num_free_blocks() == 1
    for _ in range(2):
        decode(led, running[2])  # r2 at 14 tokens as well: 12 blocks in use, none free
    assert led.num_free_blocks() == 0
    for _ in range(2):  # all at 16 tokens: the next token of each needs a new block
        for r in running:
            decode(led, r)
    s = scheduler(led, MAX_UTIL).schedule(running, [])
    # r0 needs 1 block: none free -> pause the newest generating request (r2, 4 blocks freed
    # in the dry run); r0 and r1 then fit
    assert [r.request_id for r in s.pause] == ["r2"]
    assert [r.request_id for r in s.generation] == ["r0", "r1"]
    assert s.admit == []  # no admissions in a step that had to pause
    s_gne = scheduler(led, GNE).schedule(running, [])
    assert s_gne.pause == [] and len(s_gne.generation) == 3


def test_pausing_counts_only_blocks_nobody_else_holds():
    """Two requests share a stored 2-block prefix: pausing one frees only its private blocks."""
    led = ledger(primary=10)
    shared = list(distinct(8, 9))
    a = req("a", shared + [1, 2], max_new=30)
    admit(led, [a])
    b = req("b", shared + [3, 4], max_new=30)
    assert admit(led, [b]) == [8]  # reuses the 2 shared blocks
    for r in (a, b):
        for _ in range(5):
            decode(led, r)  # 15 tokens: 4 blocks each, 2 shared -> 6 in use
    c = req("c", distinct(12, 5), max_new=4)  # needs 3 blocks now
    led.start_scheduling()
    led.scheduling_remove_sequence("b")
    assert led.scheduling_has_free_blocks(6) and not led.scheduling_has_free_blocks(7)  # 4 free + b's 2 private
    s = scheduler(led, MAX_UTIL).schedule([a, b], [c])
    assert s.pause == [] and [r.request_id for r in s.admit] == ["c"]


def test_first_come_first_served():
    led = ledger(primary=16)
    waiting = [req("big", distinct(60, 1), max_new=20), req("small", distinct(4, 2), max_new=2)]
    s = scheduler(led, GNE).schedule([], waiting)
    assert s.admit == []  # 20 blocks > 16: the head of the queue blocks the small one behind it


def test_token_budget_and_cached_prefix_credit():
    led = ledger(primary=64)
    base = list(distinct(40, 1))
    first = req("first", base + [1], max_new=2)
    admit(led, [first])
    led.remove_sequence("first")  # its blocks stay cached
    # budget 32: the 41-token prompt shares 40 cached tokens, so it costs 1 token; a fresh
    # 20-token prompt costs 20; the third does not fit the remaining budget of 11
    waiting = [req("cached", base + [2], max_new=2), req("fresh", distinct(20, 2), max_new=2),
               req("late", distinct(20, 3), max_new=2)]
    s = scheduler(led, GNE, max_num_tokens=32, max_batch_size=8).schedule([], waiting)
    assert [r.request_id for r in s.admit] == ["cached", "fresh", "late"]  # admitted while budget > 0
    s = scheduler(led, GNE, max_num_tokens=16, max_batch_size=8).schedule([], waiting)
    assert [r.request_id for r in s.admit] == ["cached", "fresh"]  # 16 - 1 - 20 < 0: stop
    s = scheduler(led, GNE, max_num_tokens=256, max_batch_size=2).schedule([], waiting)
    assert [r.request_id for r in s.admit] == ["cached", "fresh"]  # batch size


def test_deferral_waits_for_a_shared_prefix_in_prefill():
    led = ledger(primary=64)
    system = list(distinct(24, 7))  # 6 blocks
    a = req("a", system + [1, 2, 3], max_new=4)
    b = req("b", system + [4, 5], max_new=4)
    c = req("c", list(distinct(10, 8)), max_new=4)
    s = scheduler(led, GNE).schedule([], [a, b, c])
    assert [r.request_id for r in s.admit] == ["a", "c"] and s.deferred == 1  # b would recompute a's prefix
    admit(led, [a, c], done=False)
    s = scheduler(led, GNE).schedule([a, c], [b])
    assert s.admit == [] and s.deferred == 1  # a is still in prefill
    finish_prefill(led, a)
    s = scheduler(led, GNE).schedule([a, c], [b])
    assert [r.request_id for r in s.admit] == ["b"]
    assert admit(led, s.admit) == [24]  # b reuses a's stored system prompt
    no_defer = scheduler(ledger(primary=64), GNE, defer_shared_prefix=False).schedule(
        [], [req("a", a.prompt), req("b", b.prompt)]
    )
    assert len(no_defer.admit) == 2


def test_deferral_respects_isolation_keys():
    led = ledger(primary=64)
    system = list(distinct(24, 7))
    a = req("a", system + [1])
    b = LiveRequest(WorkItem("b", tuple(system + [2]), 4, cache_salt="other"), system + [2], 0, 0.0, 0, order=-1)
    s = scheduler(led, GNE).schedule([], [a, b])
    assert len(s.admit) == 2 and s.deferred == 0  # different salt: nothing to wait for


@pytest.mark.parametrize("bad", [dict(max_batch_size=0), dict(max_num_tokens=2, max_batch_size=4), dict(policy="fifo")])
def test_config_errors(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)


def test_policy_names():
    assert SchedulerPolicy.parse("max-utilization") is MAX_UTIL
    assert SchedulerPolicy.parse("GUARANTEED_NO_EVICT") is GNE
