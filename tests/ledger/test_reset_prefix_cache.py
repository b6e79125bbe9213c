"""`KVCacheManager.reset_prefix_cache()`: every unreferenced cached block leaves the tree (one
Removed event each, primary and secondary memory, every window), blocks of live requests stay
cached, nothing leaks, and the emptied blocks are allocated before any still-cached block is
evicted. A seeded random driver interleaves resets with admissions, growth and removal."""
import random

from ledger_helpers import cached_ids, free_order, make_manager

from kvjax import Request
from kvjax.config import MIN_PRIORITY
from kvjax.ledger.events import RemovedData, StoredData


def R(a, b=None):
    return list(range(1, a + 1)) if b is None else list(range(a, b))


def stored_hashes(m, window=None):
    return {b: m.inspector.block_hash(b, window) for b in m.inspector.cached_block_ids(window)}


def removed_hashes(events):
    return [h for e in events if isinstance(e.data, RemovedData) for h in e.data.block_hashes]


def test_reset_drops_unreferenced_blocks_and_keeps_live_ones():
    m = make_manager(primary_blocks=8, secondary_blocks=4, event_buffer_max_size=256)
    m.add_sequence(Request("a", R(10)))  # 3 blocks: 2 full + a partial one
    m.set_context_position("a", 10)
    m.remove_sequence("a")  # stores 2 full blocks and the partial one
    m.add_sequence(Request("live", R(100, 109)))
    m.set_context_position("live", 9)
    m.store_context_blocks("live")  # its 2 full blocks are cached and referenced
    before = stored_hashes(m)
    live_blocks = set(m.block_ids("live")[0])
    assert len(before) == 5 and live_blocks & set(before) == {b for b in m.block_ids("live")[0][:2]}
    free_before = m.num_free_blocks()
    m.flush_iteration_events()
    m.get_latest_events()

    assert m.reset_prefix_cache() == 3
    m.flush_iteration_events()
    events = m.get_latest_events()
    dropped = {bid: h for bid, h in before.items() if bid not in live_blocks}
    assert sorted(removed_hashes(events)) == sorted(dropped.values())
    assert not any(isinstance(e.data, StoredData) for e in events)
    assert cached_ids(m) == set(m.block_ids("live")[0][:2])  # the live request's blocks stay cached
    assert m.num_free_blocks() == free_before  # nothing allocated or freed
    assert m.analyze_prefix_reuse(Request("q", R(10))).total_matched_tokens == 0
    assert m.analyze_prefix_reuse(Request("q", R(100, 109))).total_matched_tokens == 8
    # the emptied blocks are first in line, at the lowest priority, with no retention left
    order = free_order(m)
    assert set(order[: len(dropped)]) == set(dropped)
    for bid in dropped:
        assert m.priority_of_block(bid) == MIN_PRIORITY and m.block(bid).duration is None
    m.verify_integrity()
    m.remove_sequence("live")
    # its two full blocks (the 9th token's KV counts as not written: no partial block is stored)
    assert m.reset_prefix_cache() == 2
    assert cached_ids(m) == set() and m.num_free_blocks() == 8
    m.verify_integrity()
    assert m.reset_prefix_cache() == 0  # idempotent


def test_reset_drops_offloaded_blocks_too():
    m = make_manager(primary_blocks=4, secondary_blocks=4, event_buffer_max_size=256)
    m.add_sequence(Request("a", R(9)))
    m.set_context_position("a", 9)
    m.remove_sequence("a")  # 2 full + 1 partial cached
    m.add_sequence(Request("b", R(100, 116)))  # 4 blocks: the cached ones are offloaded
    m.take_transfers()
    secondary_cached = [b for b in cached_ids(m) if m.block(b).level == 1]
    assert secondary_cached
    m.remove_sequence("b", store_for_reuse=False)
    n = m.reset_prefix_cache()
    assert n == len(secondary_cached)
    assert cached_ids(m) == set()
    assert m.num_free_secondary_blocks() == 4
    assert m.take_transfers().__len__() == 0  # a reset moves no bytes
    m.verify_integrity()


