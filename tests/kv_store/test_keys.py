"""Store keys: every field that changes KV bytes changes the namespace; isolation keys ride in
the chained block hash."""
from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvjax.kv_store import KEY_PATTERN, StoreNamespace, block_store_key, block_store_keys
from kvjax.ledger.block_hashing import prompt_block_hashes

BASE = StoreNamespace(
    model="meta-llama/Llama-3.1-8B@0e9e39f", dtype="bfloat16", tokens_per_block=16, layers=tuple(range(32)),
    kv_heads=(0, 8), head_dim=128,
)

# one different value per field: each must give another digest
VARIANTS = {
    "model": "meta-llama/Llama-3.1-8B-Instruct@0e9e39f",
    "dtype": "float8_e4m3fn",
    "tokens_per_block": 32,
    "layers": tuple(range(16)),
    "kv_heads": (4, 8),
    "head_dim": 64,
    "layout": "layer_first",
    "kv_factor": 1,
    "hash_algorithm": "trtllm64",
    "extra": (("rope", "yarn-4x"),),
    "key_version": 2,
}


def test_every_field_has_a_variant():
    assert set(VARIANTS) == {f.name for f in dataclasses.fields(StoreNamespace)}


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_any_differing_field_gives_a_different_namespace(field):
    other = dataclasses.replace(BASE, **{field: VARIANTS[field]})
    assert other.digest() != BASE.digest()
    assert other.prefix() != BASE.prefix()


def test_digest_is_stable_and_deterministic():
    again = StoreNamespace(**{f.name: getattr(BASE, f.name) for f in dataclasses.fields(BASE)})
    assert again.digest() == BASE.digest()
    assert len(BASE.digest()) == 32 and int(BASE.digest(), 16) >= 0
    # pinned: a change to the canonical form silently orphans every stored block, so it must be deliberate
    assert BASE.digest() == hashlib.sha256(b"kvjax/kv-store-namespace\0" + BASE.canonical()).hexdigest()[:32]
    assert BASE.canonical().startswith(b'{"dtype":"bfloat16","extra":[],"hash_algorithm":"sha256"')


def test_key_format_uses_the_chained_block_hash():
    hashes = prompt_block_hashes(list(range(100)), 16)
    keys = block_store_keys(BASE, hashes)
    assert keys[0] == f"kvjax1-{BASE.digest()}-{hashes[0].hex()}" == block_store_key(BASE, hashes[0])
    assert all(KEY_PATTERN.fullmatch(k) for k in keys) and len(set(keys)) == len(keys)
    ns64 = dataclasses.replace(BASE, hash_algorithm="trtllm64")
    h64 = prompt_block_hashes(list(range(100)), 16, hash_kind="trtllm64")
    assert block_store_key(ns64, h64[0]) == f"kvjax1-{ns64.digest()}-{h64[0]:016x}"


def test_isolation_keys_are_folded_into_block_hashes():
    """LoRA id and cache salt change the chained hash itself (both formulas), so they need no
    namespace field: the same tokens under another adapter or salt never share a key."""
    tokens = list(range(40))
    for kind in ("sha256", "trtllm64"):
        ns = dataclasses.replace(BASE, hash_algorithm=kind)
        plain = block_store_keys(ns, prompt_block_hashes(tokens, 16, hash_kind=kind))
        lora = block_store_keys(ns, prompt_block_hashes(tokens, 16, hash_kind=kind, lora_task_id=3))
        salted = block_store_keys(ns, prompt_block_hashes(tokens, 16, hash_kind=kind, cache_salt="tenant-a"))
        for other in (lora, salted):
            assert not set(plain) & set(other)
        assert not set(lora) & set(salted)


def test_hash_of_the_wrong_formula_is_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        block_store_key(BASE, 12345)
    with pytest.raises(ValueError, match="32 bytes"):
        block_store_key(BASE, b"\0" * 8)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        block_store_key(dataclasses.replace(BASE, hash_algorithm="trtllm64"), b"\0" * 32)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        block_store_key(dataclasses.replace(BASE, hash_algorithm="trtllm64"), 1 << 64)


@pytest.mark.parametrize(
    "field,value",
    [("model", ""), ("dtype", 3), ("tokens_per_block", 0), ("tokens_per_block", True), ("layers", ()),
     ("layers", (3, 1)), ("layers", (1, 1)), ("layers", [0, 1]), ("kv_heads", (4, 4)), ("kv_heads", (0,)),
     ("head_dim", -1), ("layout", "page_first"), ("kv_factor", 3), ("hash_algorithm", "md5"),
     ("extra", (("b", "1"), ("a", "2"))), ("extra", (("a", "1"), ("a", "2"))), ("extra", (("a", 1),)),
     ("key_version", 0)],
)
def test_malformed_namespace_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(BASE, **{field: value})


def test_namespace_for_pool_reads_the_cache_config():
    from kvjax.config import CacheConfig
    from kvjax.kv_store import namespace_for_pool

    cfg = CacheConfig(tokens_per_block=16, num_layers=4, num_kv_heads=2, head_dim=8, max_seq_len=256,
                      primary_blocks=8, attention_windows=(64, 256))
    local, full = (namespace_for_pool(cfg, p, model="m") for p in cfg.pools)
    assert local.layers == (0, 2) and full.layers == (1, 3) and local.digest() != full.digest()
    assert (local.dtype, local.tokens_per_block, local.kv_heads, local.head_dim, local.layout, local.kv_factor,
            local.hash_algorithm) == ("bfloat16", 16, (0, 2), 8, "block_first", 2, "sha256")
    rank1 = namespace_for_pool(cfg, cfg.pools[0], model="m", kv_heads=(1, 2))
    assert rank1.kv_heads == (1, 2) and rank1.digest() != local.digest()
    # pool sizes do not change a block's bytes: a bigger cache shares the namespace
    bigger = CacheConfig(tokens_per_block=16, num_layers=4, num_kv_heads=2, head_dim=8, max_seq_len=256,
                         primary_blocks=64, secondary_blocks=32, attention_windows=(64, 256))
    assert namespace_for_pool(bigger, bigger.pools[0], model="m") == local
    konly = CacheConfig(tokens_per_block=16, num_layers=4, num_kv_heads=2, head_dim=8, max_seq_len=256,
                        primary_blocks=8, attention_windows=(64, 256), cache_type="self_k_only", event_hash="trtllm64")
    k = namespace_for_pool(konly, konly.pools[0], model="m", extra=(("quant", "none"),))
    assert k.kv_factor == 1 and k.hash_algorithm == "trtllm64"
    assert k.extra == (("cache_type", "self_k_only"), ("quant", "none"))
    with pytest.raises(ValueError, match="exceeds"):
        namespace_for_pool(cfg, cfg.pools[0], model="m", kv_heads=(0, 3))
    with pytest.raises(ValueError, match="config.pools"):
        namespace_for_pool(cfg, bigger.pools[0], model="m")
