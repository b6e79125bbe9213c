"""Scenario tests pinning the ledger's exact behaviour on tiny pools (tokens_per_block 4).

Every number is derived by hand from docs/semantics.md (TensorRT-LLM's rules) and kvjax's design decisions:
fresh blocks come in ascending id order, never-used before released; release goes to the back
of the block's priority queue, last block of a sequence first; rewind releases to the front; a
cached block is one attached to the radix tree; the eviction victim is the front of the lowest
non-empty priority queue and only it leaves the tree.
"""
import numpy as np
import pytest
from ledger_helpers import (
    FakeClock,
    cached_ids,
    cached_tokens,
    free_order,
    free_queue,
    make_manager,
    plan_ops,
)

from kvjax import (
    InvalidRequestError,
    MultimodalItem,
    Request,
    RetentionConfig,
    TokenRangeRetention,
    TransferKind,
)
from kvjax.ledger import PLACEHOLDER_BLOCK_ID, CreatedData, RemovedData, StoredBlock, StoredData, UpdatedData
from kvjax.ledger.block_hashing import sha256_block_hash as block_hash
from kvjax.ledger.block_key import BlockKey, cache_salt_id
from kvjax.offsets import kvcache_index_offsets

PH = PLACEHOLDER_BLOCK_ID
R = range


def toks(*parts):
    out = []
    for p in parts:
        out.extend(p if not isinstance(p, int) else [p])
    return out


def stored_chain(m, prompt_len, max_new=0, rid="seed", **kw):
    """Admit a request with tokens 0..prompt_len-1 and remove it (storing it for reuse)."""
    m.add_sequence(Request(rid, list(R(prompt_len)), max_new_tokens=max_new, **kw))
    m.remove_sequence(rid)


# =========================================================================== basic life cycle
def test_basic_add_grow_remove():
    m = make_manager()
    assert m.add_sequence(Request("a", list(R(10)), max_new_tokens=6)) == 0  # empty cache
    assert m.block_ids("a") == [[0, 1, 2]]  # ceil(10/4) blocks, ascending ids
    assert (m.num_free_blocks(), m.num_allocated_blocks()) == (5, 3)
    m.add_token("a", 10)
    m.add_token("a", 11)  # positions 10, 11 still fit block 2
    assert m.block_ids("a") == [[0, 1, 2]] and m.num_free_blocks() == 5
    m.add_token("a", 12)  # position 12 starts block 3
    assert m.block_ids("a") == [[0, 1, 2, 3]] and m.num_free_blocks() == 4
    np.testing.assert_array_equal(m.block_table(["a"]), [[0, 1, 2, 3]])
    m.verify_integrity()
    m.remove_sequence("a")
    # remove stores num_tokens - 1 = 12 tokens: three full blocks; block 3 holds no usable token
    assert cached_ids(m) == {0, 1, 2}
    assert cached_tokens(m, 2) == tuple(R(12))
    # never-used blocks first, then released ones, last block of the sequence first
    assert free_order(m) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert m.num_free_blocks() == 8 and m.num_allocated_blocks() == 0
    assert len(m.take_transfers()) == 0
    m.verify_integrity()


def test_fresh_blocks_never_used_before_released():
    m = make_manager()
    m.add_sequence(Request("a", list(R(8))))
    m.remove_sequence("a", store_for_reuse=False)
    assert free_order(m) == [2, 3, 4, 5, 6, 7, 1, 0]
    m.add_sequence(Request("b", list(R(100, 120))))  # 5 blocks
    assert m.block_ids("b") == [[2, 3, 4, 5, 6]]
    m.add_sequence(Request("c", list(R(200, 208))))
    assert m.block_ids("c") == [[7, 1]]  # then the released ones, in release order


# =========================================================================== reuse
def test_reuse_of_a_stored_prefix():
    m = make_manager()
    stored_chain(m, 13)  # stores 12 tokens: blocks 0, 1, 2 full
    # same 13-token prompt: usable = 12 -> keys [0..3], [4..7], [8..11] + an empty trailing key
    assert m.add_sequence(Request("b", list(R(13)))) == 12
    # the empty trailing key keeps ceil(13/4) = 4 positions; it is a miss: the next fresh block
    assert m.block_ids("b") == [[0, 1, 2, 4]]
    s = m.request_stats("b")
    assert (s.reused_blocks, s.missed_blocks, s.alloc_total_blocks, s.alloc_new_blocks) == (3, 1, 1, 1)
    assert s.cache_hit_rate == pytest.approx(3 / 4) and s.prepopulated_tokens == 12
    assert len(m.take_transfers()) == 0  # full matches in primary memory move no data


def test_last_prompt_token_never_reused():
    m = make_manager()
    stored_chain(m, 13)
    # 12-token prompt identical to the cached 12 tokens: usable = 11, so block 2 matches only
    # 3 tokens; it is a free leaf, reused in place (partial match, docs/semantics.md)
    assert m.add_sequence(Request("b", list(R(12)))) == 11
    assert m.block_ids("b") == [[0, 1, 2]]
    assert 2 not in cached_ids(m)  # in-place partial reuse detaches the block from the tree
    assert cached_ids(m) == {0, 1}
    assert len(m.take_transfers()) == 0
    s = m.request_stats("b")
    assert (s.reused_blocks, s.missed_blocks) == (3, 0)


def test_prompt_of_one_block_plus_one_token():
    # prompt_len % tpb == 1: 5 tokens -> usable 4 -> one full key + the empty trailing key
    m = make_manager()
    stored_chain(m, 5)  # stores 4 tokens: block 0
    assert cached_ids(m) == {0}
    assert m.add_sequence(Request("b", list(R(5)))) == 4
    assert m.block_ids("b") == [[0, 2]]  # free order was [2..7, 1, 0]; block 0 held by the match
    assert m.request_stats("b").missed_blocks == 1


def test_single_token_prompt_reuses_nothing():
    m = make_manager()
    stored_chain(m, 5)
    assert m.add_sequence(Request("b", [0])) == 0  # usable 0
    assert m.block_ids("b") == [[2]]


def test_partial_reuse_copies_a_referenced_block():
    m = make_manager()
    m.add_sequence(Request("a", list(R(13))))
    m.store_context_blocks("a")  # stores min(13 - 1, 13) = 12 tokens: blocks 0, 1, 2
    assert cached_ids(m) == {0, 1, 2}
    # b diverges inside block 2 after 2 tokens: blocks 0, 1 full, block 2 partial (2 tokens)
    b = Request("b", toks(R(10), 99, 98))
    assert m.add_sequence(b) == 10
    # block 2 is referenced by a: copied into a fresh block (the next never-used: 4)
    assert m.block_ids("b") == [[0, 1, 4]]
    assert plan_ops(m) == [("COPY", 0, 2, 4, 2)]  # slots == ids here: nothing was offloaded
    assert cached_ids(m) == {0, 1, 2}  # the source stays cached; the copy is private
    s = m.request_stats("b")
    assert (s.reused_blocks, s.missed_blocks, s.alloc_total_blocks, s.alloc_new_blocks) == (3, 0, 1, 1)
    assert (m.num_free_blocks(), m.num_allocated_blocks()) == (3, 5)


def test_partial_reuse_copies_a_free_non_leaf():
    m = make_manager()
    stored_chain(m, 13)  # chain 0 -> 1 -> 2, all free
    # b matches block 0 fully and 2 tokens of block 1, which has a cached child (block 2)
    assert m.add_sequence(Request("b", toks(R(6), 70, 71, 72))) == 6
    assert m.block_ids("b") == [[0, 4, 5]]  # copy target 4, then the third block 5
    assert plan_ops(m) == [("COPY", 0, 1, 4, 2)]
    assert cached_ids(m) == {0, 1, 2}
    # the copy source went back to the free queue: only b's blocks are allocated
    assert m.num_allocated_blocks() == 3


def test_partial_reuse_in_place_on_a_free_leaf():
    m = make_manager()
    stored_chain(m, 13)
    assert m.add_sequence(Request("b", toks(R(10), 99, 98))) == 10
    assert m.block_ids("b") == [[0, 1, 2]]  # block 2: free leaf -> reused in place
    assert len(m.take_transfers()) == 0
    assert cached_ids(m) == {0, 1}


def test_copy_on_partial_reuse_false_turns_referenced_partials_into_misses():
    m = make_manager(copy_on_partial_reuse=False)
    m.add_sequence(Request("a", list(R(13))))
    m.store_context_blocks("a")
    assert m.add_sequence(Request("b", toks(R(10), 99, 98))) == 8  # block 2 (referenced) skipped
    assert m.block_ids("b") == [[0, 1, 4]]
    assert len(m.take_transfers()) == 0
    s = m.request_stats("b")
    assert (s.reused_blocks, s.missed_blocks) == (2, 1)


def test_copy_on_partial_reuse_false_still_copies_free_non_leaf_and_reuses_free_leaf():
    m = make_manager(copy_on_partial_reuse=False)
    stored_chain(m, 13)
    assert m.add_sequence(Request("b", toks(R(6), 70, 71, 72))) == 6  # block 1: free, not a leaf
    assert plan_ops(m) == [("COPY", 0, 1, 4, 2)]
    assert m.add_sequence(Request("c", toks(R(9), 99))) == 9  # block 2: free leaf -> in place
    assert m.block_ids("c") == [[0, 1, 2]]
    assert len(m.take_transfers()) == 0


def test_enable_partial_reuse_false():
    m = make_manager(enable_partial_reuse=False)
    stored_chain(m, 13)
    assert m.add_sequence(Request("b", toks(R(10), 99, 98))) == 8  # only full blocks
    assert m.block_ids("b") == [[0, 1, 4]]
    assert cached_ids(m) == {0, 1, 2}
    # the 12-token prompt's usable 11 tokens cover block 2 only partially: a miss as well
    assert m.add_sequence(Request("c", list(R(12)))) == 8
    assert m.block_ids("c") == [[0, 1, 5]]
    assert len(m.take_transfers()) == 0


