"""The router hashes prompts exactly as the replicas' ledgers do: its prefix match over an index
fed by a replica's events equals what that replica's admission would reuse."""
import random

import pytest
from kv_helpers import RandomDriver, small_config

from kvjax import KVCacheManager, Request
from kvjax.kv_events import BlockStored, LedgerEventAdapter, decode_batch, encode_batch
from kvjax.ledger.block_hashing import (
    SHA256_ROOT_HASH,
    prompt_block_hashes,
    sha256_block_hash,
    trtllm64_block_hash,
)
from kvjax.ledger.block_key import BlockKey, cache_salt_id
from kvjax.router import KVAwarePolicy, RoundRobinPolicy, Router


@pytest.mark.parametrize("kind, block_hash, root", [("sha256", sha256_block_hash, SHA256_ROOT_HASH),
                                                     ("trtllm64", trtllm64_block_hash, 0)])
def test_prompt_block_hashes_chain(kind, block_hash, root):
    toks = list(range(1, 14))  # 13 tokens, 4 per block
    salt = cache_salt_id("t")
    h0 = block_hash(BlockKey(tuple(toks[0:4]), None, 3, salt), root)
    h1 = block_hash(BlockKey(tuple(toks[4:8]), None, 3, salt), h0)
    h2 = block_hash(BlockKey(tuple(toks[8:12]), None, 3, salt), h1)
    assert prompt_block_hashes(toks, 4, lora_task_id=3, cache_salt="t", hash_kind=kind) == [h0, h1, h2]
    # the last token is recomputed by admission: a 12-token prompt can reuse 2 blocks only
    assert prompt_block_hashes(toks[:12], 4, lora_task_id=3, cache_salt="t", hash_kind=kind) == [h0, h1]
    assert prompt_block_hashes(toks[:12], 4, lora_task_id=3, cache_salt="t", for_reuse=False, hash_kind=kind) == [h0, h1, h2]
    assert prompt_block_hashes(toks[:3], 4) == [] and prompt_block_hashes([], 4) == []
    assert prompt_block_hashes(toks, 4) != prompt_block_hashes(toks, 4, cache_salt="t")
    with pytest.raises(ValueError, match="hash_kind"):
        prompt_block_hashes(toks, 4, hash_kind="md5")
    with pytest.raises(ValueError, match="tokens_per_block"):
        prompt_block_hashes(toks, 0)


def test_hashes_equal_the_ledgers_published_ones():
    cfg = small_config()
    led, ad = KVCacheManager(cfg), LedgerEventAdapter(cfg)
    prompt = list(range(5, 30))
    led.add_sequence(Request("a", prompt, lora_task_id=2, cache_salt="x"))
    led.store_context_blocks("a")
    led.flush_iteration_events()
    hashes = [h for e in ad.convert(led.get_latest_events()).events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert hashes == prompt_block_hashes(prompt, 4, lora_task_id=2, cache_salt="x", for_reuse=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_router_match_equals_the_replicas_reuse(seed):
    """After a seeded serving run, for fresh requests (shared prefixes, random suffix, LoRA and
    salt) the index's match is exactly the number of full blocks the ledger would reuse."""
    cfg = small_config(primary_blocks=20, secondary_blocks=10)
    led, ad = KVCacheManager(cfg), LedgerEventAdapter(cfg)
    router = Router(["r"], RoundRobinPolicy(), tokens_per_block=cfg.tokens_per_block)
    drv = RandomDriver(led, seed)
    rng = random.Random(100 + seed)
    checked = nonzero = 0
    for step in range(200):
        drv.step()
        batch = ad.convert(led.get_latest_events())
        if batch is not None:
            router.index.apply("r", decode_batch(encode_batch(batch)))
        if step % 5:
            continue
        for _ in range(4):
            prompt = list(rng.choice(drv.prefixes))[: rng.randrange(1, 30)] + [
                rng.randrange(1, 50) for _ in range(rng.randrange(0, 6))
            ]
            lora, salt = rng.choice([None, 3]), rng.choice([None, "t1"])
            want = led.analyze_prefix_reuse(Request("probe", prompt, lora_task_id=lora, cache_salt=salt)).reusable_blocks_all
            decision = router.route(prompt, lora_task_id=lora, cache_salt=salt)
            router.finished("r")
            assert decision.match.blocks == want, (step, prompt, lora, salt)
            assert decision.num_hashes == (len(prompt) - 1) // 4
            checked += 1
            nonzero += want > 0
    assert checked == 160 and nonzero > 40


def test_router_loads_and_availability():
    router = Router(["a", "b"], KVAwarePolicy(), tokens_per_block=4)
    router.index.apply("b", decode_batch(encode_batch(_stored(prompt_block_hashes(list(range(1, 20)), 4)))))
    d = router.route(list(range(1, 20)))
    assert d.replica == "b" and d.match.blocks == 4 and router.loads == {"a": 0, "b": 1}
    router.finished("b")
    with pytest.raises(ValueError):
        router.finished("b")
    router.set_available("b", False)  # unreachable: out of routing, its blocks forgotten
    assert router.route(list(range(1, 20))).replica == "a" and router.index.num_blocks("b") == 0
    router.set_available("a", False)
    with pytest.raises(RuntimeError, match="no replica"):
        router.route([1, 2])
    with pytest.raises(ValueError):
        router.set_available("zzz", True)
    with pytest.raises(ValueError):
        Router([], KVAwarePolicy(), tokens_per_block=4)
    with pytest.raises(ValueError):
        Router(["a", "a"], KVAwarePolicy(), tokens_per_block=4)
    with pytest.raises(ValueError):
        Router(["a"], KVAwarePolicy(), tokens_per_block=4, hash_kind="sha1")


def _stored(hashes):
    from kvjax.kv_events import KVEventBatch

    return KVEventBatch(0.0, [BlockStored(hashes, None, [0] * 4 * len(hashes), 4, None, "GPU", None)])


def test_router_routes_before_it_knows_the_block_size():
    """A front that learns tokens_per_block from the replicas may route first: no prompt is
    hashed, every replica matches nothing, and the load still counts."""
    router = Router(["a", "b"], KVAwarePolicy(), tokens_per_block=None)
    decision = router.route([1, 2, 3, 4, 5])
    assert decision.num_hashes == 0 and decision.match.blocks == 0
    assert router.loads[decision.replica] == 1


def test_events_and_router_never_import_jax():
    """A router front or an event consumer must not pay for JAX (the simulation does: it
    drives the engine's scheduler)."""
    import subprocess
    import sys

    code = """
import sys
from kvjax import CacheConfig, KVCacheManager, Request
from kvjax.kv_events import LedgerEventAdapter, decode_batch, encode_batch
from kvjax.router import KVAwarePolicy, Router
cfg = CacheConfig(tokens_per_block=4, num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=64,
                  primary_blocks=8, event_buffer_max_size=64)
led, ad = KVCacheManager(cfg), LedgerEventAdapter(cfg)
led.add_sequence(Request("a", list(range(1, 11))))
led.store_context_blocks("a")
led.flush_iteration_events()
router = Router(["r"], KVAwarePolicy(), tokens_per_block=4)
router.index.apply("r", decode_batch(encode_batch(ad.convert(led.get_latest_events()))))
assert router.route(list(range(1, 11))).match.blocks == 2
assert "jax" not in sys.modules, sorted(k for k in sys.modules if k.startswith("jax"))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