def test_emptied_blocks_are_allocated_before_cached_blocks_are_evicted():
    m = make_manager(primary_blocks=6)
    m.add_sequence(Request("a", R(8)))
    m.set_context_position("a", 8)
    m.remove_sequence("a")  # 2 cached blocks
    assert m.reset_prefix_cache() == 2
    m.add_sequence(Request("b", R(200, 208)))
    m.set_context_position("b", 8)
    m.remove_sequence("b")  # 2 new cached blocks (a full one and 3 tokens of the next)
    m.add_sequence(Request("c", R(300, 316)))  # needs 4: the 4 uncached free blocks, no eviction
    assert m.stats().evicted_blocks == 0
    assert m.analyze_prefix_reuse(Request("q", R(200, 209))).total_matched_tokens == 7
    m.verify_integrity()


def test_reset_with_two_windows():
    m = make_manager(num_layers=2, attention_windows=(64, 8), primary_blocks={8: 6, 64: 8}, event_buffer_max_size=256)
    m.add_sequence(Request("a", R(13)))
    m.set_context_position("a", 13)
    for t in (50, 51, 52, 53):
        m.add_token("a", t)  # the 8-token window detaches its front blocks
    m.remove_sequence("a")
    cached = {w: stored_hashes(m, w) for w in m.windows}
    m.flush_iteration_events()
    m.get_latest_events()
    assert m.reset_prefix_cache() == sum(len(c) for c in cached.values())
    m.flush_iteration_events()
    events = m.get_latest_events()
    for w in m.windows:
        got = [h for e in events if e.window_size == w and isinstance(e.data, RemovedData) for h in e.data.block_hashes]
        assert sorted(got) == sorted(cached[w].values())
        assert cached_ids(m, w) == set()
    m.verify_integrity()


def test_random_operations_with_resets_keep_the_ledger_consistent():
    rng = random.Random(7)
    m = make_manager(primary_blocks=12, secondary_blocks=6, max_seq_len=48, event_buffer_max_size=4096)
    live: dict[str, int] = {}
    dropped_total = kept_total = 0
    prefixes = [R(1 + 20 * k, 1 + 20 * k + 10) for k in range(3)]
    for i in range(400):
        op = rng.random()
        if op < 0.35 and len(live) < 3:
            rid = f"r{i}"
            prompt = rng.choice(prefixes)[: rng.randint(1, 10)] + [rng.randint(100, 120) for _ in range(rng.randint(1, 6))]
            try:
                p = m.add_sequence(Request(rid, prompt, max_new_tokens=8))
            except Exception as e:  # out of blocks: nothing changed
                assert type(e).__name__ == "OutOfBlocksError"
                continue
            m.set_context_position(rid, len(prompt))
            m.store_context_blocks(rid)
            live[rid] = p
        elif op < 0.6 and live:
            rid = rng.choice(sorted(live))
            try:
                m.add_token(rid, rng.randint(100, 120))
                m.store_new_block(rid)
            except Exception as e:
                assert type(e).__name__ in ("OutOfBlocksError", "InvalidRequestError")
                m.remove_sequence(rid)
                del live[rid]
        elif op < 0.85 and live:
            rid = rng.choice(sorted(live))
            m.remove_sequence(rid, store_for_reuse=rng.random() < 0.8)
            del live[rid]
        else:
            referenced = {b for b in cached_ids(m) if m.block(b).ref_count > 0}
            m.flush_iteration_events()
            m.get_latest_events()
            before = stored_hashes(m)
            n = m.reset_prefix_cache()
            m.flush_iteration_events()
            assert n == len(before) - len(referenced)
            assert sorted(removed_hashes(m.get_latest_events())) == sorted(h for b, h in before.items() if b not in referenced)
            assert cached_ids(m) == referenced
            dropped_total += n
            kept_total += len(referenced)
        m.take_transfers()
        m.verify_integrity()
    assert dropped_total > 20 and kept_total > 5  # the driver reset real caches, with live blocks
    assert m.stats().offloaded_blocks > 0
    for rid in list(live):
        m.remove_sequence(rid)
    m.reset_prefix_cache()
    assert cached_ids(m) == set() and m.num_free_blocks() == 12 and m.num_free_secondary_blocks() == 6
    m.verify_integrity()