def test_reuse_disabled():
    m = make_manager(enable_block_reuse=False)
    stored_chain(m, 13)
    assert cached_ids(m) == set()
    assert m.add_sequence(Request("b", list(R(13)))) == 0
    assert m.block_ids("b") == [[4, 5, 6, 7]]
    m.store_context_blocks("b")
    m.store_new_block("b")
    assert m.store_blocks_for_reuse("b") == [4, 5, 6, 7]
    assert cached_ids(m) == set()
    st = m.stats()
    assert (st.reused_blocks, st.missed_blocks, st.cache_hit_rate) == (0, 0, 0.0)
    s = m.analyze_prefix_reuse(Request("x", list(R(13))))
    assert (s.reusable_blocks_all, s.total_matched_tokens) == (0, 0)


# =========================================================================== batch admission
def test_batch_two_partial_claimers_last_in_place_earlier_copies():
    m = make_manager()
    stored_chain(m, 13)  # chain 0 -> 1 -> 2 (block 2 = tokens 8..11), free
    b = Request("b", list(R(10)))  # usable 9: block 2 partially, 1 token
    c = Request("c", list(R(11)))  # usable 10: block 2 partially, 2 tokens
    assert m.add_sequences([b, c]) == [9, 10]
    assert m.block_ids("b") == [[0, 1, 4]]  # earlier claimer copies (fresh block 4)
    assert m.block_ids("c") == [[0, 1, 2]]  # last partial claimer of the free leaf: in place
    assert plan_ops(m) == [("COPY", 0, 2, 4, 1)]
    assert cached_ids(m) == {0, 1}
    m.verify_integrity()


def test_single_adds_in_sequence_differ_from_batch():
    # without batching, the first request takes the free leaf in place and the second misses it
    m = make_manager()
    stored_chain(m, 13)
    assert m.add_sequence(Request("b", list(R(10)))) == 9
    assert m.add_sequence(Request("c", list(R(11)))) == 8  # block 2 left the tree
    assert m.block_ids("b") == [[0, 1, 2]] and m.block_ids("c") == [[0, 1, 4]]


def test_batch_full_match_beats_partial_claim():
    m = make_manager()
    stored_chain(m, 13)
    b = Request("b", list(R(10)))  # partial on block 2
    c = Request("c", list(R(14)))  # usable 13: full match of block 2, then a miss for [12, 13]
    assert m.add_sequences([b, c]) == [9, 12]
    assert m.block_ids("b") == [[0, 1, 4]]  # block 2 fully matched by c: b copies
    assert m.block_ids("c") == [[0, 1, 2, 5]]
    assert plan_ops(m) == [("COPY", 0, 2, 4, 1)]
    assert cached_ids(m) == {0, 1, 2}


def test_empty_batch():
    m = make_manager()
    before = m.snapshot()
    assert m.add_sequences([]) == []
    assert m.snapshot() == before


def test_batch_shares_blocks_stored_by_nobody_yet():
    # two identical new prompts in one batch: nothing cached, both allocate their own blocks
    m = make_manager()
    assert m.add_sequences([Request("b", list(R(6))), Request("c", list(R(6)))]) == [0, 0]
    assert m.block_ids("b") == [[0, 1]] and m.block_ids("c") == [[2, 3]]


# =========================================================================== eviction and retention
def retention(*ranges, decode_priority=35, decode_duration_s=None):
    return RetentionConfig(tuple(TokenRangeRetention(*r) for r in ranges), decode_priority, decode_duration_s)


def test_true_priority_eviction_children_stay_cached():
    m = make_manager()
    # block 0 (first token 0) at priority 10, blocks 1.. at 80
    stored_chain(m, 13, retention=retention((0, 4, 10), (4, None, 80)))
    assert [m.priority_of_block(i) for i in R(4)] == [10, 80, 80, 80]
    assert free_queue(m, 10) == [0] and free_queue(m, 80) == [3, 2, 1]
    assert free_order(m) == [0, 4, 5, 6, 7, 3, 2, 1]  # lowest queue first, LRU inside
    m.add_sequence(Request("x", list(R(100, 104))))  # one block: the victim is block 0
    assert m.block_ids("x") == [[0]]
    assert m.request_stats("x").alloc_new_blocks == 0  # the victim held cached tokens
    assert cached_ids(m) == {1, 2}  # only the victim left the tree; its children stay cached
    assert m.stats().evicted_blocks == 1
    # ... but they are unreachable through a broken chain: no reuse without block 0
    assert m.add_sequence(Request("y", list(R(13)))) == 0
    assert m.block_ids("y") == [[4, 5, 6, 7]]
    assert cached_ids(m) == {1, 2}
    m.verify_integrity()


def test_eviction_order_lowest_priority_then_lru():
    m = make_manager(primary_blocks=6)
    m.add_sequence(Request("a", list(R(9)), retention=retention((0, None, 50))))  # blocks 0, 1, 2
    m.add_sequence(Request("b", list(R(100, 109)), retention=retention((0, None, 20))))  # 3, 4, 5
    m.remove_sequence("a")  # stores 8 tokens: 0, 1 (block 2 has no usable token)
    m.remove_sequence("b")  # stores 3, 4
    assert free_order(m) == [5, 4, 3, 2, 1, 0]  # queue 20: 5, 4, 3; queue 50: 2, 1, 0
    m.add_sequence(Request("c", list(R(200, 216))))  # 4 blocks
    assert m.block_ids("c") == [[5, 4, 3, 2]]
    assert cached_ids(m) == {0, 1}


def test_retention_ranges_and_decode_priority():
    m = make_manager()
    r = retention((0, 8, 90), (8, None, 20), decode_priority=60)
    m.add_sequence(Request("a", list(R(10)), max_new_tokens=8, retention=r))
    for t in R(10, 13):
        m.add_token("a", t)  # position 12 starts block 3: a decode block
    assert m.block_ids("a") == [[0, 1, 2, 3]]
    # a block takes the priority of the range holding its first token (0, 4 -> 90; 8 -> 20);
    # block 3 starts at 12 >= prompt_len: decode priority
    assert [m.priority_of_block(i) for i in R(4)] == [90, 90, 20, 60]
    m.remove_sequence("a")
    assert free_queue(m, 20) == [2] and free_queue(m, 60) == [3] and free_queue(m, 90) == [1, 0]
    assert free_order(m) == [2, 4, 5, 6, 7, 3, 1, 0]


def test_range_not_starting_on_a_block_boundary():
    m = make_manager()
    # range [2, 6): block 0 starts at 0 (outside), block 1 starts at 4 (inside)
    m.add_sequence(Request("a", list(R(12)), retention=retention((2, 6, 70))))
    assert [m.priority_of_block(i) for i in R(3)] == [35, 70, 35]


def test_request_without_retention_keeps_cached_priority():
    m = make_manager(event_buffer_max_size=64)
    stored_chain(m, 9, retention=retention((0, None, 80)))
    m.flush_iteration_events()
    m.get_latest_events()
    m.add_sequence(Request("b", list(R(9))))  # no retention stated
    assert [m.priority_of_block(i) for i in (0, 1)] == [80, 80]
    m.remove_sequence("b")
    assert free_queue(m, 80) == [2, 1, 0]  # block 2 (uncached, priority 80) was never touched by b
    # a request that does state a priority re-prioritises the matched blocks (Updated events)
    m.add_sequence(Request("c", list(R(9)), retention=retention((0, None, 50))))
    assert [m.priority_of_block(i) for i in (0, 1)] == [50, 50]
    m.flush_iteration_events()
    updates = [e.data for e in m.get_latest_events() if isinstance(e.data, UpdatedData)]
    h0 = block_hash(BlockKey((0, 1, 2, 3)))
    h1 = block_hash(BlockKey((4, 5, 6, 7)), h0)
    assert updates == [UpdatedData(h0, None, (80, 50)), UpdatedData(h1, None, (80, 50))]


def test_durations_expire_via_refresh_with_fake_clock():
    clock = FakeClock(1000.0)
    m = make_manager(clock=clock)
    m.add_sequence(Request("a", list(R(9)), retention=retention((0, None, 80, 10.0))))
    clock.advance(50)  # in use: a duration runs from release, not from allocation
    m.remove_sequence("a")  # released at t=1050
    assert [m.priority_of_block(i) for i in R(3)] == [80, 80, 80]
    clock.advance(9.5)
    assert m.refresh_blocks() == 0
    assert free_queue(m, 80) == [2, 1, 0]
    clock.advance(0.5)  # t = 1060: expired
    assert m.refresh_blocks() == 3
    assert [m.priority_of_block(i) for i in R(3)] == [35, 35, 35]
    # moved to the back of the default queue, in expiry order (equal expiries: release order)
    assert free_order(m) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert m.refresh_blocks() == 0


def test_decode_duration_expires():
    clock = FakeClock()
    m = make_manager(clock=clock)
    r = retention((0, None, 35), decode_priority=90, decode_duration_s=5.0)
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=4, retention=r))
    m.add_token("a", 4)  # block 1: decode block
    m.remove_sequence("a", store_for_reuse=False)
    assert m.priority_of_block(1) == 90 and m.priority_of_block(0) == 35
    clock.advance(5)
    assert m.refresh_blocks() == 1 and m.priority_of_block(1) == 35


def test_reclaimed_block_duration_is_overwritten():
    # TRT claimBlock always overwrites the duration: a request reusing the block without a
    # duration cancels the expiry of the cached block
    clock = FakeClock()
    m = make_manager(clock=clock)
    stored_chain(m, 9, retention=retention((0, None, 80, 10.0)))
    m.add_sequence(Request("b", list(R(9))))
    m.remove_sequence("b", store_for_reuse=False)
    clock.advance(100)
    assert m.refresh_blocks() == 1  # only block 2 (not reused by b) still had its duration
    assert [m.priority_of_block(i) for i in (0, 1, 2)] == [80, 80, 35]


