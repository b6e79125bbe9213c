"""The recurrent-state window (`RECURRENT_STATES`, -1; docs/semantics.md, "Recurrent states"):
placeholder chains matching the attention rows, snapshots at snapshot points, copy-forward
step slots, prefix matches ending at the last snapshot, rewinds, pins, offload/onboard,
events, integrity and the scheduler's counts, each as a scenario; then a seeded random
driver with a model of what every state slot holds."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvjax import CacheConfig, KVCacheManager, Request, TransferKind
from kvjax._math import ceil_div
from kvjax.capacity import cache_config_from_memory, hybrid_pool_split
from kvjax.config import RECURRENT_STATES
from kvjax.errors import (
    DuplicateRequestError,
    IntegrityError,
    InvalidArgumentError,
    InvalidRequestError,
    OutOfBlocksError,
    UnknownRequestError,
)
from kvjax.ledger import PLACEHOLDER_BLOCK_ID
from kvjax.ledger.events import RemovedData, StoredData

P = PLACEHOLDER_BLOCK_ID
R = RECURRENT_STATES
TPB = 4
ATTN = 64


def hybrid_config(**overrides) -> CacheConfig:
    """Three recurrent layers and one full-attention layer: tokens_per_block 4, snapshots
    every 8 tokens, 16 state blocks and 32 attention blocks."""
    base: dict = dict(
        tokens_per_block=TPB,
        num_layers=4,
        num_kv_heads=1,
        head_dim=8,
        max_seq_len=ATTN,
        primary_blocks={R: 16, ATTN: 32},
        attention_windows=(R, R, R, ATTN),
        recurrent_state_bytes=100,
        snapshot_interval=8,
    )
    base.update(overrides)
    return CacheConfig(**base)


def hybrid(**overrides) -> KVCacheManager:
    return KVCacheManager(hybrid_config(**overrides))


def prefill(m: KVCacheManager, rid, chunked: bool = True) -> list:
    """Run a request's prompt as the engine would: steps ending where `recurrent_next_chunk_end`
    says, progress reported after each; returns the steps."""
    steps = []
    prompt_len = len(m._seq(rid).request.prompt)
    start = m.recurrent_state_position(rid)
    if not chunked:  # one step over the whole prompt
        return [m.begin_recurrent_step([rid], [prompt_len])]
    m.set_context_position(rid, start)
    while True:
        end = m.recurrent_next_chunk_end(rid)
        steps.append(m.begin_recurrent_step([rid]))
        m.verify_integrity()
        if end < prompt_len:
            m.set_context_position(rid, end)
        else:
            m.set_context_position(rid, prompt_len)
            return steps


def chain(m: KVCacheManager, rid) -> list[int]:
    return m.block_ids(rid, R)[0]


# --------------------------------------------------------------------------- config
def test_config_validates_a_recurrent_window():
    cfg = hybrid_config()
    assert cfg.windows == (R, ATTN) and cfg.has_recurrent and not cfg.partial_reuse
    assert cfg.recurrent_block_bytes == 300
    assert cfg.cache_size_per_token[R] == 300 / TPB
    assert hybrid_config(snapshot_interval=None).snapshot_interval == TPB
    assert hybrid_config(primary_blocks={"-1": 4, "64": 8}).primary_blocks_for(R) == 4
    bad = [
        dict(recurrent_state_bytes=0),
        dict(snapshot_interval=6),
        dict(max_beam_width=2),
        dict(sink_token_length=2),
        dict(attention_windows=(R, R), primary_blocks=8),
        dict(attention_windows=(-2, ATTN)),
    ]
    for kw in bad:
        with pytest.raises(InvalidArgumentError):
            hybrid_config(**kw)
    with pytest.raises(InvalidArgumentError):
        CacheConfig(
            tokens_per_block=4, num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=64, primary_blocks=8, snapshot_interval=8
        )


def test_a_cache_without_recurrent_window_rejects_recurrent_steps():
    m = KVCacheManager(
        CacheConfig(tokens_per_block=4, num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=64, primary_blocks=8)
    )
    m.add_sequence(Request("a", [1, 2, 3]))
    with pytest.raises(InvalidArgumentError):
        m.begin_recurrent_step(["a"])


def test_capacity_splits_a_hybrid_budget_by_tensorrt_llms_rule():
    # a token costs 32 attention bytes + 300 / 8 state bytes; 4 requests hold 2 state blocks each
    tokens, states = hybrid_pool_split(100_000, 32, 300, 8, 4)
    assert tokens == (100_000 - 8 * 300) * 8 // (32 * 8 + 300)
    assert states == tokens // 8 + 8
    assert tokens * 32 + states * 300 <= 100_000 < (tokens + 8) * 32 + (states + 1) * 300
    # reuse off: the state pool is one static slot per request
    assert hybrid_pool_split(100_000, 32, 300, 8, 4, enable_block_reuse=False) == ((100_000 - 1200) // 32, 4)
    with pytest.raises(ValueError):
        hybrid_pool_split(1000, 32, 300, 8, 4)
    cfg = cache_config_from_memory(hybrid_config(), 100_000, 0, tokens_per_block=TPB, max_seq_len=ATTN, max_batch_size=4)
    assert cfg.primary_blocks == {R: states, ATTN: ceil_div(tokens, TPB)}
    with pytest.raises(ValueError):
        cache_config_from_memory(hybrid_config(), 100_000, tokens_per_block=TPB, max_seq_len=ATTN)
    # the pools it sized serve 4 requests of the batch at once
    m = KVCacheManager(cfg)
    m.add_sequences([Request(i, list(range(i, i + 30)), max_new_tokens=10) for i in range(4)])
    assert m.begin_recurrent_step(list(range(4))).ends.tolist() == [8] * 4
    m.verify_integrity()


# --------------------------------------------------------------------------- chains and steps
def test_chunks_end_at_snapshot_points_and_the_chain_holds_placeholders_between():
    m = hybrid()
    m.add_sequence(Request("a", list(range(23)), max_new_tokens=8))
    assert chain(m, "a") == [P] * 6  # nothing computed yet: no state block in the chain
    assert m.num_allocated_blocks(R) == 1  # the first step's write block
    steps = prefill(m, "a")
    # interval 8 and the prompt's last block boundary (20), then the prompt's end
    assert [int(s.ends[0]) for s in steps] == [8, 16, 20, 23]
    assert [int(s.starts[0]) for s in steps] == [0, 8, 16, 20]
    assert steps[0].has_initial_state.tolist() == [False] and steps[0].read_slots[0] == 16  # the null slot
    m.add_token("a", 100)
    m.begin_recurrent_step(["a"])  # settles the prompt's last step
    ids = chain(m, "a")
    assert len(ids) == len(m.block_ids("a", ATTN)[0]) == 6
    real = [k for k, b in enumerate(ids) if b != P]
    assert real == [1, 3, 4, 5]  # snapshots at 8, 16, 20 and the live state S(23)
    table = m.block_table(["a"], R)[0]
    null = 16
    assert all(table[k] == null for k in (0, 2)) and all(table[k] != null for k in real)
    m.verify_integrity()


def test_storing_the_prompt_right_after_its_last_chunk_keeps_that_step():
    """The engine stores a prompt's blocks as soon as its last chunk ran, before the first
    generated token is added: that store settles the last step, which must take effect (its
    state is the one decoding reads), not be dropped as if its KV were missing."""
    m = hybrid()
    m.add_sequence(Request("a", list(range(23)), max_new_tokens=8))
    prefill(m, "a")
    m.store_context_blocks("a")
    assert m.recurrent_state_position("a") == 23
    m.add_token("a", 100)
    s = m.begin_recurrent_step(["a"])
    assert int(s.starts[0]) == 23 and s.has_initial_state.tolist() == [True]
    assert len(m.inspector.cached_block_ids(R)) == 3  # S(8), S(16), S(20)
    m.verify_integrity()
    # decoding: the engine stores the blocks a decode step completed right after its forward,
    # before the next token is added; the step stays begun and the next one starts after it
    for t in range(24, 34):
        m.store_new_blocks(["a"])
        m.add_token("a", t)
        s = m.begin_recurrent_step(["a"])
        assert int(s.starts[0]) == t and int(s.ends[0]) == t + 1
        m.verify_integrity()


def test_a_step_never_writes_the_slot_it_reads_nor_a_snapshot():
    m = hybrid()
    m.add_sequence(Request("a", list(range(10)), max_new_tokens=40))
    steps = prefill(m, "a")
    assert [int(s.ends[0]) for s in steps] == [8, 10]
    snapshots = {int(steps[1].read_slots[0])}  # S(8)
    prev_write = int(steps[-1].write_slots[0])
    for t in range(30):
        m.add_token("a", 1000 + t)
        s = m.begin_recurrent_step(["a"])
        read, write = int(s.read_slots[0]), int(s.write_slots[0])
        assert read == prev_write != write  # copy-forward: the last step's output is this step's input
        assert write not in snapshots
        pos = int(s.starts[0])
        if pos % 8 == 0:
            snapshots.add(read)  # S(pos) at a snapshot point is kept
        prev_write = write
        m.verify_integrity()
    assert m.recurrent_state_position("a") == 39
    # held: snapshots at 8..32 and S(39) in the chain, plus the write block
    assert m.num_allocated_blocks(R) == len(snapshots) + 2


def test_reuse_off_updates_the_state_in_place_in_one_block():
    m = hybrid(enable_block_reuse=False)
    m.add_sequence(Request("a", list(range(10)), max_new_tokens=20))
    m.add_sequence(Request("b", list(range(5)), max_new_tokens=20))
    assert m.num_allocated_blocks(R) == 2
    for rid in ("a", "b"):
        prefill(m, rid)
    for t in range(12):
        m.add_tokens(["a", "b"], [t, t])
        s = m.begin_recurrent_step(["a", "b"])
        assert s.read_slots.tolist() == s.write_slots.tolist() and s.has_initial_state.all()
        m.verify_integrity()
    assert m.num_allocated_blocks(R) == 2
    assert sum(b != P for b in chain(m, "a")) == 1
    assert m.remaining_blocks_to_completion("a", R) == 0
    assert m.remaining_blocks_to_completion(Request("c", [1, 2]), R) == 1


def test_default_ends_cover_the_newest_token_when_decoding():
    m = hybrid()
    m.add_sequence(Request("a", list(range(6)), max_new_tokens=8))
    prefill(m, "a", chunked=False)  # one step: the whole prompt (no snapshot inside)
    m.add_tokens(["a"], [7])
    s = m.begin_recurrent_step(["a"], ends=[7])
    assert (int(s.starts[0]), int(s.ends[0])) == (6, 7)
    assert m.recurrent_next_chunk_end("a") == 7


def test_a_large_batched_decode_step_grows_placeholders_in_the_chain():
    m = hybrid(primary_blocks={R: 240, ATTN: 400})
    ids = [f"r{i}" for i in range(70)]  # more rows than `add_tokens`' small-batch path takes
    m.add_sequences([Request(rid, [i % 7, 1, 2], max_new_tokens=20) for i, rid in enumerate(ids)])
    for rid in ids:
        prefill(m, rid, chunked=False)
    for t in range(7):
        m.add_tokens(ids, np.full(len(ids), t))
        s = m.begin_recurrent_step(ids)
        assert (s.ends - s.starts).tolist() == [1] * len(ids)
        assert not set(s.read_slots.tolist()) & set(s.write_slots.tolist())
        m.verify_integrity()
    assert all(len(chain(m, rid)) == 3 for rid in ids)
    # S(8), at a snapshot point, stayed when the step reading it settled; S(9) and a write block
    assert m.num_allocated_blocks(R) == 3 * len(ids)


# --------------------------------------------------------------------------- reuse
def finish(m: KVCacheManager, rid, decode: int = 0) -> None:
    prefill(m, rid)
    for t in range(decode + 1):
        m.add_token(rid, 500 + t)
        if t < decode:
            m.begin_recurrent_step([rid])
    m.remove_sequence(rid)
    m.verify_integrity()


def test_a_prefix_match_ends_at_the_last_real_snapshot():
    m = hybrid()
    m.add_sequence(Request("a", list(range(23)), max_new_tokens=4))
    finish(m, "a")
    cached = m.inspector.cached_block_ids(R)
    assert len(cached) == 3  # S(8), S(16), S(20); S(23) is not at a block boundary
    # the attention window matches 5 full blocks (20 tokens) and would copy a partial one:
    # the reusable length is the last snapshot both windows hold, whole blocks only
    n = m.add_sequence(Request("b", list(range(22)) + [99, 98, 97], max_new_tokens=4))
    assert n == 20 and m.recurrent_state_position("b") == 20
    s = m.begin_recurrent_step(["b"])
    assert s.has_initial_state.tolist() == [True] and int(s.starts[0]) == 20
    # a prompt diverging inside the third block reuses S(8) only
    n = m.add_sequence(Request("c", list(range(10)) + [77] * 6, max_new_tokens=4))
    assert n == 8 and chain(m, "c")[:2] == [P, chain(m, "b")[1]]
    assert not m.take_transfers().kind.size or all(TransferKind(int(k)) is not TransferKind.COPY for k in m.take_transfers().kind)
    m.verify_integrity()


def test_early_reuse_summaries_and_reset_cover_the_recurrent_window():
    m = hybrid()
    m.add_sequence(Request("a", list(range(23)), max_new_tokens=4))
    steps = prefill(m, "a")
    assert len(steps) == 4
    m.store_context_blocks("a")  # S(8), S(16), S(20); the step to S(23) is not done until a token follows
    assert len(m.inspector.cached_block_ids(R)) == 3
    summary = m.analyze_prefix_reuse(Request("q", list(range(22)) + [1]))
    assert summary.total_matched_tokens == 20 and summary.first_new_block == 5
    free = m.num_free_blocks(R)
    assert m.add_sequence(Request("b", list(range(22)) + [1])) == 20
    assert free - m.num_free_blocks(R) == summary.admission_blocks[0]
    m.remove_sequence("b", store_for_reuse=False)
    m.remove_sequence("a")
    assert len(m.inspector.cached_block_ids(R)) == 3
    assert m.reset_prefix_cache() > 0
    assert not m.inspector.cached_block_ids(R) and m.num_allocated_blocks(R) == 0
    m.verify_integrity()


def test_reuse_needs_a_snapshot_even_when_attention_matches_more():
    m = hybrid(snapshot_interval=16)
    m.add_sequence(Request("a", list(range(42)), max_new_tokens=2))
    prefill(m, "a", chunked=False)  # one step: no snapshot, only the live state S(42)
    m.add_token("a", 1)
    m.remove_sequence("a")
    assert len(m.inspector.cached_block_ids(ATTN)) >= 10 and not m.inspector.cached_block_ids(R)
    assert m.add_sequence(Request("b", list(range(42)) + [3])) == 0
    m.verify_integrity()


def test_scheduler_counts_match_admission_and_steps():
    m = hybrid()
    m.add_sequence(Request("a", list(range(23)), max_new_tokens=4))
    finish(m, "a")
    req = Request("b", list(range(21)), max_new_tokens=20)
    need = m.needed_blocks_one_step(req, window=R)
    free = m.num_free_blocks(R)
    assert m.add_sequence(req) == 20
    # the three reused snapshots leave the free queues, and the write block is taken
    assert need == 4 and m.num_free_blocks(R) == free - need
    assert m.needed_blocks_one_step("b", window=R) == 0  # holds its write block
    m.begin_recurrent_step(["b"])
    m.add_token("b", 1)
    # committing S(21) releases nothing (S(20) is a snapshot): the next step needs a block
    assert m.needed_blocks_one_step("b", window=R) == 1
    assert m.needed_blocks_one_step_many(["b"], False, R).tolist() == [1]
    m.begin_recurrent_step(["b"])
    assert m.num_allocated_blocks(R) == 3 + 2  # snapshots 8, 16, 20 (reused), live S(21), write
    left = m.remaining_blocks_to_completion("b", R)
    assert m.remaining_blocks_to_completion_many(["b"], R).tolist() == [left]
    m.start_scheduling()
    m.scheduling_remove_sequence("b")
    # its three reused snapshots (only it references them), live and write blocks
    assert m.scheduling_num_free_blocks(R) == m.num_free_blocks(R) + 5
    # run it to its end: it never allocates more than the bound said
    held, peak = m.num_allocated_blocks(R), 0
    for t in range(19):
        m.add_token("b", t)
        m.begin_recurrent_step(["b"])
        peak = max(peak, m.num_allocated_blocks(R))
    assert 0 < peak - held <= left


def test_remaining_blocks_bound_a_requests_peak_from_admission():
    for interval, prompt_len, new in [(8, 10, 30), (4, 7, 9), (16, 21, 12)]:
        m = hybrid(snapshot_interval=interval)
        req = Request("a", list(range(prompt_len)), max_new_tokens=new)
        bound = m.remaining_blocks_to_completion(req, R)
        m.add_sequence(req)
        prefill(m, "a")
        peak = m.num_allocated_blocks(R)
        for t in range(new - 1):
            m.add_token("a", t)
            m.begin_recurrent_step(["a"])
            peak = max(peak, m.num_allocated_blocks(R))
        assert peak <= bound <= peak + 2, (interval, prompt_len, new, peak, bound)


def test_bad_steps_change_nothing():
    m = hybrid(primary_blocks={R: 3, ATTN: 32})
    m.add_sequence(Request("a", list(range(9)), max_new_tokens=4))
    m.set_context_position("a", 0)
    m.begin_recurrent_step(["a"], [4])
    m.set_context_position("a", 4)
    before = m.snapshot()
    for ids, ends, err in [
        (["a"], [0], InvalidArgumentError),  # not a token count
        (["a"], [3], InvalidRequestError),  # behind the state
        (["a"], [10], InvalidRequestError),  # past the tokens
        (["a", "a"], None, DuplicateRequestError),
        (["a"], [1, 2], InvalidArgumentError),
        (["zz"], None, UnknownRequestError),
    ]:
        with pytest.raises(err):
            m.begin_recurrent_step(ids, ends)
        assert m.snapshot() == before
    m.begin_recurrent_step(["a"], [8])
    m.set_context_position("a", 8)
    m.add_sequence(Request("b", [5, 6]))  # takes the last free state block
    m.begin_recurrent_step(["a"])  # 8 -> 9 writes the block S(4) was in (not a snapshot point)
    m.set_context_position("a", 9)
    m.add_token("a", 1)
    before = m.snapshot()
    with pytest.raises(OutOfBlocksError):
        m.begin_recurrent_step(["a"])  # S(8) is kept: the step needs a fresh write block
    assert m.snapshot() == before
    m.remove_sequence("b")
    m.begin_recurrent_step(["a"])
    m.verify_integrity()


BAD_VALUES = {
    "str": "1",
    "none": None,
    "bool": True,
    "float": 1.0,
    "nan": float("nan"),
    "array0": np.array(1),
    "huge": 10**30,
    "negative": -1,
}


@pytest.mark.parametrize("cls", sorted(BAD_VALUES))
@pytest.mark.parametrize("where", ["request_ids", "request_id", "ends", "end"])
def test_bad_arguments_of_a_step_raise_typed_errors_and_change_nothing(where, cls):
    m = hybrid()
    m.add_sequence(Request("a", list(range(9)), max_new_tokens=4))
    v = BAD_VALUES[cls]
    call = {
        "request_ids": lambda: m.begin_recurrent_step(v),
        "request_id": lambda: m.begin_recurrent_step(["a", v]),
        "ends": lambda: m.begin_recurrent_step(["a"], v),
        "end": lambda: m.begin_recurrent_step(["a"], [v]),
    }[where]
    before = m.snapshot()
    if (where, cls) == ("ends", "none"):  # the default: each request's next chunk end
        assert call().ends.tolist() == [8]
        return
    with pytest.raises(InvalidArgumentError if where in ("ends", "end", "request_ids") else UnknownRequestError):
        call()
    assert m.snapshot() == before
    for query in (m.recurrent_next_chunk_end, m.recurrent_state_position):
        with pytest.raises(UnknownRequestError):
            query(v)
    assert m.begin_recurrent_step(["a"], [np.int64(8)]).ends.tolist() == [8]  # a numpy integer is an int


def test_a_batch_that_runs_out_of_state_blocks_changes_nothing():
    m = hybrid(primary_blocks={R: 3, ATTN: 32})
    m.add_sequences([Request("a", list(range(6)), max_new_tokens=4), Request("b", list(range(9)), max_new_tokens=4)])
    m.set_context_position("a", 0)
    m.set_context_position("b", 0)
    m.begin_recurrent_step(["a", "b"], [4, 4])  # each from the zero state into its admission block
    m.set_context_position("a", 4)
    m.set_context_position("b", 4)
    # settling makes S(4) live in each write block: both rows need a fresh one, one is free
    assert m.needed_blocks_one_step_many(["a", "b"], False, R).tolist() == [1, 1]
    before = m.snapshot()
    with pytest.raises(OutOfBlocksError):
        m.begin_recurrent_step(["a", "b"])
    assert m.snapshot() == before
    m.begin_recurrent_step(["a"])
    m.verify_integrity()


# --------------------------------------------------------------------------- rewinds
def test_a_rewound_step_is_dropped_and_the_state_stays_where_it_was():
    m = hybrid()
    m.add_sequence(Request("a", list(range(10)), max_new_tokens=20, num_draft_tokens=3))
    prefill(m, "a")
    m.add_token("a", 1)
    m.begin_recurrent_step(["a"])
    m.add_token("a", 2)
    assert m.recurrent_state_position("a") == 11
    for d in (3, 4, 5):
        m.add_token("a", d)  # drafts
    s = m.begin_recurrent_step(["a"])  # the verify step covers the drafts
    assert (int(s.starts[0]), int(s.ends[0])) == (11, 15)
    m.rewind("a", 2)  # one draft accepted
    m.verify_integrity()
    m.add_token("a", 9)  # the bonus token
    assert m.recurrent_state_position("a") == 11  # the verify step's state included rejected drafts
    s2 = m.begin_recurrent_step(["a"])
    assert (int(s2.starts[0]), int(s2.ends[0])) == (11, 14) and s2.read_slots[0] == s.read_slots[0]
    m.verify_integrity()
    # all drafts accepted: the step counts
    for d in (3, 4, 5):
        m.add_token("a", d)
    m.begin_recurrent_step(["a"], [14 + 3])
    m.add_token("a", 6)
    assert m.recurrent_state_position("a") == 17
    m.begin_recurrent_step(["a"])  # settles S(17)
    before = m.snapshot()
    with pytest.raises(InvalidRequestError):
        m.rewind("a", 2)  # below the state's position
    assert m.snapshot() == before
    m.rewind("a", 1)  # drops the begun step only
    assert m.recurrent_state_position("a") == 17
    m.verify_integrity()


def test_reuse_off_cannot_rewind_a_begun_in_place_step():
    m = hybrid(enable_block_reuse=False)
    m.add_sequence(Request("a", list(range(5)), max_new_tokens=20, num_draft_tokens=2))
    prefill(m, "a")
    m.add_token("a", 1)
    m.add_token("a", 2)
    m.begin_recurrent_step(["a"])
    before = m.snapshot()
    with pytest.raises(InvalidRequestError):
        m.rewind("a", 1)
    assert m.snapshot() == before


# --------------------------------------------------------------------------- pins, offload, events
def test_pinned_snapshots_outlive_their_request():
    m = hybrid()
    m.add_sequence(Request("a", list(range(17)), max_new_tokens=4))
    prefill(m, "a")
    m.add_token("a", 1)
    ids = m.store_blocks_for_reuse("a", pin=True)
    assert isinstance(ids, dict) and set(ids) == {R, ATTN}
    m.remove_sequence("a")
    for b in ids[R]:
        assert m.block(b, R).pin_count == 1
    m.unpin_blocks({R: ids[R], ATTN: ids[ATTN]})
    assert m.num_allocated_blocks(R) == 0
    m.verify_integrity()


def test_state_blocks_offload_and_onboard_in_their_own_pool():
    m = hybrid(primary_blocks={R: 4, ATTN: 32}, secondary_blocks={R: 4, ATTN: 0})
    rec_pool = m.config.window_pools[R][0]
    m.add_sequence(Request("a", list(range(17)), max_new_tokens=4))
    finish(m, "a")
    snaps = sorted(m.inspector.cached_block_ids(R))
    assert len(snaps) == 2  # S(8), S(16)
    m.take_transfers()
    # four more requests fill the primary pool: the cached snapshots are offloaded
    others = ("w", "x", "y", "z")
    for rid in others:
        m.add_sequence(Request(rid, [900 + ord(rid)] * 3, max_new_tokens=2))
    for rid in others:
        prefill(m, rid, chunked=False)
    plan = m.take_transfers()
    kinds = [TransferKind(int(k)) for k in plan.kind]
    assert kinds.count(TransferKind.OFFLOAD) == 2 and set(plan.pool.tolist()) == {rec_pool}
    assert all(m.block(b, R).level == 1 for b in snaps)
    for rid in others:
        m.remove_sequence(rid, store_for_reuse=False)
    n = m.add_sequence(Request("b", list(range(17)) + [5], max_new_tokens=2))
    assert n == 16
    plan = m.take_transfers()
    onboards = [TransferKind(k) for k, p in zip(plan.kind.tolist(), plan.pool.tolist(), strict=True) if p == rec_pool]
    assert onboards.count(TransferKind.ONBOARD) == 2  # S(8) and S(16) come back
    assert all(m.block(b, R).level == 0 for b in snaps)
    m.verify_integrity()


def test_a_failed_onboard_of_a_snapshot_readmits_the_request_that_reused_it():
    m = hybrid(primary_blocks={R: 4, ATTN: 32}, secondary_blocks={R: 4, ATTN: 0})
    m.add_sequence(Request("a", list(range(17)), max_new_tokens=4))
    finish(m, "a")
    snaps = m.inspector.cached_block_ids(R)
    others = ("w", "x", "y", "z")
    for rid in others:
        m.add_sequence(Request(rid, [900 + ord(rid)] * 3, max_new_tokens=2))
    for rid in others:
        m.remove_sequence(rid, store_for_reuse=False)
    m.take_transfers()
    assert m.add_sequence(Request("b", list(range(17)) + [5], max_new_tokens=2)) == 16
    plan = m.take_transfers()
    failure = m.transfers_failed(plan)
    # the state the request would read is gone: it cannot recompute in place
    assert "b" in failure.readmit and failure.recompute_from["b"] < 16
    assert not m.inspector.cached_block_ids(R) & snaps
    m.verify_integrity()
    m.remove_sequence("b")  # stores nothing it did not compute
    assert not m.inspector.cached_block_ids(R)
    assert m.add_sequence(Request("c", list(range(17)) + [5], max_new_tokens=2)) == 0
    m.verify_integrity()


def event_mirror(events, window: int) -> set:
    held: set = set()
    for ev in events:
        if ev.window_size != window:
            continue
        if isinstance(ev.data, StoredData):
            held.update(b.block_hash for b in ev.data.blocks)
        elif isinstance(ev.data, RemovedData):
            held.difference_update(ev.data.block_hashes)
    return held


def test_events_hash_snapshots_like_the_attention_blocks_at_their_positions():
    m = hybrid(event_buffer_max_size=1000)
    m.add_sequence(Request("a", list(range(23)), max_new_tokens=4))
    finish(m, "a")
    m.flush_iteration_events()
    events = m.get_latest_events()
    rec, attn = event_mirror(events, R), event_mirror(events, ATTN)
    assert len(rec) == 3 and rec <= attn
    assert rec == {m.inspector.block_hash(b, R) for b in m.inspector.cached_block_ids(R)}
    attn_by_depth = {
        len(m.inspector.cached_path(b, ATTN)): m.inspector.block_hash(b, ATTN) for b in m.inspector.cached_block_ids(ATTN)
    }
    for ev in events:
        if ev.window_size == R and isinstance(ev.data, StoredData):
            first = ev.data.blocks[0].block_hash
            depth = next(d for d, h in attn_by_depth.items() if h == first)
            # chained across the placeholder before it, as the attention window's block there
            assert ev.data.parent_hash == attn_by_depth[depth - 1]


# --------------------------------------------------------------------------- integrity
def test_integrity_catches_a_real_block_between_snapshots_and_a_shared_write_block():
    m = hybrid()
    m.add_sequence(Request("a", list(range(23)), max_new_tokens=4))
    prefill(m, "a")
    m.add_token("a", 1)
    m.begin_recurrent_step(["a"])
    m.verify_integrity()
    wm = m._bm.windows[0]
    sw = m._seq("a").windows[0]
    snap = sw.blocks[0][1]
    sw.set_block(0, 0, snap)  # a real block where no snapshot point is
    with pytest.raises(IntegrityError):
        m.verify_integrity()
    sw.set_block(0, 0, P)
    m.verify_integrity()
    write = sw.state.write
    sw.state.write = snap  # the next step would write a snapshot
    with pytest.raises(IntegrityError):
        m.verify_integrity()
    sw.state.write = write
    wm.slot_table.set(sw, 0, 2, 3)  # a placeholder shown as a real slot
    with pytest.raises(IntegrityError):
        m.verify_integrity()


# --------------------------------------------------------------------------- random driver
class StateModel:
    """What every slot of the recurrent pool holds: the tokens whose state it is (None:
    undefined), in primary and secondary memory; replays transfer plans."""

    def __init__(self, config: CacheConfig) -> None:
        self.pool = config.window_pools[R][0]
        spec = config.pools[self.pool]
        self.primary: list = [None] * spec.num_slots
        self.secondary: list = [None] * spec.secondary_blocks

    def apply(self, plan) -> None:
        for kind, pool, src, dst in zip(
            plan.kind.tolist(), plan.pool.tolist(), plan.src.tolist(), plan.dst.tolist(), strict=True
        ):
            if pool != self.pool:
                continue
            k = TransferKind(kind)
            if k is TransferKind.OFFLOAD:
                self.secondary[dst] = self.primary[src]
            elif k is TransferKind.ONBOARD:
                self.primary[dst] = self.secondary[src]
            else:
                self.primary[dst] = self.primary[src]


def check_cached_states(m: KVCacheManager, model: StateModel) -> None:
    """Every cached state block holds the state of the tokens its tree position stands for:
    a snapshot is never written after it was kept."""
    for b in m.inspector.cached_block_ids(R):
        info = m.block(b, R)
        tokens = tuple(t for key in m.inspector.cached_path(b, R) for t in key.tokens)
        held = (model.primary if info.level == 0 else model.secondary)[info.slot]
        assert held == tokens, (b, held, tokens)


@pytest.mark.parametrize("seed,reuse", [(0, True), (1, True), (2, True), (3, False)])
def test_random_hybrid_workload_keeps_every_state_where_the_model_says(seed, reuse):
    """Requests sharing prefixes, chunked prefill, decode with drafts and rewinds, removals,
    offloads and onboards; after every operation: integrity, every cached snapshot holds the
    state of its tokens, and the events mirror the cached snapshots. With reuse off (in
    place, no drafts) every step reads and writes one slot."""
    rng = random.Random(seed)
    m = hybrid(
        primary_blocks={R: 24, ATTN: 48},
        secondary_blocks={R: 6, ATTN: 6},
        event_buffer_max_size=10_000,
        enable_block_reuse=reuse,
    )
    model = StateModel(m.config)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    live: dict[str, list[int]] = {}  # request -> its tokens
    drafts: dict[str, int] = {}
    counter = 0
    events: list = []
    seen = {"reused": 0, "rewound": 0, "full": 0}

    def step(rid: str) -> None:
        s = m.begin_recurrent_step([rid])
        model.apply(m.take_transfers())
        start, end = int(s.starts[0]), int(s.ends[0])
        toks = tuple(live[rid][:start])
        if s.has_initial_state[0]:
            assert model.primary[int(s.read_slots[0])] == toks
        else:
            assert start == 0
        model.primary[int(s.write_slots[0])] = tuple(live[rid][:end])
        assert (s.read_slots[0] == s.write_slots[0]) == (not reuse and start > 0)

    for _ in range(160):
        op = rng.random()
        try:
            if op < 0.3 or not live:
                counter += 1
                rid = f"r{counter}"
                prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
                nd = rng.choice([0, 0, 2]) if reuse else 0
                n = m.add_sequence(Request(rid, prompt, max_new_tokens=30, num_draft_tokens=nd))
                model.apply(m.take_transfers())
                assert n % TPB == 0 and m.recurrent_state_position(rid) == n
                seen["reused"] += n > 0
                live[rid], drafts[rid] = list(prompt), nd
                m.set_context_position(rid, n)
                end = n
                while end < len(prompt):
                    end = m.recurrent_next_chunk_end(rid)
                    step(rid)
                    m.set_context_position(rid, end)
                m.add_token(rid, 7)
                live[rid].append(7)
            elif op < 0.85:
                rid = rng.choice(sorted(live))
                if len(live[rid]) + drafts[rid] + 1 >= ATTN:
                    continue
                k = drafts[rid]
                for _ in range(k):
                    t = rng.randrange(50)
                    m.add_token(rid, t)
                    live[rid].append(t)
                step(rid)
                if k:
                    rejected = rng.randrange(k + 1)
                    if rejected:
                        seen["rewound"] += 1
                        m.rewind(rid, rejected)
                        del live[rid][-rejected:]
                t = rng.randrange(50)
                if rng.random() < 0.5:
                    m.add_token(rid, t)
                else:
                    m.add_tokens([rid], [t])
                live[rid].append(t)
                if rng.random() < 0.3:
                    m.store_new_block(rid)
                    model.apply(m.take_transfers())
            else:
                rid = rng.choice(sorted(live))
                m.remove_sequence(rid)
                del live[rid]
        except OutOfBlocksError:
            seen["full"] += 1
            rid = rng.choice(sorted(live))
            m.remove_sequence(rid, store_for_reuse=False)
            del live[rid]
        model.apply(m.take_transfers())
        m.verify_integrity()
        check_cached_states(m, model)
        m.flush_iteration_events()
        events.extend(m.get_latest_events())
        assert event_mirror(events, R) == {m.inspector.block_hash(b, R) for b in m.inspector.cached_block_ids(R)}
        for rid in live:
            assert len(chain(m, rid)) == len(m.block_ids(rid, ATTN)[0])
    assert counter > 20
    assert (seen["reused"] > 3 and seen["rewound"] > 3) if reuse else seen["reused"] == seen["rewound"] == 0
    assert np.all(m.block_table(sorted(live), R) >= 0)
