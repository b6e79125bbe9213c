"""Ledger events -> wire events: each mapping of docs/kv_events.md, and a seeded random serving
run whose wire stream rebuilds exactly the full blocks the ledger holds, per tier and group."""

import pytest
from kv_helpers import RandomDriver, index_view, ledger_view, small_config

from kvjax import KVCacheManager, Request, RetentionConfig, TokenRangeRetention
from kvjax.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LedgerEventAdapter,
    decode_batch,
    encode_batch,
)
from kvjax.ledger.events import KVCacheEvent, RemovedData, StoredBlock, StoredData, UpdatedData
from kvjax.router import PrefixIndex


def events_of(ledger):
    ledger.flush_iteration_events()
    return ledger.get_latest_events()


def test_created_is_all_blocks_cleared_and_a_run_is_one_block_stored():
    cfg = small_config()
    led, ad = KVCacheManager(cfg), LedgerEventAdapter(cfg, data_parallel_rank=2)
    led.add_sequence(Request("a", list(range(1, 11)), lora_task_id=7))  # 10 tokens: 2 full blocks + 2
    led.store_context_blocks("a")
    batch = ad.convert(events_of(led), ts=5.0)
    assert batch.ts == 5.0 and batch.data_parallel_rank == 2
    cleared, stored = batch.events
    assert cleared == AllBlocksCleared()
    h = [led.inspector.block_hash(b) for b in led.inspector.cached_block_ids()]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(1, 9)) and stored.block_size == 4
    assert stored.lora_id == 7 and stored.medium == "GPU" and stored.group_idx == 0
    assert stored.kv_cache_spec_kind == "full_attention" and stored.kv_cache_spec_sliding_window is None
    assert set(stored.block_hashes) == set(h) and len(stored.block_hashes) == 2
    assert ad.convert([]) is None


def test_partial_blocks_are_never_announced():
    cfg = small_config()
    led, ad = KVCacheManager(cfg), LedgerEventAdapter(cfg)
    led.add_sequence(Request("a", list(range(1, 11)), max_new_tokens=4))
    led.add_token("a", 50)
    led.remove_sequence("a")  # stores 2 full blocks + a partial one (tokens 9, 10)
    evs = events_of(led)
    assert any(isinstance(e.data, StoredData) and len(e.data.blocks[-1].tokens) < 4 for e in evs)
    stored = [e for e in ad.convert(evs).events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2]
    # a new request regrows the partial block in place: its old key leaves the tree silently
    led.add_sequence(Request("b", list(range(1, 13)) + [60]))
    led.store_context_blocks("b")
    out = ad.convert(events_of(led)).events
    assert not any(isinstance(e, BlockRemoved) for e in out)
    assert [len(e.block_hashes) for e in out if isinstance(e, BlockStored)] == [1]
    assert ad.unknown_hashes == 0