# =========================================================================== offload / onboard
def test_offload_to_secondary_and_onboard_on_hit():
    m = make_manager(primary_blocks=4, secondary_blocks=2, event_buffer_max_size=64)
    stored_chain(m, 9)  # blocks 0, 1 cached (8 tokens), block 2 uncached
    assert free_order(m) == [3, 2, 1, 0] and free_order(m, level=1) == [4, 5]
    m.take_transfers()
    m.add_sequence(Request("b", list(R(100, 116))))  # 4 blocks
    # 3, 2: uncached. 1: cached, priority 35 >= 30 -> offloaded into the free secondary block 4
    # (secondary slot 0); block 4 object takes over primary slot 1. Then 0 -> block 5.
    assert m.block_ids("b") == [[3, 2, 4, 5]]
    np.testing.assert_array_equal(m.block_table(["b"]), [[3, 2, 1, 0]])  # slots, not ids
    assert plan_ops(m) == [("OFFLOAD", 0, 1, 0, 4), ("OFFLOAD", 0, 0, 1, 4)]
    assert m.block(1).level == 1 and m.block(1).slot == 0
    assert m.block(0).level == 1 and m.block(0).slot == 1
    assert m.block(4).level == 0 and m.block(4).slot == 1
    assert cached_ids(m) == {0, 1}  # still in the tree, now in secondary memory
    # the offloaded blocks are cached and unreferenced: they count as free secondary blocks
    assert m.num_free_blocks() == 0 and m.num_free_secondary_blocks() == 2
    assert free_order(m, level=1) == [1, 0]
    it = m.iteration_stats()
    # since construction: seed 3 fresh blocks, b 4 allocations of which 2 (blocks 3, 2) were new
    assert (it.offloaded_blocks, it.alloc_total_blocks, it.alloc_new_blocks) == (2, 7, 5)
    m.remove_sequence("b", store_for_reuse=False)
    assert free_order(m) == [5, 4, 2, 3]
    # a hit on the offloaded chain onboards both blocks (each swaps slots with a fresh block)
    assert m.add_sequence(Request("c", list(R(9)))) == 8
    assert m.block_ids("c") == [[0, 1, 2]]
    np.testing.assert_array_equal(m.block_table(["c"]), [[0, 1, 2]])
    # onboard 0: target = victim 5 (primary slot 0); onboard 1: target 4 (primary slot 1)
    assert plan_ops(m) == [("ONBOARD", 0, 1, 0, 4), ("ONBOARD", 0, 0, 1, 4)]
    assert (m.block(5).level, m.block(5).slot, m.block(4).level, m.block(4).slot) == (1, 1, 1, 0)
    assert free_order(m, level=1) == [5, 4]
    s = m.request_stats("c")
    assert (s.reused_blocks, s.missed_blocks) == (2, 1)
    assert m.iteration_stats().onboarded_blocks == 2
    m.flush_iteration_events()
    levels = [e.data.cache_level for e in m.get_latest_events() if isinstance(e.data, UpdatedData)]
    assert levels == [(0, 1), (0, 1), (1, 0), (1, 0)]
    m.verify_integrity()


def test_offload_min_priority_drops_instead():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    stored_chain(m, 9, retention=retention((0, 4, 30), (4, None, 29)))  # block 0: 30, block 1: 29
    m.add_sequence(Request("b", list(R(100, 116))))
    # queue 29 first: [2, 1] (block 2 took priority 29 too), then queue 30: [0], queue 35: [3]
    assert m.block_ids("b") == [[2, 1, 4, 3]]
    # block 1 (29 < 30) dropped; block 0 (30 >= 30) offloaded into block 4's secondary slot
    assert plan_ops(m) == [("OFFLOAD", 0, 0, 0, 4)]
    assert cached_ids(m) == {0} and m.block(0).level == 1
    assert free_order(m, level=1) == [0, 5]  # block 0 keeps priority 30 in the secondary queues


def test_secondary_victim_is_evicted_when_secondary_is_full():
    m = make_manager(primary_blocks=4, secondary_blocks=1, event_buffer_max_size=64)
    stored_chain(m, 9)
    m.flush_iteration_events()
    m.get_latest_events()
    m.add_sequence(Request("b", list(R(100, 116))))
    # block 1 offloaded into block 4's slot; then block 0 is offloaded too: the only free
    # secondary block is now block 1 itself (cached) -> it leaves the tree, its slot takes 0
    assert m.block_ids("b") == [[3, 2, 4, 1]]
    assert plan_ops(m) == [("OFFLOAD", 0, 1, 0, 4), ("OFFLOAD", 0, 0, 0, 4)]
    assert cached_ids(m) == {0} and m.block(0).level == 1
    m.flush_iteration_events()
    h0 = block_hash(BlockKey((0, 1, 2, 3)))
    h1 = block_hash(BlockKey((4, 5, 6, 7)), h0)
    ev = [e.data for e in m.get_latest_events()]
    assert ev == [UpdatedData(h1, (0, 1), None), UpdatedData(h0, (0, 1), None), RemovedData((h1,))]


def test_no_offload_without_onboarding():
    m = make_manager(primary_blocks=4, secondary_blocks=2, onboard_blocks=False)
    stored_chain(m, 9)
    m.add_sequence(Request("b", list(R(100, 116))))
    assert m.block_ids("b") == [[3, 2, 1, 0]]
    assert len(m.take_transfers()) == 0 and cached_ids(m) == set()


def test_partial_match_on_secondary_block():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    m.add_sequence(Request("a", list(R(12))))
    m.remove_sequence("a")  # stores 11 tokens: blocks 0, 1 full; block 2 partial [8, 9, 10]
    assert cached_ids(m) == {0, 1, 2}
    m.add_sequence(Request("b", list(R(100, 116))))
    # victims in order: 3 (new), 2 -> block 4, 1 -> block 5, 0: secondary full; the spare is
    # block 2 (cached, LRU of secondary) -> dropped; block 0 offloaded into its slot
    assert m.block_ids("b") == [[3, 4, 5, 2]]
    assert cached_ids(m) == {0, 1}
    m.remove_sequence("b", store_for_reuse=False)
    m.take_transfers()
    # c matches block 0 fully (secondary: onboard) and block 1 partially (secondary, free,
    # not a leaf? block 2 left the tree, so block 1 is a leaf): in place, onboarded
    assert m.add_sequence(Request("c", toks(R(6), 50, 51, 52))) == 6
    # primary free order was [2, 5, 4, 3]: onboard targets 2 (slot 0) and 5 (slot 1), fresh 4
    assert m.block_ids("c") == [[0, 1, 4]]
    # in place: the whole block comes back (num_tokens == tpb)
    assert plan_ops(m) == [("ONBOARD", 0, 0, 0, 4), ("ONBOARD", 0, 1, 1, 4)]
    assert cached_ids(m) == {0}
    m.verify_integrity()


def _secondary_parent_with_primary_child():
    """X (block 3, tokens 0..3) offloaded to secondary; Y (block 1, tokens 4..7, priority 10)
    stored under X afterwards, free, at the front of the primary free queues."""
    m = make_manager(primary_blocks=6, secondary_blocks=2)
    m.add_sequence(Request("d", list(R(9)), retention=retention((4, 8, 10))))  # blocks 0, 1, 2
    stored_chain(m, 5, rid="a")  # blocks 3, 4: X = block 3 cached
    m.add_sequence(Request("e", list(R(200, 212))))  # victims 5, 4, then X: offloaded (block 6)
    assert m.block_ids("e") == [[5, 4, 6]]
    m.remove_sequence("d")  # position 0 is a duplicate of X; Y = d's block 1 stored under X
    assert cached_ids(m) == {1, 3} and m.block(3).level == 1 and m.block(1).level == 0
    assert free_order(m) == [1, 2, 0]
    m.take_transfers()
    return m


def test_onboard_target_never_evicts_a_later_match_of_the_same_request():
    m = _secondary_parent_with_primary_child()
    # c matches X (secondary: onboard) and Y (free primary, front of the queues). The onboard
    # target must not be Y: Y is held for c, so the target is block 2 (slot 2).
    assert m.add_sequence(Request("c", list(R(9)))) == 8
    assert m.block_ids("c") == [[3, 1, 0]]
    assert m.block_table(["c"]).tolist() == [[2, 1, 0]]
    assert plan_ops(m) == [("ONBOARD", 0, 0, 2, 4)]
    assert cached_ids(m) == {1, 3}
    m.verify_integrity()


def test_onboard_target_never_evicts_the_partial_match_of_the_same_request():
    m = _secondary_parent_with_primary_child()
    # Y partially matched (2 tokens), a free leaf: reused in place, after X is onboarded into
    # block 2's slot
    assert m.add_sequence(Request("c", toks(R(6), 50, 51, 52))) == 6
    assert m.block_ids("c") == [[3, 1, 0]]
    assert m.block_table(["c"]).tolist() == [[2, 1, 0]]
    assert plan_ops(m) == [("ONBOARD", 0, 0, 2, 4)]
    assert cached_ids(m) == {3}
    m.verify_integrity()


def test_partial_copy_from_a_secondary_block_is_a_partial_onboard():
    m = make_manager(primary_blocks=4, secondary_blocks=4)
    stored_chain(m, 13)  # chain 0 -> 1 -> 2 cached, block 3 not
    m.add_sequence(Request("x", list(R(100, 116))))
    # victims 3 (new), then 2, 1, 0 offloaded into secondary blocks 4, 5, 6 (slots 0, 1, 2)
    assert m.block_ids("x") == [[3, 4, 5, 6]]
    assert [(m.block(i).level, m.block(i).slot) for i in (0, 1, 2)] == [(1, 2), (1, 1), (1, 0)]
    m.remove_sequence("x", store_for_reuse=False)  # primary free: 6 (slot 0), 5 (1), 4 (2), 3 (3)
    m.take_transfers()
    # c: block 0 fully (onboard into block 6's slot 0), block 1 partially (2 tokens); block 1 is
    # not a leaf (block 2 hangs below it): copied straight from secondary memory into block 5
    assert m.add_sequence(Request("c", toks(R(6), 90, 91))) == 6
    assert m.block_ids("c") == [[0, 5]]
    assert m.block_table(["c"]).tolist() == [[0, 1]]
    assert plan_ops(m) == [("ONBOARD", 0, 2, 0, 4), ("ONBOARD", 0, 1, 1, 2)]
    assert cached_ids(m) == {0, 1, 2} and (m.block(1).level, m.block(2).level) == (1, 1)
    it = m.iteration_stats()
    assert (it.onboarded_blocks, it.copied_blocks) == (1, 1)
    m.verify_integrity()


