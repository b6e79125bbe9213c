"""Memory bounded by the pools, not by time or request count (issue 7, behaviour 8).

* The retention-expiry heap deletes lazily; without compaction it gains one stale entry per
  release with a duration (request rate x duration). It must stay within `heap_limit`
  (2 x blocks + 16) however long the run, and expiries must still fire.
* Pruned tree nodes must be unreachable: a live node's run link (`next_in_run`) used to keep
  the pruned rest of its run (nodes, keys and the run's token tuple) alive for good.
(The steady-workload tracemalloc check is in benchmarks/ledger_longrun.py and its test slice.)
"""
from __future__ import annotations

import gc
import random

from kvjax import KVCacheManager, Request, RetentionConfig, TokenRangeRetention
from kvjax.ledger.radix_tree import RadixNode
from ledger_helpers import FakeClock, make_config


def test_expiry_heap_is_bounded_by_the_pool():
    clock = FakeClock()
    m = KVCacheManager(make_config(primary_blocks=64), clock=clock)
    policy = m._bm.windows[0].policy
    hour = RetentionConfig((TokenRangeRetention(0, None, 80, 3600.0),), decode_priority=80, decode_duration_s=3600.0)
    rng = random.Random(0)
    peak = 0
    for i in range(4000):
        m.add_sequence(Request(i, [rng.randrange(40) for _ in range(9)], retention=hour))
        m.remove_sequence(i)
        clock.advance(0.01)
        peak = max(peak, policy.heap_size)
    assert policy.heap_limit == 2 * 64 + 16
    assert peak <= policy.heap_limit  # was one entry per release: 12,000 here
    m.verify_integrity()
    # compaction kept every live entry: every retained block still expires, on time
    retained = [b for b in m._bm.windows[0].blocks if b.priority == 80]
    assert len(retained) == 64 and set(policy.pending_expiries()) == set(retained)
    clock.advance(3599.0)
    assert m.refresh_blocks() < 64  # the newest releases are not due yet
    clock.advance(1.0)
    m.refresh_blocks()
    assert all(b.priority == 35 for b in retained)


def _radix_nodes_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is RadixNode)


def test_pruned_nodes_are_unreachable():
    """Hot prefixes stay cached while the long tails first stored behind them are evicted."""
    cfg = make_config(primary_blocks=96, max_seq_len=1024)
    m = KVCacheManager(cfg)
    rng = random.Random(1)
    prefixes = [[rng.randrange(10**6) for _ in range(8)] for _ in range(12)]  # 2 blocks each
    base = _radix_nodes_alive()
    n = 0
    for _round in range(6):
        for p in prefixes:
            # the first store behind each prefix builds a long run (40 blocks)...
            m.add_sequence(Request(n, p + [rng.randrange(10**6) for _ in range(160)]))
            m.remove_sequence(n)
            n += 1
            for _ in range(3):  # ...then the prefix stays hot while the tail is evicted
                m.add_sequence(Request(n, p + [rng.randrange(10**6)]))
                m.remove_sequence(n)
                n += 1
    m.verify_integrity()
    alive = _radix_nodes_alive() - base
    assert m.stats().evicted_blocks > 1000
    assert alive <= m._bm.tree.num_nodes + 1, f"{alive} nodes alive for a {m._bm.tree.num_nodes}-node tree"


def test_pruning_clears_the_run_links():
    m = KVCacheManager(make_config(primary_blocks=8))
    m.add_sequence(Request("a", list(range(17))))
    m.remove_sequence("a")  # one run of 5 nodes
    tree = m._bm.tree
    first = next(iter(tree.root.children.values()))
    assert first.next_in_run is not None
    m.add_sequence(Request("b", list(range(100, 132))))  # 8 blocks: evicts the whole run
    m.remove_sequence("b", store_for_reuse=False)
    assert not first.attached and first.next_in_run is None and first.run is None
    for node in tree.iter_nodes():
        assert node.next_in_run is None or node.next_in_run.attached
