"""Routing policies: pure choices from load and cached prefix."""
import collections

import pytest

from kvjax.router import Candidate, KVAwarePolicy, LeastLoadedPolicy, RoundRobinPolicy, make_policy


def C(load, gpu=0, other=0, name=None):
    return Candidate(name, load, gpu, other)


def row(*cands):
    """Candidates as a router passes them: replicas "r0", "r1", ... in order."""
    return [Candidate(f"r{i}", c.load, c.gpu_tokens, c.other_tokens) for i, c in enumerate(cands)]


def test_round_robin_cycles():
    p = RoundRobinPolicy()
    cands = row(C(5), C(0), C(9))
    assert [p.choose(10, cands) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_least_loaded_rotates_ties():
    p = LeastLoadedPolicy()
    assert p.choose(10, row(C(3), C(1), C(2))) == 1
    picks = [p.choose(10, row(C(0), C(0), C(0))) for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]


def test_kv_aware_follows_the_cache_when_loads_are_even():
    p = KVAwarePolicy()
    assert p.choose(100, row(C(4, 16), C(4, 96), C(4, 0))) == 1
    # host-tier blocks count, a little less than GPU ones
    assert p.choose(100, row(C(4, 70), C(4, 0, 96))) == 1  # 0.8 * 96 > 70
    assert p.choose(100, row(C(4, 80), C(4, 0, 96))) == 0  # 0.8 * 96 < 80
    assert KVAwarePolicy(other_tier_weight=0.5).choose(100, row(C(4, 70), C(4, 0, 96))) == 0


def test_kv_aware_trades_overlap_for_load():
    p = KVAwarePolicy(alpha=0.5, imbalance_cap=10.0)
    # a small overlap edge does not justify a much busier replica
    assert p.choose(100, row(C(8, 20), C(2, 0), C(4, 0), C(4, 0))) == 1
    # a large one does
    assert p.choose(100, row(C(6, 95), C(2, 0), C(4, 0), C(4, 0))) == 0


def test_kv_aware_hard_cap():
    p = KVAwarePolicy(alpha=0.0, imbalance_cap=1.25, slack=0)
    # mean after placing = (12 + 4 + 4 + 4 + 1) / 4 = 6.25; cap 7.8: the full-overlap replica is too busy
    assert p.scores(100, row(C(12, 100), C(4), C(4), C(4)))[0] is None
    assert p.choose(100, row(C(12, 100), C(4), C(4), C(4))) != 0
    # with small loads the slack keeps some freedom: loads (2, 0, 0, 0) -> limit max(1.25 * 0.75, 0 + 1 + 2) = 3
    q = KVAwarePolicy(alpha=0.0, imbalance_cap=1.25, slack=2)
    assert q.choose(100, row(C(2, 100), C(0), C(0), C(0))) == 0
    assert q.choose(100, row(C(3, 100), C(0), C(0), C(0))) != 0
    # the least-loaded replica is always eligible
    assert all(s is not None for s in KVAwarePolicy(slack=0).scores(10, row(C(0), C(0))))


def test_kv_aware_ties_go_to_the_lighter_replica_then_rotate():
    p = KVAwarePolicy()
    assert p.choose(50, row(C(3, 32), C(2, 32))) == 1
    picks = {p.choose(50, row(C(0), C(0), C(0))) for _ in range(3)}
    assert picks == {0, 1, 2}


def test_ties_among_some_replicas_take_turns():
    """Two of four replicas hold the prompt and tie on every request: they alternate (a rotation
    by call count gave the first of them three ties in four)."""
    for p, cands in ((KVAwarePolicy(), row(C(0, 64), C(0, 64), C(0), C(0))),
                     (LeastLoadedPolicy(), row(C(1), C(1), C(3), C(2)))):
        picks = [p.choose(100, cands) for _ in range(40)]
        assert picks[:4] == [0, 1, 0, 1] and collections.Counter(picks) == {0: 20, 1: 20}, p.name


def test_ties_go_to_the_replica_chosen_least_recently():
    p = KVAwarePolicy()
    assert p.choose(100, row(C(0, 0), C(0, 0), C(0, 96))) == 2  # the cache decides
    assert p.choose(100, row(C(0, 0), C(0, 96), C(0, 0))) == 1
    # r0 was never chosen, r1 and r2 were: an all-way tie goes to r0, then r2 (its turn came first)
    assert [p.choose(100, row(C(0), C(0), C(0))) for _ in range(3)] == [0, 2, 1]
    # the order of the candidates does not matter, only which replica is which
    backwards = row(C(0), C(0), C(0))[::-1]
    assert backwards[p.choose(100, backwards)].replica == "r0"


def test_validation():
    with pytest.raises(ValueError):
        KVAwarePolicy(alpha=-1)
    with pytest.raises(ValueError):
        KVAwarePolicy(imbalance_cap=0.9)
    with pytest.raises(ValueError):
        KVAwarePolicy(other_tier_weight=2)
    with pytest.raises(ValueError):
        Candidate("a", -1)
    with pytest.raises(ValueError):
        RoundRobinPolicy().choose(10, [])
    with pytest.raises(ValueError):
        RoundRobinPolicy().choose(0, row(C(0)))
    with pytest.raises(ValueError, match="distinct replicas"):
        KVAwarePolicy().choose(10, [C(0, name="a"), C(1, name="a")])
    with pytest.raises(ValueError, match="routing policy must be one of"):
        make_policy("random")
    assert isinstance(make_policy("kv-aware", alpha=0.1), KVAwarePolicy)