def test_multi_pool_window_one_plan_entry_per_pool():
    # 3 layers, kv heads (1, 2, 1): two pools in the single window
    m = make_manager(num_layers=3, num_kv_heads=(1, 2, 1), primary_blocks=4, secondary_blocks=2)
    assert len(m.config.pools) == 2
    stored_chain(m, 9)
    m.take_transfers()
    m.add_sequence(Request("b", list(R(100, 116))))
    assert plan_ops(m) == [
        ("OFFLOAD", 0, 1, 0, 4),
        ("OFFLOAD", 1, 1, 0, 4),
        ("OFFLOAD", 0, 0, 1, 4),
        ("OFFLOAD", 1, 0, 1, 4),
    ]
    it = m.iteration_stats()
    # offload bytes per block: sum over pools of layers * kv_factor * heads * head_dim * tpb * 2 bytes
    block_bytes = (2 * 2 * 1 * 8 * 4 * 2) + (1 * 2 * 2 * 8 * 4 * 2)
    assert it.offloaded_blocks == 2 and it.offload_bytes == 2 * block_bytes


def test_fp8_transfer_bytes_count_the_block_scales():
    # the multi-pool geometry in float8: 1 byte per value, plus one float32 scale per
    # (layer, K/V, kv head) of each block (heads 1, 2, 1: 2 * (1 + 2 + 1) * 4 bytes)
    m = make_manager(num_layers=3, num_kv_heads=(1, 2, 1), primary_blocks=4, secondary_blocks=2, dtype="float8_e4m3fn")
    stored_chain(m, 9)
    m.take_transfers()
    m.add_sequence(Request("b", list(R(100, 116))))
    block_bytes = (2 * 2 * 1 * 8 * 4) + (1 * 2 * 2 * 8 * 4) + 2 * (1 + 2 + 1) * 4
    it = m.iteration_stats()
    assert it.offloaded_blocks == 2 and it.offload_bytes == 2 * block_bytes
    m.verify_integrity()


def test_transfer_plan_arrays():
    m = make_manager()
    m.add_sequence(Request("a", list(R(13))))
    m.store_context_blocks("a")
    m.add_sequence(Request("b", toks(R(10), 99, 98)))
    plan = m.take_transfers()
    for name in ("kind", "pool", "src", "dst", "num_tokens"):
        arr = getattr(plan, name)
        assert arr.dtype == np.int32 and arr.shape == (1,)
    assert plan.kind[0] == TransferKind.COPY and plan.num_tokens[0] == 2
    assert len(m.take_transfers()) == 0  # drained


# =========================================================================== isolation
def test_lora_isolation():
    m = make_manager(primary_blocks=16)
    stored_chain(m, 9, lora_task_id=1)
    assert m.add_sequence(Request("b", list(R(9)), lora_task_id=2)) == 0
    assert m.add_sequence(Request("c", list(R(9)))) == 0
    assert m.add_sequence(Request("d", list(R(9)), lora_task_id=1)) == 8
    assert m.block_ids("d")[0][:2] == [0, 1]


def test_cache_salt_isolation():
    m = make_manager(primary_blocks=16)
    stored_chain(m, 9, cache_salt="tenant-a")
    assert m.add_sequence(Request("b", list(R(9)), cache_salt="tenant-b")) == 0
    assert m.add_sequence(Request("c", list(R(9)))) == 0
    assert m.add_sequence(Request("d", list(R(9)), cache_salt="tenant-a")) == 8
    stored_chain(m, 9, rid="int-salt", cache_salt=5)
    assert m.add_sequence(Request("e", list(R(9)), cache_salt="5")) == 0  # str "5" is not int 5
    assert m.add_sequence(Request("f", list(R(9)), cache_salt=5)) == 8


def test_extra_id_isolation():
    m = make_manager(primary_blocks=16)
    stored_chain(m, 9, extra_ids=[0] * 9)
    assert m.add_sequence(Request("b", list(R(9)))) == 0  # extra-id usage differs
    assert m.add_sequence(Request("c", list(R(9)), extra_ids=[0] * 9)) == 8
    # extra id differs at position 5: block 0 full, block 1 matches 1 token (its first)
    m.remove_sequence("c")
    ex = [0] * 9
    ex[5] = 3
    assert m.add_sequence(Request("d", list(R(9)), extra_ids=ex)) == 5


def test_generated_tokens_carry_extra_id_zero():
    m = make_manager()
    m.add_sequence(Request("a", list(R(8)), extra_ids=[7] * 8, max_new_tokens=4))
    for t in R(8, 12):
        m.add_token("a", t)
    m.remove_sequence("a")  # stores 11 tokens: block 2 partial [8, 9, 10] with extra ids 0
    assert m.block(2).key == BlockKey((8, 9, 10), (0, 0, 0))
    assert m.block(1).key == BlockKey((4, 5, 6, 7), (7, 7, 7, 7))
    assert m.add_sequence(Request("b", list(R(12)), extra_ids=[7] * 8 + [0] * 4)) == 11


def test_multimodal_isolation_and_no_partial_match():
    h1, h2 = b"\x11" * 32, b"\x22" * 32
    m = make_manager(primary_blocks=16)
    stored_chain(m, 12, mm_items=(MultimodalItem(h1, 5, 2),))  # item at [5, 7): inside block 1
    assert m.block(0).key.mm_keys == ()  # block 0 does not overlap the item
    assert m.block(1).key.mm_keys == ((h1, 0),)
    # another image at the same place: block 0 reusable, block 1 not (and no partial match)
    assert m.add_sequence(Request("b", list(R(12)), mm_items=(MultimodalItem(h2, 5, 2),))) == 4
    # the same image: full reuse, then block 2 (no mm key, stored partially) matched partially
    assert m.add_sequence(Request("c", list(R(12)), mm_items=(MultimodalItem(h1, 5, 2),))) == 11
    m.remove_sequence("b")
    m.remove_sequence("c")
    # a token changed inside block 1 (same image): keys with mm extra keys never partially match
    p = list(R(12))
    p[6] = 99
    assert m.add_sequence(Request("d", p, mm_items=(MultimodalItem(h1, 5, 2),))) == 4
    # without multimodal items the same divergence is a partial match of 2 tokens
    stored_chain(m, 12, rid="plain")
    assert m.add_sequence(Request("e", p)) == 6


def test_multimodal_start_offset_of_an_item_spanning_blocks():
    h = b"\x33" * 32
    m = make_manager()
    stored_chain(m, 13, mm_items=(MultimodalItem(h, 6, 4),))  # [6, 10)
    assert m.block(1).key.mm_keys == ((h, 0),)
    assert m.block(2).key.mm_keys == ((h, 2),)  # first overlapping item token is its 3rd (8 - 6)


# =========================================================================== beam search
def test_beam_search_blocks():
    m = make_manager(max_beam_width=2)
    assert m.add_sequence(Request("a", list(R(10)), max_new_tokens=8, beam_width=2)) == 0
    # 2 shared context blocks, the non-full last context block once per beam
    assert m.block_ids("a") == [[0, 1, 2], [0, 1, 3]]
    assert m.num_free_blocks() == 4
    s = m.request_stats("a")
    assert (s.missed_blocks, s.alloc_total_blocks) == (3, 4)  # per-beam last block counted once
    np.testing.assert_array_equal(m.block_table(["a"]), [[0, 1, 2], [0, 1, 3]])
    m.add_token("a", [10, 20])
    m.add_token("a", [11, 21])
    assert m.num_free_blocks() == 4
    m.add_token("a", [12, 22])  # position 12: one new generation block per beam
    assert m.block_ids("a") == [[0, 1, 2, 4], [0, 1, 3, 5]]
    assert m.num_free_blocks() == 2
    assert m.needed_blocks_one_step("a") == 0  # next token (position 13) fits
    m.store_context_blocks("a")  # min(13 - 1, 10) = 10 tokens: blocks 0, 1
    assert cached_ids(m) == {0, 1}
    m.store_new_block("a")  # a no-op with beams
    assert cached_ids(m) == {0, 1}
    m.remove_sequence("a")  # beams are not stored at removal either
    assert cached_ids(m) == {0, 1}
    # released last position first, beams from the last: 5, 4, 3, 2, 1, 0
    assert free_order(m) == [6, 7, 5, 4, 3, 2, 1, 0]
    m.verify_integrity()


def test_beam_search_one_int_token_goes_to_every_beam():
    """`add_token(rid, int)` on a multi-beam request appends the token to every beam, exactly
    as passing it once per beam does (numpy integers too)."""
    ms = [make_manager(max_beam_width=2) for _ in range(2)]
    for m in ms:
        m.add_sequence(Request("a", list(R(10)), max_new_tokens=8, beam_width=2))
    for t in (10, np.int64(11), 12):
        ms[0].add_token("a", t)
        ms[1].add_token("a", [int(t), int(t)])
    assert ms[0].snapshot() == ms[1].snapshot()
    assert ms[0].block_ids("a") == [[0, 1, 2, 4], [0, 1, 3, 5]]
    before = ms[0].snapshot()
    with pytest.raises(InvalidRequestError):
        ms[0].add_token("a", [13])  # a list must still give one token per beam
    with pytest.raises(InvalidRequestError):
        ms[0].add_token("a", -1)
    assert ms[0].snapshot() == before
    ms[0].verify_integrity()


def test_beam_search_full_last_block():
    m = make_manager(max_beam_width=2)
    m.add_sequence(Request("a", list(R(8)), beam_width=2))
    # reuse path: the last context block is per beam even when full (as TensorRT-LLM does)
    assert m.block_ids("a") == [[0, 1], [0, 2]]
    m2 = make_manager(max_beam_width=2, enable_block_reuse=False)
    m2.add_sequence(Request("a", list(R(8)), beam_width=2))
    assert m2.block_ids("a") == [[0, 1], [0, 1]]  # without reuse a full last block is shared
    m2.add_sequence(Request("b", list(R(10)), beam_width=2))
    assert m2.block_ids("b") == [[2, 3, 4], [2, 3, 5]]


def test_beam_search_reuses_a_stored_prefix():
    m = make_manager(max_beam_width=2)
    stored_chain(m, 13)
    assert m.add_sequence(Request("b", list(R(13)), beam_width=2)) == 12
    assert m.block_ids("b") == [[0, 1, 2, 4], [0, 1, 2, 5]]


