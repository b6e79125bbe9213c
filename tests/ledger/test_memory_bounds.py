"""Memory bounded by the pools, not by time or request count.

* The retention-expiry heap deletes lazily; without compaction it gains one stale entry per
  release with a duration (request rate x duration). It must stay within its limit
  (2 x blocks + 16) however long the run, and expiries must still fire.
* The radix tree's node table recycles the ids of pruned nodes: it never holds more ids than
  the most nodes the tree ever had at once, and a freed id keeps nothing alive (its tokens,
  rows and child maps are dropped; `verify_integrity` checks that).
* The token store recycles the rows and pages of requests that leave: it holds what the live
  requests need, however many came before.
(The steady-workload tracemalloc check is in benchmarks/ledger_longrun.py and its test slice.)
"""
from __future__ import annotations

import random

from ledger_helpers import FakeClock, make_config

from kvjax import KVCacheManager, Request, RetentionConfig, TokenRangeRetention


def test_expiry_heap_is_bounded_by_the_pool():
    clock = FakeClock()
    m = KVCacheManager(make_config(primary_blocks=64), clock=clock)
    hour = RetentionConfig((TokenRangeRetention(0, None, 80, 3600.0),), decode_priority=80, decode_duration_s=3600.0)
    rng = random.Random(0)
    peak = 0
    for i in range(4000):
        m.add_sequence(Request(i, [rng.randrange(40) for _ in range(9)], retention=hour))
        m.remove_sequence(i)
        clock.advance(0.01)
        peak = max(peak, m.inspector.expiry_heap()[0])
    assert m.inspector.expiry_heap()[1] == 2 * 64 + 16
    assert peak <= 2 * 64 + 16  # was one entry per release: 12,000 here
    m.verify_integrity()
    # compaction kept every live entry: every retained block still expires, on time
    retained = [b for b in range(64) if m.priority_of_block(b) == 80]
    assert len(retained) == 64 and set(m.inspector.pending_expiries()) == set(retained)
    clock.advance(3599.0)
    assert m.refresh_blocks() < 64  # the newest releases are not due yet
    clock.advance(1.0)
    m.refresh_blocks()
    assert all(m.priority_of_block(b) == 35 for b in retained)


def test_node_table_recycles_pruned_nodes():
    """Hot prefixes stay cached while the long tails first stored behind them are evicted."""
    cfg = make_config(primary_blocks=96, max_seq_len=1024)
    m = KVCacheManager(cfg)
    rng = random.Random(1)
    prefixes = [[rng.randrange(10**6) for _ in range(8)] for _ in range(12)]  # 2 blocks each
    n = 0
    most_nodes = 0
    for _ in range(6):
        for p in prefixes:
            # the first store behind each prefix builds a long run (40 blocks)...
            m.add_sequence(Request(n, p + [rng.randrange(10**6) for _ in range(160)]))
            m.remove_sequence(n)
            n += 1
            most_nodes = max(most_nodes, m.inspector.tree_size().nodes)
            for _ in range(3):  # ...then the prefix stays hot while the tail is evicted
                m.add_sequence(Request(n, p + [rng.randrange(10**6)]))
                m.remove_sequence(n)
                n += 1
                most_nodes = max(most_nodes, m.inspector.tree_size().nodes)
    m.verify_integrity()
    size = m.inspector.tree_size()
    assert m.stats().evicted_blocks > 1000
    assert size.positions <= 96 and size.node_ids <= most_nodes


def test_an_evicted_run_leaves_nothing_behind():
    m = KVCacheManager(make_config(primary_blocks=8))
    m.add_sequence(Request("a", list(range(17))))
    m.remove_sequence("a")  # one run: 4 positions (the newest token has no KV yet), one node
    assert m.inspector.tree_size() == (4, 1, 1)
    m.add_sequence(Request("b", list(range(100, 132))))  # 8 blocks: evicts the whole run
    m.remove_sequence("b", store_for_reuse=False)
    assert m.inspector.tree_size() == (0, 0, 1)  # the node's id is free for reuse
    m.verify_integrity()
    m.add_sequence(Request("c", list(range(200, 209))))
    m.remove_sequence("c")
    assert m.inspector.tree_size() == (2, 1, 1)  # the freed id was reused


def test_decoding_requests_that_store_each_block_grow_one_node_each():
    """The engine stores every completed decode block (`store_new_block` after each token):
    the run grows in place, so a request costs one node for its prompt and its output, not
    one per block; concurrent requests interleaving their stores do not change that."""
    m = KVCacheManager(make_config(primary_blocks=64, max_seq_len=64))
    rng = random.Random(3)
    prompts = {rid: [rng.randrange(1000) for _ in range(9)] for rid in "abc"}
    for rid, prompt in prompts.items():
        m.add_sequence(Request(rid, prompt, max_new_tokens=40))
        m.store_context_blocks(rid)
    for _ in range(40):
        for rid in prompts:
            m.add_token(rid, rng.randrange(1000))
            m.store_new_block(rid)
    m.verify_integrity()
    size = m.inspector.tree_size()
    assert size.positions == 3 * 12 and size.nodes == 3  # 48 tokens each: 12 full blocks stored
    for rid in prompts:
        m.remove_sequence(rid)
    assert m.inspector.tree_size().nodes == 3
    m.verify_integrity()


def test_the_token_store_is_bounded_by_the_live_tokens():
    """Waves of requests grown by batched steps (their tokens in the token store), with
    rewinds, then removed: the store's rows and pages are recycled, so however many waves run
    it never holds more than one wave needs at once (prompts stay in the bytes admission
    encoded; the 60 generated tokens of a row fit in one page, plus a page where the prompt's
    last token opened one), and its page matrix no more than that plus each row's reservation."""
    from kvjax.ledger.decode_batch import SMALL_BATCH
    from kvjax.ledger.token_store import RESERVE_PAGES

    m = KVCacheManager(make_config(tokens_per_block=16, primary_blocks=3000, max_seq_len=600))
    rng = random.Random(1)
    rows = SMALL_BATCH + 6
    for wave in range(30):
        ids = [(wave, i) for i in range(rows)]
        m.add_sequences([Request(r, [rng.randrange(50) for _ in range(rng.randrange(1, 300))], max_new_tokens=200) for r in ids])
        for step in range(60):
            m.add_tokens(ids, [rng.randrange(50) for _ in ids])
            if step % 7 == 0:
                m.rewind(ids[step % len(ids)], 1)
        tok = m._tok
        assert tok.next_row <= rows and tok.next_page <= 2 * rows
        assert len(tok.pages) <= 2 * (2 + RESERVE_PAGES) * rows  # a doubling above the need
        for r in ids:
            m.remove_sequence(r)
        m.verify_integrity()
    assert m._tok.row_of_id == {} and m._tok.reserved == 0 and len(m._tok.free_pages) == m._tok.next_page