def test_offload_and_onboard_move_a_block_between_media():
    cfg = small_config(primary_blocks=4, secondary_blocks=4)
    led, ad = KVCacheManager(cfg), LedgerEventAdapter(cfg)
    keep = RetentionConfig((TokenRangeRetention(0, None, 80),))
    led.add_sequence(Request("a", list(range(1, 10)), retention=keep))  # 2 full blocks + 1
    led.remove_sequence("a")
    first = ad.convert(events_of(led)).events
    (stored_a,) = [e for e in first if isinstance(e, BlockStored)]
    led.add_sequence(Request("b", list(range(20, 36))))  # 4 new blocks: a's 3 blocks leave the GPU
    out = ad.convert(events_of(led)).events
    moved = [e for e in out if isinstance(e, (BlockRemoved, BlockStored))]
    # each offloaded full block: removed from the GPU, stored on the CPU with its chain intact
    removed_gpu = [h for e in moved if isinstance(e, BlockRemoved) and e.medium == "GPU" for h in e.block_hashes]
    stored_cpu = [e for e in moved if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sorted(removed_gpu) == sorted(stored_a.block_hashes)
    chain = {e.block_hashes[0]: (e.parent_block_hash, e.token_ids) for e in stored_cpu}
    h0, h1 = stored_a.block_hashes
    assert chain == {h0: (None, [1, 2, 3, 4]), h1: (h0, [5, 6, 7, 8])}
    led.remove_sequence("b")
    led.add_sequence(Request("c", list(range(1, 10))))  # reuses a's blocks: onboarded
    out = ad.convert(events_of(led)).events
    back = [e for e in out if isinstance(e, BlockStored) and e.medium == "GPU" and e.block_hashes[0] in (h0, h1)]
    assert {e.block_hashes[0] for e in back} == {h0, h1}
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" and h0 in e.block_hashes for e in out)


def test_priority_updates_are_not_on_the_wire():
    cfg = small_config()
    ad = LedgerEventAdapter(cfg)
    blk = StoredBlock(11, (1, 2, 3, 4), None, 0, 35)
    ad.convert([KVCacheEvent(0, 96, StoredData(None, (blk,)))])
    assert ad.convert([KVCacheEvent(1, 96, UpdatedData(11, priority=(35, 80)))]) is None
    assert ad.convert([KVCacheEvent(2, 96, UpdatedData(999, cache_level=(0, 1)))]) is None
    assert ad.unknown_hashes == 1


def test_a_gap_in_ledger_event_ids_clears_consumers():
    cfg = small_config()
    ad = LedgerEventAdapter(cfg)
    blk = StoredBlock(11, (1, 2, 3, 4), None, 0, 35)
    ad.convert([KVCacheEvent(0, 96, StoredData(None, (blk,)))])
    out = ad.convert([KVCacheEvent(5, 96, RemovedData((11,)))]).events  # ids 1-4 were dropped
    assert out == [AllBlocksCleared()] and ad.ledger_gaps == 1 and ad.num_known_blocks == 0


def test_sliding_window_groups():
    cfg = small_config(attention_windows=(8, 96), num_layers=2, primary_blocks=24, secondary_blocks=0)
    led, ad = KVCacheManager(cfg), LedgerEventAdapter(cfg)
    led.add_sequence(Request("a", list(range(1, 14))))
    led.store_context_blocks("a")
    stored = [e for e in ad.convert(events_of(led)).events if isinstance(e, BlockStored)]
    by_group = {e.group_idx: e for e in stored}
    assert by_group[0].kv_cache_spec_kind == "sliding_window" and by_group[0].kv_cache_spec_sliding_window == 8
    assert by_group[1].kv_cache_spec_kind == "full_attention"
    assert by_group[0].block_hashes == by_group[1].block_hashes  # one tree: same chain, two groups


def test_rejects_a_non_config():
    with pytest.raises(TypeError):
        LedgerEventAdapter({"tokens_per_block": 4})


@pytest.mark.parametrize(
    ("seed", "overrides"),
    [
        (0, {}),
        (1, {"primary_blocks": 14, "secondary_blocks": 6}),  # heavy eviction and offload
        (2, {"secondary_blocks": 0}),
        (3, {"attention_windows": (12, 96), "num_layers": 2, "primary_blocks": 30, "secondary_blocks": 8}),
    ],
)
def test_wire_stream_rebuilds_the_ledger_exactly(seed, overrides):
    cfg = small_config(**overrides)
    led = KVCacheManager(cfg)
    ad = LedgerEventAdapter(cfg)
    index = PrefixIndex()
    drv = RandomDriver(led, seed)
    groups = len(cfg.windows)
    seen_cpu = False
    for step in range(250):
        drv.step()
        batch = ad.convert(led.get_latest_events())
        if batch is not None:
            index.apply("r0", decode_batch(encode_batch(batch)))
        seen_cpu = seen_cpu or bool(index.blocks("r0", "CPU", group=groups - 1))
        if step % 10 == 0:
            assert index_view(index, "r0", groups) == ledger_view(led), f"step {step}"
            led.verify_integrity()
    drv.finish_all()
    batch = ad.convert(led.get_latest_events())
    if batch is not None:
        index.apply("r0", decode_batch(encode_batch(batch)))
    truth = ledger_view(led)
    assert index_view(index, "r0", groups) == truth
    assert sum(len(v) for v in truth.values()) > 10  # the run did cache something
    stats = led.stats()
    if cfg.secondary_blocks_for(cfg.windows[-1]):  # the run moved blocks between the tiers
        assert stats.offloaded_blocks > 0 and stats.onboarded_blocks > 0 and seen_cpu
    assert stats.evicted_blocks > 0
    # the adapter remembers exactly the announced blocks: bounded by the pools
    assert ad.num_known_blocks == sum(len(v) for v in truth.values())
    assert ad.unknown_hashes == 0 and ad.ledger_gaps == 0


def test_bad_events_leave_the_adapter_as_it_was():
    cfg = small_config()
    ad = LedgerEventAdapter(cfg)
    good = KVCacheEvent(0, 96, StoredData(None, (StoredBlock(11, (1, 2, 3, 4), None, 0, 35),)))
    with pytest.raises(ValueError, match="window 5"):
        ad.convert([good, KVCacheEvent(1, 5, RemovedData((11,)))])
    with pytest.raises(TypeError):
        ad.convert([good, "event"])
    assert ad.num_known_blocks == 0
    assert [type(e).__name__ for e in ad.convert([good]).events] == ["BlockStored"]


def _eager(ev: KVCacheEvent) -> KVCacheEvent:
    """The same event with its Stored blocks built as records (the adapter's general path)."""
    if not isinstance(ev.data, StoredData):
        return ev
    return KVCacheEvent(ev.event_id, ev.window_size, StoredData(ev.data.parent_hash, ev.data.blocks))


@pytest.mark.parametrize(
    "overrides", [{}, {"primary_blocks": 14, "secondary_blocks": 6}, {"attention_windows": (12, 96), "num_layers": 2}]
)
def test_columns_convert_like_the_blocks_they_make(overrides):
    """The adapter reads the ledger's columnar Stored events without building their blocks:
    every batch it makes from them equals the one it makes from the same events' records."""
    cfg = small_config(**overrides)
    led = KVCacheManager(cfg)
    fast, slow = LedgerEventAdapter(cfg), LedgerEventAdapter(cfg)
    drv = RandomDriver(led, 5)
    columnar = 0
    for _ in range(150):
        drv.step()
        evs = led.get_latest_events()
        columnar += sum(isinstance(e.data, StoredData) and e.data.columns is not None for e in evs)
        a, b = fast.convert(evs, ts=1.0), slow.convert([_eager(e) for e in evs], ts=1.0)
        assert a == b
        assert fast._known == slow._known and fast._partial == slow._partial
    assert columnar > 20  # the run took the columns path often