# =========================================================================== cross attention
def test_cross_attention_cache():
    m = make_manager(cache_type="cross", max_beam_width=2)
    r = Request("x", [1, 2, 3], encoder_len=10, beam_width=2)
    assert m.needed_blocks_one_step(Request("y", [1], encoder_len=10)) == 3  # ceil(10/4)
    assert m.remaining_blocks_to_completion(r) == 3
    assert m.add_sequence(r) == 0
    assert m.block_ids("x") == [[0, 1, 2], [0, 1, 2]]  # everything shared among beams
    assert m.needed_blocks_one_step("x") == 0 and m.remaining_blocks_to_completion("x") == 0
    m.store_context_blocks("x")
    assert m.store_blocks_for_reuse("x") == [0, 1, 2]
    m.remove_sequence("x")
    assert cached_ids(m) == set()  # never stored for reuse
    assert m.add_sequence(Request("z", [1, 2, 3], encoder_len=10)) == 0
    assert m.block_ids("z") == [[3, 4, 5]]


# =========================================================================== sliding windows
def swa_manager(**kw):
    kw.setdefault("attention_windows", (8,))
    return make_manager(**kw)


def test_swa_detach_replaces_front_blocks_with_placeholders():
    m = swa_manager()
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=20))
    for t in R(4, 12):
        m.add_token("a", t)
    # n = 12 >= window + tpb: block 0 left every future query's window
    assert m.block_ids("a") == [[PH, 1, 2]]
    np.testing.assert_array_equal(m.block_table(["a"]), [[8, 1, 2]])  # null slot = primary_blocks
    assert m.num_free_blocks() == 6
    assert free_order(m) == [3, 4, 5, 6, 7, 0]  # released to the back
    for t in R(12, 16):
        m.add_token("a", t)
    assert m.block_ids("a") == [[PH, PH, 2, 3]]
    off = m.block_offsets(["a"])
    assert off[0, 0, 0].tolist() == [16, 16, 4, 6]  # null slot 8 * (1 layer * 2)
    m.verify_integrity()


def test_swa_long_prompt_detaches_on_first_token():
    m = swa_manager()
    m.add_sequence(Request("a", list(R(20)), max_new_tokens=4))
    assert m.block_ids("a") == [[0, 1, 2, 3, 4]]  # the prefill reads every block
    m.add_token("a", 20)  # n = 21: detach while 21 - 4 * removed >= 12
    assert m.block_ids("a") == [[PH, PH, PH, 3, 4, 5]]


def test_swa_reuse_over_placeholders_with_safe_prefix():
    m = swa_manager()
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=20))
    for t in R(4, 21):
        m.add_token("a", t)
    assert m.block_ids("a") == [[PH, PH, PH, 3, 4, 5]]
    m.remove_sequence("a")  # stores 20 tokens: positions 0-2 are placeholders, 3 and 4 real
    assert cached_ids(m) == {3, 4}
    assert free_order(m) == [6, 7, 0, 1, 2, 5, 4, 3]
    # b: 21 tokens, usable 20. The walk crosses the three gaps; 20 >= last gap end 12 + window 8
    assert m.add_sequence(Request("b", list(R(21)))) == 20
    # positions the first new query (token 20, window [13, 20]) cannot see stay placeholders
    assert m.block_ids("b") == [[PH, PH, PH, 3, 4, 6]]
    np.testing.assert_array_equal(m.block_table(["b"]), [[8, 8, 8, 3, 4, 6]])
    s = m.request_stats("b")
    assert (s.reused_blocks, s.missed_blocks) == (2, 1)
    m.verify_integrity()


def test_swa_unsafe_prefix_is_not_reused():
    m = swa_manager()
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=20))
    for t in R(4, 21):
        m.add_token("a", t)
    m.remove_sequence("a")
    # b diverges inside block 4: 19 matched tokens < last gap end 12 + window 8 = 20 (TRT's
    # safe-prefix rule); shortening to 16, 12, ... never clears the gaps: nothing reused
    assert m.add_sequence(Request("b", toks(R(19), 99))) == 0
    assert PH not in m.block_ids("b")[0]


def test_swa_gap_in_the_middle_shortens_the_prefix():
    m = swa_manager()
    stored_chain(m, 17, retention=retention((8, 12, 0)))  # block 2 at priority 0
    assert cached_ids(m) == {0, 1, 2, 3}
    m.add_sequence(Request("x", list(R(100, 104))))  # evicts block 2 only
    assert m.block_ids("x") == [[2]] and cached_ids(m) == {0, 1, 3}
    # b walks 0, 1, gap (block 2), 3: 16 tokens; 16 < 12 + 8, 12 < 12 + 8, 8 is before the gap
    assert m.add_sequence(Request("b", list(R(17)))) == 8
    assert m.block_ids("b") == [[0, 1, 5, 6, 7]]


def test_swa_safe_prefix_after_front_gap():
    m = swa_manager()
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=20))
    for t in R(4, 13):
        m.add_token("a", t)
    assert m.block_ids("a") == [[PH, 1, 2, 3]]
    m.remove_sequence("a")  # stores 12 tokens: gap, 1, 2
    assert m.add_sequence(Request("b", list(R(14)))) == 12  # 12 >= gap end 4 + 8
    assert m.block_ids("b")[0][:3] == [PH, 1, 2]


def test_vswa_prepopulated_is_min_over_windows():
    m = make_manager(num_layers=2, attention_windows=(64, 8), primary_blocks={8: 4, 64: 8})
    assert m.windows == (8, 64)
    stored_chain(m, 9)  # both windows cache blocks 0, 1
    assert cached_ids(m, 8) == {0, 1} and cached_ids(m, 64) == {0, 1}
    m.add_sequence(Request("x", list(R(100, 108))))  # window 8: blocks 3, 2; window 64: 3, 4
    m.add_sequence(Request("y", list(R(200, 204))))  # window 8 evicts block 1; window 64: 5
    assert cached_ids(m, 8) == {0} and cached_ids(m, 64) == {0, 1}
    m.remove_sequence("x", store_for_reuse=False)
    m.remove_sequence("y", store_for_reuse=False)
    # full window matches 8 tokens, the sliding window only 4: prepopulated = min = 4
    assert m.add_sequence(Request("b", list(R(9)))) == 4
    assert m.block_ids("b", 64) == [[0, 6, 7]]
    assert m.block_ids("b", 8) == [[0, 2, 3]]
    assert m.num_free_blocks() == 1  # min over windows
    assert (m.num_free_blocks(8), m.num_free_blocks(64)) == (1, 5)
    assert m.num_allocated_blocks() == 3
    with pytest.raises(ValueError):
        m.block_ids("b")  # several windows: window= is required
    assert set(m.store_blocks_for_reuse("b")) == {8, 64}
    m.verify_integrity()


def test_vswa_reuse_with_sliding_window_placeholders():
    m = make_manager(num_layers=2, attention_windows=(64, 8), primary_blocks=10)
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=20))
    for t in R(4, 21):
        m.add_token("a", t)
    assert m.block_ids("a", 8) == [[PH, PH, PH, 3, 4, 5]]
    assert m.block_ids("a", 64) == [[0, 1, 2, 3, 4, 5]]
    m.remove_sequence("a")
    assert m.add_sequence(Request("b", list(R(21)))) == 20
    assert m.block_ids("b", 64)[0][:5] == [0, 1, 2, 3, 4]
    assert m.block_ids("b", 8)[0][:5] == [PH, PH, PH, 3, 4]
    m.verify_integrity()


# =========================================================================== pin / unpin
def test_pin_blocks_survive_remove_until_unpinned():
    m = make_manager()
    m.add_sequence(Request("a", list(R(9))))
    m.pin_blocks("a")
    m.remove_sequence("a")  # stores blocks 0, 1; the pins keep every block referenced
    assert m.num_free_blocks() == 5 and cached_ids(m) == {0, 1}
    assert free_order(m) == [3, 4, 5, 6, 7]
    # pinned blocks are still reusable
    assert m.add_sequence(Request("b", list(R(9)))) == 8
    assert m.block_ids("b") == [[0, 1, 3]]
    m.remove_sequence("b", store_for_reuse=False)
    m.unpin_blocks([2, 1, 0])  # released in the order given
    assert m.num_free_blocks() == 8
    assert free_order(m) == [4, 5, 6, 7, 3, 2, 1, 0]
    m.verify_integrity()


def test_pinned_blocks_are_never_evicted():
    m = make_manager(primary_blocks=4)
    m.add_sequence(Request("a", list(R(9))))
    m.remove_sequence("a", pin=True)
    assert m.num_free_blocks() == 1
    from kvjax import OutOfBlocksError

    with pytest.raises(OutOfBlocksError):
        m.add_sequence(Request("b", list(R(100, 108))))
    m.unpin_blocks([0, 1, 2])
    m.add_sequence(Request("b", list(R(100, 116))))
    assert sorted(m.block_ids("b")[0]) == [0, 1, 2, 3]


def test_store_blocks_for_reuse_with_pin():
    m = make_manager()
    m.add_sequence(Request("a", list(R(10)), max_new_tokens=4))
    m.add_token("a", 10)
    ids = m.store_blocks_for_reuse("a", pin=True)
    assert ids == [0, 1, 2]
    # stores num_tokens - 1 = 10 tokens, the trailing partial block included: [8, 9]
    assert cached_ids(m) == {0, 1, 2} and cached_tokens(m, 2) == tuple(R(10))
    assert m.block_ids("a") == [[0, 1, 2]]  # still live and referenced
    m.remove_sequence("a")
    assert m.num_free_blocks() == 5  # pinned
    m.unpin_blocks(ids)
    assert m.num_free_blocks() == 8
    m.verify_integrity()


def test_store_blocks_for_reuse_returns_dict_with_several_windows():
    m = make_manager(num_layers=2, attention_windows=(64, 8), primary_blocks=8)
    m.add_sequence(Request("a", list(R(9))))
    ids = m.store_blocks_for_reuse("a", pin=True)
    assert ids == {8: [0, 1, 2], 64: [0, 1, 2]}
    m.remove_sequence("a")
    assert (m.num_free_blocks(8), m.num_free_blocks(64)) == (5, 5)
    m.unpin_blocks(ids)
    assert (m.num_free_blocks(8), m.num_free_blocks(64)) == (8, 8)
    m.verify_integrity()


