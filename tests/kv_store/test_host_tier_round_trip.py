"""The path the engine will take, on numpy host pools: block hashes -> store keys, write host
blocks through the worker, restart, look a longer prompt up, restore into other host slots."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kvjax.config import CacheConfig
from kvjax.kv_store import (
    FileStore,
    MemoryStore,
    PrefetchPolicy,
    StoreBufferError,
    StoreWorker,
    WritePolicy,
    block_store_keys,
    namespace_for_pool,
)
from kvjax.ledger.block_hashing import prompt_block_hashes

CFG = CacheConfig(tokens_per_block=4, num_layers=2, num_kv_heads=2, head_dim=8, max_seq_len=128,
                  primary_blocks=8, secondary_blocks=16)
POOL = CFG.pools[0]


def host_pool(seed: int) -> np.ndarray:
    """A block_first secondary pool: [slots, layers, K/V, kv_heads, tokens_per_block, head_dim]."""
    shape = (POOL.secondary_blocks, POOL.num_layers, 2, POOL.num_kv_heads, CFG.tokens_per_block, POOL.head_dim)
    return np.random.default_rng(seed).standard_normal(shape).astype(ml_dtypes.bfloat16)


def test_write_through_then_restore_after_restart(tmp_path):
    ns = namespace_for_pool(CFG, POOL, model="tiny@seed0")
    prompt = list(range(100, 141))  # 41 tokens: 10 reusable full blocks
    keys = block_store_keys(ns, prompt_block_hashes(prompt, CFG.tokens_per_block))
    assert len(keys) == 10
    host = host_pool(0)
    slots = list(range(3, 13))  # where the ledger offloaded the blocks
    policy = WritePolicy("write_through")
    to_write = policy.on_host_stored(keys)
    assert to_write == keys
    store = FileStore(tmp_path, 1 << 20)
    worker = StoreWorker(store, num_threads=2)
    h = worker.put(to_write, [host[s] for s in slots])  # host slots stay pinned until polled
    (r,), _ = worker.wait([h], 30)
    policy.on_store_result(r.keys, r.ok)
    assert r.succeeded
    worker.close()
    store.close()

    # a restarted engine, same model and geometry: a longer prompt sharing the first 7 blocks
    store = FileStore(tmp_path, 1 << 20)
    worker = StoreWorker(store, num_threads=2)
    prompt2 = prompt[:28] + list(range(900, 930))
    keys2 = block_store_keys(ns, prompt_block_hashes(prompt2, CFG.tokens_per_block))
    prefetch = PrefetchPolicy("wait_complete", tokens_per_block=CFG.tokens_per_block, min_hit_tokens=16)
    assert prefetch.should_consult(len(prompt2) - 1)
    (lk,), _ = worker.wait([worker.lookup(keys2)], 30)
    assert lk.hits == 7 and prefetch.should_fetch(lk.hits)
    host2 = np.zeros_like(host)
    dst = [0, 5, 1, 9, 2, 8, 4]  # any free slots
    (g,), _ = worker.wait([worker.get_into(keys2[: lk.hits], [host2[s] for s in dst])], 30)
    assert g.ok_prefix() == 7
    for i, s in enumerate(dst):
        assert host2[s].tobytes() == host[slots[i]].tobytes()
    worker.close()
    store.close()


def test_other_geometry_or_tenant_misses(tmp_path):
    ns = namespace_for_pool(CFG, POOL, model="tiny@seed0")
    prompt = list(range(41))
    host = host_pool(1)
    store = FileStore(tmp_path, 1 << 20)
    keys = block_store_keys(ns, prompt_block_hashes(prompt, 4))
    assert all(store.batch_put(keys, [host[i] for i in range(10)]))
    other_model = namespace_for_pool(CFG, POOL, model="tiny@seed1")
    assert store.batch_exists(block_store_keys(other_model, prompt_block_hashes(prompt, 4))) == 0
    salted = block_store_keys(ns, prompt_block_hashes(prompt, 4, cache_salt="tenant-b"))
    assert store.batch_exists(salted) == 0
    store.close()


def test_layer_first_blocks_must_be_staged():
    """In layer_first pools a block is strided across layers: a store cannot fill it in place,
    so the view is refused (the engine gathers such blocks into a contiguous staging buffer)."""
    host = np.zeros((2, 16, 2, 2, 4, 8), np.float32)  # [layers, slots, ...]
    store = MemoryStore(1 << 20)
    store.batch_put(["a"], [host[:, 3].copy()])
    with pytest.raises(StoreBufferError, match="C-contiguous"):
        store.batch_get_into(["a"], [host[:, 3]])
    staging = np.empty_like(host[:, 3])
    assert store.batch_get_into(["a"], [staging]) == [True]