def test_double_pin_needs_double_unpin():
    m = make_manager()
    m.add_sequence(Request("a", list(R(4))))
    m.pin_blocks("a")
    m.pin_blocks("a")
    m.remove_sequence("a")
    m.unpin_blocks([0])
    assert m.num_free_blocks() == 7
    m.unpin_blocks([0])
    assert m.num_free_blocks() == 8


# =========================================================================== rewind
def test_rewind_releases_to_the_front():
    m = make_manager()
    m.add_sequence(Request("a", list(R(6)), max_new_tokens=10))
    for t in R(6, 10):
        m.add_token("a", t)
    assert m.block_ids("a") == [[0, 1, 2]]
    m.rewind("a", 3)  # 7 tokens left: block 2 is empty again
    assert m.block_ids("a") == [[0, 1]]
    assert free_order(m) == [2, 3, 4, 5, 6, 7]  # to the front
    m.add_token("a", 100)  # position 7: block 1
    m.add_token("a", 101)  # position 8: a new block, the front of the queue
    assert m.block_ids("a") == [[0, 1, 2]]
    m.rewind("a", 0)
    assert m.block_ids("a") == [[0, 1, 2]]
    m.verify_integrity()


def test_rewind_into_a_stored_block_drops_it_from_the_tree():
    m = make_manager(event_buffer_max_size=64)
    m.add_sequence(Request("a", list(R(8)), max_new_tokens=8))
    for t in R(8, 13):
        m.add_token("a", t)
    m.store_new_block("a")  # 12 tokens: blocks 0, 1, 2
    assert cached_ids(m) == {0, 1, 2}
    m.rewind("a", 3)  # 10 tokens: block 2 keeps 2 valid tokens, its cached key (4) is stale
    assert m.block_ids("a") == [[0, 1, 2]]
    assert cached_ids(m) == {0, 1}
    assert free_order(m) == [3, 4, 5, 6, 7]
    m.flush_iteration_events()
    removed = [e.data for e in m.get_latest_events() if isinstance(e.data, RemovedData)]
    h0 = block_hash(BlockKey((0, 1, 2, 3)))
    h1 = block_hash(BlockKey((4, 5, 6, 7)), h0)
    assert removed == [RemovedData((block_hash(BlockKey((8, 9, 10, 11)), h1),))]
    # generating again re-stores the new content
    m.add_token("a", 50)
    m.add_token("a", 51)
    m.add_token("a", 52)
    m.store_new_block("a")
    assert cached_tokens(m, 2) == (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 51)
    m.verify_integrity()


def test_rewind_copies_a_shared_stored_block():
    m = make_manager()
    m.add_sequence(Request("a", list(R(8)), max_new_tokens=8))
    for t in R(8, 13):
        m.add_token("a", t)
    m.store_new_block("a")
    assert m.add_sequence(Request("b", list(R(14)))) == 12  # b holds a's block 2
    assert m.block_ids("b") == [[0, 1, 2, 4]]
    m.take_transfers()
    m.rewind("a", 3)
    # block 3 goes to the front, then block 2 (shared) is copied into it: 2 valid tokens
    assert m.block_ids("a") == [[0, 1, 3]]
    assert plan_ops(m) == [("COPY", 0, 2, 3, 2)]
    assert cached_ids(m) == {0, 1, 2}  # b's view of block 2 is untouched
    m.verify_integrity()


def test_rewind_copy_can_use_the_block_the_rewind_releases():
    m = make_manager(primary_blocks=5)
    m.add_sequence(Request("a", list(R(8)), max_new_tokens=8))
    for t in R(8, 13):
        m.add_token("a", t)  # blocks 0, 1, 2, 3
    m.store_new_block("a")  # 12 tokens: 0, 1, 2 cached
    m.add_sequence(Request("b", list(R(13))))  # shares 0, 1, 2 and takes block 4: pool full
    assert m.num_free_blocks() == 0
    m.take_transfers()
    # rewinding 3 tokens releases block 3 (front of the queue) and needs one copy of block 2:
    # the released block serves it, so the rewind must succeed
    m.rewind("a", 3)
    assert m.block_ids("a") == [[0, 1, 3]]
    assert plan_ops(m) == [("COPY", 0, 2, 3, 2)]
    m.verify_integrity()


# =========================================================================== chunked prefill
def test_set_context_position_and_store_context_blocks():
    m = make_manager(event_buffer_max_size=64)
    m.add_sequence(Request("a", list(R(16))))
    m.set_context_position("a", 5)
    m.store_context_blocks("a")  # only materialised full blocks: 5 tokens -> block 0
    assert cached_ids(m) == {0}
    m.set_context_position("a", 12)
    m.store_context_blocks("a")
    assert cached_ids(m) == {0, 1, 2}
    m.set_context_position("a", 16)
    m.store_context_blocks("a")  # min(16 - 1, 16) = 15 tokens: still 3 full blocks
    assert cached_ids(m) == {0, 1, 2}
    m.flush_iteration_events()
    stored = [e.data for e in m.get_latest_events() if isinstance(e.data, StoredData)]
    h0 = block_hash(BlockKey((0, 1, 2, 3)))
    h1 = block_hash(BlockKey((4, 5, 6, 7)), h0)
    assert [s.parent_hash for s in stored] == [None, h0]
    assert [[b.block_hash for b in s.blocks] for s in stored] == [[h0], [h1, block_hash(BlockKey((8, 9, 10, 11)), h1)]]
    # a concurrent request reuses the early-stored blocks
    assert m.add_sequence(Request("b", list(R(13)))) == 12


def test_store_context_blocks_default_is_whole_prompt():
    m = make_manager()
    m.add_sequence(Request("a", list(R(9))))
    m.store_context_blocks("a")  # until set_context_position the whole prompt is materialised
    assert cached_ids(m) == {0, 1}


def test_store_new_block_during_generation():
    m = make_manager()
    m.add_sequence(Request("a", list(R(6)), max_new_tokens=8))
    m.store_new_block("a")  # 5 usable tokens: block 0
    assert cached_ids(m) == {0}
    for t in R(6, 9):
        m.add_token("a", t)
    m.store_new_block("a")  # 9 tokens -> 8 usable: block 1 completes
    assert cached_ids(m) == {0, 1}
    assert cached_tokens(m, 1) == tuple(R(8))


# =========================================================================== scheduler queries
def test_analyze_prefix_reuse_and_needed_blocks_context_branch():
    m = make_manager(primary_blocks=12)
    stored_chain(m, 13)  # blocks 0, 1, 2 cached and free
    m.add_sequence(Request("live", list(R(9))))  # references blocks 0, 1
    q = Request("q", list(R(14)))
    s = m.analyze_prefix_reuse(q)
    assert (s.reusable_blocks_all, s.reusable_blocks_allocated, s.total_matched_tokens, s.first_new_block) == (3, 2, 12, 3)
    # context branch: L = min(14 + 0, 64 + 0) = 14 -> 3 shared + 1 unshared = 4, minus only the
    # reusable blocks already allocated (free cached ones are free supply already, PR #11731)
    assert m.needed_blocks_one_step(q) == 4 - 2
    # a partial match counts tokens, not blocks
    s = m.analyze_prefix_reuse(Request("p", toks(R(10), 99)))
    assert (s.reusable_blocks_all, s.total_matched_tokens) == (2, 10)
    # nothing cached
    s = m.analyze_prefix_reuse(Request("n", list(R(100, 110))))
    assert (s.reusable_blocks_all, s.reusable_blocks_allocated, s.total_matched_tokens, s.first_new_block) == (0, 0, 0, 0)
    assert m.needed_blocks_one_step(Request("n", list(R(100, 110)))) == 3
    assert m.needed_blocks_one_step(Request("d", list(R(100, 110)), num_draft_tokens=3)) == 4  # 13 tokens


def test_scheduler_queries_accept_a_cached_summary():
    m = make_manager(primary_blocks=12)
    stored_chain(m, 13)
    m.add_sequence(Request("live", list(R(9))))
    q = Request("q", list(R(14)), max_new_tokens=6)
    s = m.analyze_prefix_reuse(q)
    assert m.needed_blocks_one_step(q, summary=s) == m.needed_blocks_one_step(q) == 2
    assert m.remaining_blocks_to_completion(q, summary=s) == m.remaining_blocks_to_completion(q)


def test_analyze_prefix_reuse_is_read_only():
    m = make_manager()
    stored_chain(m, 13)
    before = m.snapshot()
    m.analyze_prefix_reuse(Request("q", list(R(12))))
    m.needed_blocks_one_step(Request("q", list(R(12))))
    m.remaining_blocks_to_completion(Request("q", list(R(12)), max_new_tokens=4))
    assert m.snapshot() == before


def test_needed_blocks_generation_branch():
    m = make_manager(primary_blocks=16, max_beam_width=2)
    m.add_sequence(Request("a", list(R(12)), max_new_tokens=8))
    assert m.needed_blocks_one_step("a") == 1  # 12 -> 13 tokens: ceil(13/4) - ceil(12/4)
    m.add_token("a", 12)
    assert m.needed_blocks_one_step("a") == 0  # 13 -> 14
    m.add_sequence(Request("d", list(R(12)), max_new_tokens=20, num_draft_tokens=3))
    assert m.needed_blocks_one_step("d") == 1  # 12 + 4 = 16 tokens
    assert m.needed_blocks_one_step("d", two_steps_lookahead=True) == 2  # 12 + 8 = 20
    m.add_sequence(Request("e", list(R(12)), max_new_tokens=2, num_draft_tokens=3))
    assert m.needed_blocks_one_step("e") == 1  # capped by max_new_tokens: 14 tokens
    m.add_token("e", 1)
    m.add_token("e", 2)
    assert m.needed_blocks_one_step("e") == 0  # max_new_tokens reached
    m.add_sequence(Request("b", list(R(12)), max_new_tokens=4, beam_width=2))
    assert m.needed_blocks_one_step("b") == 2  # one block per beam


def test_needed_blocks_beyond_max_token_num_is_zero():
    m = make_manager(max_seq_len=16, primary_blocks=8)
    m.add_sequence(Request("a", list(R(16))))
    assert m.needed_blocks_one_step("a") == 0  # 17 > max_token_num 16


def test_remaining_blocks_to_completion():
    m = make_manager(primary_blocks=16)
    r = Request("a", list(R(10)), max_new_tokens=10)
    # ctx = 10 // 4 = 2, total = ceil(20 / 4) = 5: 2 + 3 generation blocks
    assert m.remaining_blocks_to_completion(r) == 5
    m.add_sequence(r)
    assert m.remaining_blocks_to_completion("a") == 2  # 3 allocated: 5 - 3
    for t in R(10, 13):
        m.add_token("a", t)
    assert m.remaining_blocks_to_completion("a") == 1
    # reusable blocks already allocated (by a) are subtracted for a new request
    q = Request("q", list(R(10)), max_new_tokens=10)
    assert m.remaining_blocks_to_completion(q) == 5  # nothing stored yet
    m.store_context_blocks("a")  # blocks 0, 1: referenced by a
    assert m.remaining_blocks_to_completion(q) == 5 - 2


def _peak_blocks(window, tpb, prompt_len, max_new, primary):
    """Run a request to completion in a pool of `primary` blocks; the most blocks it held."""
    m = make_manager(attention_windows=(window,), tokens_per_block=tpb, primary_blocks=primary)
    m.add_sequence(Request("a", list(R(prompt_len)), max_new_tokens=max_new))
    peak = m.num_allocated_blocks()
    for t in R(max_new):
        m.add_token("a", 1000 + t)
        peak = max(peak, m.num_allocated_blocks())
    m.verify_integrity()
    return peak


@pytest.mark.parametrize(
    ("window", "tpb", "prompt_len", "max_new"),
    [(8, 4, 10, 10), (9, 4, 10, 20), (5, 4, 3, 20), (8, 4, 30, 10), (16, 4, 6, 40), (7, 2, 9, 21)],
)
def test_swa_scheduling_queries_cover_what_the_request_really_uses(window, tpb, prompt_len, max_new):
    m = make_manager(attention_windows=(window,), tokens_per_block=tpb, primary_blocks=64)
    req = Request("a", list(R(prompt_len)), max_new_tokens=max_new)
    remaining = m.remaining_blocks_to_completion(req)
    # the context branch reserves exactly what admission allocates: every prompt block (the
    # sliding window only releases out-of-window blocks as tokens are added)
    assert m.needed_blocks_one_step(req) == -(-prompt_len // tpb)
    # a pool of `remaining` blocks serves the request to completion (grow happens before the
    # out-of-window detach, so the transient peak counts)
    _peak_blocks(window, tpb, prompt_len, max_new, primary=remaining)
    # and the reservation is tight up to one block: peak = max(prompt blocks, ceil(w/tpb) + 1)
    true_peak = max(-(-prompt_len // tpb), min(-(-(prompt_len + max_new) // tpb), -(-window // tpb) + 1))
    _peak_blocks(window, tpb, prompt_len, max_new, primary=true_peak)
    from kvjax import OutOfBlocksError

    with pytest.raises(OutOfBlocksError):
        _peak_blocks(window, tpb, prompt_len, max_new, primary=true_peak - 1)
    assert true_peak <= remaining <= true_peak + 1


def test_scheduling_dry_run():
    m = make_manager()
    m.add_sequence(Request("a", list(R(12))))
    m.store_context_blocks("a")  # blocks 0, 1 cached
    m.add_sequence(Request("b", toks(R(8), 50, 51)))  # reuses 0, 1; own block 3
    assert m.block_ids("b") == [[0, 1, 3]]
    assert m.num_free_blocks() == 4
    before = m.snapshot()
    m.start_scheduling()
    assert m.scheduling_has_free_blocks(4) and not m.scheduling_has_free_blocks(5)
    m.scheduling_remove_sequence("b")  # only block 3 would be freed: 0, 1 still held by a
    assert m.scheduling_has_free_blocks(5) and not m.scheduling_has_free_blocks(6)
    m.scheduling_remove_sequence("a")
    assert m.scheduling_has_free_blocks(8)
    assert m.snapshot() == before and m.num_free_blocks() == 4  # a dry run
    m.start_scheduling()  # a new dry run starts from the real counts
    assert not m.scheduling_has_free_blocks(5)


# =========================================================================== tables and offsets
def test_block_table_padding_rows_per_beam():
    m = make_manager(max_beam_width=2, primary_blocks=16)
    m.add_sequence(Request("a", list(R(10)), beam_width=2))
    m.add_sequence(Request("b", list(R(100, 104))))
    t = m.block_table(["b", "a"])
    assert t.dtype == np.int32
    # rows per (request, beam) in the order asked; padding is the null slot (primary_blocks)
    assert t.tolist() == [[4, 16, 16], [0, 1, 2], [0, 1, 3]]
    assert m.block_table(["b"], max_blocks=4).tolist() == [[4, 16, 16, 16]]
    with pytest.raises(ValueError):
        m.block_table(["a"], max_blocks=2)
    assert m.block_table([]).shape == (0, 0)


@pytest.mark.parametrize("layout", ["block_first", "layer_first"])
@pytest.mark.parametrize("cache_type", ["self", "self_k_only"])
def test_block_offsets_match_kvcache_index_formula(layout, cache_type):
    m = make_manager(
        num_layers=3,
        num_kv_heads=(1, 2, 1),
        primary_blocks=10,
        layout=layout,
        cache_type=cache_type,
        max_beam_width=2,
    )
    m.add_sequence(Request("a", list(R(10)), beam_width=2))
    m.add_sequence(Request("b", list(R(100, 105))))
    off = m.block_offsets(["a", "b"])
    table = m.block_table(["a", "b"])
    assert off.dtype == np.int32 and off.shape == (2, 3, 2, 3)
    np.testing.assert_array_equal(off, kvcache_index_offsets(m.config, table))
    kv = 1 if cache_type == "self_k_only" else 2
    for pool in m.config.pools:
        stride = pool.num_layers * kv if layout == "block_first" else kv
        for row in R(3):
            for j in R(3):
                slot = int(table[row, j])
                assert off[pool.index, row, 0, j] == slot * stride
                v = slot * stride + 1 if kv == 2 else pool.null_slot * stride
                assert off[pool.index, row, 1, j] == v
    # pool 0 holds layers 0 and 2 (1 kv head), pool 1 layer 1: a padded entry is the null slot
    assert off[0, 2, 0, 2] == 10 * (2 * kv if layout == "block_first" else kv)


def test_block_offsets_vswa_pads_narrow_windows():
    m = make_manager(num_layers=2, attention_windows=(64, 8), primary_blocks={8: 6, 64: 10})
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=20))
    for t in R(4, 13):
        m.add_token("a", t)
    off = m.block_offsets(["a"])
    tables = {w: m.block_table(["a"], w) for w in m.windows}
    assert tables[8].tolist() == [[6, 1, 2, 3]] and tables[64].tolist() == [[0, 1, 2, 3]]
    np.testing.assert_array_equal(off, kvcache_index_offsets(m.config, tables))


# =========================================================================== statistics
BLOCK_BYTES = 1 * 2 * 1 * 8 * 4 * 2  # layers * kv * heads * head_dim * tpb * bf16 bytes


def test_global_and_request_stats():
    m = make_manager()
    st = m.stats()
    assert (st.max_num_blocks, st.free_num_blocks, st.used_num_blocks, st.tokens_per_block) == (8, 8, 0, 4)
    assert (st.reused_blocks, st.missed_blocks, st.cache_hit_rate) == (0, 0, 0.0)
    m.add_sequence(Request("a", list(R(10)), max_new_tokens=4))
    st = m.stats()
    assert (st.alloc_total_blocks, st.alloc_new_blocks, st.reused_blocks, st.missed_blocks) == (3, 3, 0, 3)
    assert st.cache_hit_rate == 0.0  # nothing reused: 0, not a division
    assert (st.free_num_blocks, st.used_num_blocks, st.allocated_bytes) == (5, 3, 3 * BLOCK_BYTES)
    assert st.num_free_blocks_per_window == {64: 5}
    ra = m.request_stats("a")
    assert (ra.reused_blocks, ra.missed_blocks, ra.alloc_total_blocks, ra.alloc_new_blocks) == (0, 3, 3, 3)
    assert (ra.cache_hit_rate, ra.prepopulated_tokens) == (0.0, 0)
    m.remove_sequence("a")
    m.add_sequence(Request("b", list(R(10))))  # 2 full + 1 partial (in place)
    rb = m.request_stats("b")
    assert (rb.reused_blocks, rb.missed_blocks, rb.alloc_total_blocks, rb.alloc_new_blocks) == (3, 0, 0, 0)
    assert (rb.cache_hit_rate, rb.prepopulated_tokens) == (1.0, 9)
    st = m.stats()
    assert (st.reused_blocks, st.missed_blocks, st.cache_hit_rate) == (3, 3, 0.5)


def test_iteration_stats_are_deltas():
    m = make_manager()
    stored_chain(m, 13)  # 4 new blocks, 4 missed
    it = m.iteration_stats()
    assert (it.alloc_total_blocks, it.alloc_new_blocks, it.missed_blocks, it.reused_blocks) == (4, 4, 4, 0)
    assert it.cache_hit_rate == 0.0
    assert (it.primary_used_blocks, it.primary_free_blocks) == (0, 8)
    it = m.iteration_stats()
    assert (it.alloc_total_blocks, it.missed_blocks, it.reused_blocks, it.gen_alloc_blocks) == (0, 0, 0, 0)
    m.add_sequence(Request("live", list(R(13))))  # holds 0, 1, 2 + a fresh block
    m.add_sequence(Request("b", toks(R(10), 99, 98)))  # 2 full + copy of block 2 (2 tokens)
    m.add_sequence(Request("g", [500], max_new_tokens=8))
    for t in R(4):
        m.add_token("g", t)  # position 4 starts a generation block
    it = m.iteration_stats()
    assert (it.full_reused_blocks, it.partial_reused_blocks, it.reused_blocks) == (3 + 2, 1, 6)
    assert it.missed_blocks == 1 + 1  # live's trailing empty key, g's single block
    assert (it.copied_blocks, it.copy_bytes) == (1, BLOCK_BYTES * 2 // 4)
    assert it.gen_alloc_blocks == 1
    assert it.cache_hit_rate == pytest.approx(6 / 8)
    assert (it.primary_used_blocks, it.primary_free_blocks) == (8 - 1, 1)
    assert (it.secondary_used_blocks, it.secondary_free_blocks) == (0, 0)


def test_vswa_stats_sum_windows():
    m = make_manager(num_layers=2, attention_windows=(64, 8), primary_blocks={8: 4, 64: 6})
    m.add_sequence(Request("a", list(R(5))))
    st = m.stats()
    assert (st.max_num_blocks, st.free_num_blocks, st.used_num_blocks) == (10, 6, 4)
    assert st.num_free_blocks_per_window == {8: 2, 64: 4}
    assert (st.alloc_total_blocks, st.missed_blocks) == (4, 4)  # 2 per window


# =========================================================================== events
def H(*keys):
    """Chained hashes of consecutive keys from the root."""
    out, parent = [], None
    for k in keys:
        parent = block_hash(BlockKey(tuple(k)), parent)
        out.append(parent)
    return out


def events(m):
    m.flush_iteration_events()
    return m.get_latest_events()


def test_no_events_when_disabled():
    m = make_manager()
    stored_chain(m, 9)
    m.flush_iteration_events()
    assert m.get_latest_events() == [] and m.get_latest_events(timeout=0.01) == []


def test_created_per_window_ascending_published_on_flush():
    m = make_manager(
        num_layers=2,
        attention_windows=(64, 8),
        primary_blocks={8: 4, 64: 6},
        secondary_blocks={8: 1, 64: 2},
        event_buffer_max_size=16,
    )
    assert m.get_latest_events() == []  # pending until the iteration flush
    ev = events(m)
    assert [(e.event_id, e.window_size, e.data) for e in ev] == [
        (0, 8, CreatedData((4, 1))),
        (1, 64, CreatedData((6, 2))),
    ]
    assert m.get_latest_events() == []  # consumed
    assert m.get_latest_events(timeout=0.01) == []


def test_stored_events_root_parent_and_chaining():
    m = make_manager(event_buffer_max_size=64)
    events(m)
    stored_chain(m, 13, retention=retention((4, 8, 70)))
    h0, h1, h2 = H(R(0, 4), R(4, 8), R(8, 12))
    (e,) = events(m)
    assert e.window_size == 64 and e.event_id == 1
    assert e.data == StoredData(
        None,  # parent is the root
        (
            StoredBlock(h0, (0, 1, 2, 3), None, 0, 35, ()),
            StoredBlock(h1, (4, 5, 6, 7), None, 0, 70, ()),
            StoredBlock(h2, (8, 9, 10, 11), None, 0, 35, ()),
        ),
    )
    # a longer prompt over the same prefix stores only its new blocks, under h2
    m.add_sequence(Request("b", list(R(18)), lora_task_id=None))
    m.remove_sequence("b")  # stores 17 tokens: block of [12..15] and the partial [16]
    (e,) = events(m)
    h3 = block_hash(BlockKey((12, 13, 14, 15)), h2)
    h4 = block_hash(BlockKey((16,)), h3)
    assert e.data == StoredData(h2, (StoredBlock(h3, (12, 13, 14, 15), None, 0, 35, ()), StoredBlock(h4, (16,), None, 0, 35, ())))


def test_stored_event_fields_lora_extra_ids_mm():
    from kvjax.ledger.block_key import MmKey

    m = make_manager(event_buffer_max_size=64)
    events(m)
    item = MultimodalItem(b"\x44" * 32, 1, 2)
    m.add_sequence(Request("a", list(R(5)), lora_task_id=9, extra_ids=[1, 2, 3, 4, 5], mm_items=(item,), cache_salt="s"))
    m.remove_sequence("a")
    (e,) = events(m)
    (blk,) = e.data.blocks
    key = BlockKey((0, 1, 2, 3), (1, 2, 3, 4), 9, cache_salt_id("s"), (MmKey(item.hash, 0),))
    assert blk == StoredBlock(block_hash(key), ((0, 1), (1, 2), (2, 3), (3, 4)), 9, 0, 35, (MmKey(item.hash, 0),))


def test_removed_events_batched_until_next_stored_of_the_window():
    m = make_manager(primary_blocks=4, event_buffer_max_size=64)
    stored_chain(m, 9)  # blocks 0, 1 cached; free [3, 2, 1, 0]
    h0, h1 = H(R(0, 4), R(4, 8))
    events(m)
    m.add_sequence(Request("x", list(R(100, 116))))  # evicts 1 then 0
    m.remove_sequence("x")  # stores x's blocks: the pending removes go out first
    ev = [e.data for e in events(m)]
    assert isinstance(ev[0], RemovedData) and ev[0] == RemovedData((h1, h0))
    assert isinstance(ev[1], StoredData) and ev[1].parent_hash is None and len(ev[1].blocks) == 4
    assert len(ev) == 2


def test_removed_events_flushed_at_iteration_end():
    m = make_manager(primary_blocks=4, event_buffer_max_size=64)
    stored_chain(m, 9)
    h0, h1 = H(R(0, 4), R(4, 8))
    events(m)
    m.add_sequence(Request("x", list(R(100, 116))))
    assert [e.data for e in events(m)] == [RemovedData((h1, h0))]


def test_stored_of_another_window_does_not_flush_pending_removes():
    m = make_manager(num_layers=2, attention_windows=(64, 8), primary_blocks={8: 3, 64: 8}, event_buffer_max_size=64)
    stored_chain(m, 9)  # both windows cache 0, 1
    h0, h1 = H(R(0, 4), R(4, 8))
    events(m)
    m.add_sequence(Request("x", list(R(100, 112))))  # window 8 evicts 1 then 0; window 64 uses fresh blocks
    m.remove_sequence("x")  # stores in window 64 first, then window 8
    ev = [(e.window_size, type(e.data).__name__) for e in events(m)]
    # TRT EventStoreForDifferentWindowDoesNotFlushPendingRemoves
    assert ev == [(64, "StoredData"), (8, "RemovedData"), (8, "StoredData")]


def test_updated_events_offload_onboard_priority():
    m = make_manager(primary_blocks=4, secondary_blocks=2, event_buffer_max_size=64)
    stored_chain(m, 9, retention=retention((0, None, 60)))
    h0, h1 = H(R(0, 4), R(4, 8))
    events(m)
    m.add_sequence(Request("x", list(R(100, 116))))  # offloads 1, then 0 (both priority 60)
    m.remove_sequence("x", store_for_reuse=False)
    assert [e.data for e in events(m)] == [UpdatedData(h1, (0, 1), None), UpdatedData(h0, (0, 1), None)]
    m.add_sequence(Request("c", list(R(9)), retention=retention((0, 4, 60), (4, None, 90))))
    assert [e.data for e in events(m)] == [
        UpdatedData(h0, (1, 0), None),
        UpdatedData(h1, (1, 0), None),
        UpdatedData(h1, None, (60, 90)),
    ]


def test_in_place_partial_reuse_emits_removed():
    m = make_manager(event_buffer_max_size=64)
    stored_chain(m, 13)
    h2 = H(R(0, 4), R(4, 8), R(8, 12))[2]
    events(m)
    m.add_sequence(Request("b", list(R(10))))
    assert [e.data for e in events(m)] == [RemovedData((h2,))]


def test_regrown_partial_block_removes_its_old_hash():
    # a trailing partial block stored by store_blocks_for_reuse, then completed and stored
    # again under its full key: the tree forgets the partial key, so must a router
    m = make_manager(event_buffer_max_size=64)
    m.add_sequence(Request("a", list(R(10)), max_new_tokens=4))
    m.add_token("a", 10)
    m.store_blocks_for_reuse("a")  # 10 tokens: [8, 9] stored as a partial block
    h0, h1 = H(R(0, 4), R(4, 8))
    h_partial = block_hash(BlockKey((8, 9)), h1)
    ev = events(m)
    assert ev[-1].data.blocks[-1].block_hash == h_partial
    m.add_token("a", 11)
    m.add_token("a", 12)
    m.store_new_block("a")  # block 2 now stored as [8, 9, 10, 11]
    assert cached_tokens(m, 2) == tuple(R(12)) and m.inspector.tree_size()[0] == 3  # positions
    h_full = block_hash(BlockKey((8, 9, 10, 11)), h1)
    assert [e.data for e in events(m)] == [
        RemovedData((h_partial,)),
        StoredData(h1, (StoredBlock(h_full, (8, 9, 10, 11), None, 0, 35, ()),)),
    ]


def test_bounded_event_buffer_drops_the_oldest():
    m = make_manager(primary_blocks=32, event_buffer_max_size=3)
    for i in R(5):  # Created (id 0) + 5 Stored (ids 1..5), all pending
        m.add_sequence(Request(i, [100 * i + t for t in R(5)]))
        m.remove_sequence(i)
    assert [e.event_id for e in events(m)] == [3, 4, 5]
    for i in R(5, 9):  # ids 6..9, published one iteration at a time, never consumed
        m.add_sequence(Request(i, [100 * i + t for t in R(5)]))
        m.remove_sequence(i)
        m.flush_iteration_events()
    assert [e.event_id for e in m.get_latest_events()] == [7, 8, 9]


# =========================================================================== sink tokens
def test_sink_bubble_disables_reuse():
    # TRT: a sink length that is not a multiple of tpb leaves a bubble; reuse is disabled
    m = make_manager(sink_token_length=2)
    stored_chain(m, 13)
    assert cached_ids(m) == set()
    assert m.add_sequence(Request("b", list(R(13)))) == 0
    # context branch: L = 13 + bubble 2 = 15 -> 3 shared + 1 unshared
    assert m.needed_blocks_one_step(Request("q", list(R(13)))) == 4


def test_snapshot_is_hashable_and_tracks_state():
    m = make_manager(event_buffer_max_size=8)
    s0 = m.snapshot()
    hash(s0)
    m.add_sequence(Request("a", list(R(5))))
    s1 = m.snapshot()
    hash(s1)
    assert s1 != s0
    m.remove_sequence("a", store_for_reuse=False)
    assert m.snapshot() != s1
