"""BlockKey: equality (partial matching is tested on the tree), TensorRT-LLM's chained 64-bit
block hash (`trtllm64_block_hash`, TensorRT-LLM's BlockKeyHasher) and cache-salt ids. The
default SHA-256 hash is tested in test_event_hashes.py."""
import ctypes
import subprocess
import sys

import pytest

from kvjax.ledger.block_hashing import trtllm64_block_hash as block_hash
from kvjax.ledger.block_key import BlockKey, MmKey, cache_salt_id

MM_A = MmKey(bytes(range(32)), 0)
MM_B = MmKey(bytes(range(1, 33)), 0)


# --------------------------------------------------------------------------- an independent reference
# Transcribed from TensorRT-LLM's BlockKeyHasher with ctypes fixed-width integers (a different route from the
# ledger's masks): hash32Mix adds the golden constant in 32 bits before widening (bit-exactness
# note), hash64Mix works in 64 bits.
def _u32(x):
    return ctypes.c_uint32(x).value


def _u64(x):
    return ctypes.c_uint64(x).value


def _ref_mix32(a, seed):
    a = _u32(a)
    a = _u32(((a >> 16) ^ a) * 0x45D9F3B)
    a = _u32(((a >> 16) ^ a) * 0x45D9F3B)
    a = (a >> 16) ^ a
    value = _u32(a + 0x9E3779B9)
    return seed ^ _u64(value + _u64(seed << 6) + (seed >> 2))


def _ref_mix64(c, seed):
    c = _u64(c)
    c = _u64((c ^ (c >> 30)) * 0xBF58476D1CE4E5B9)
    c = _u64((c ^ (c >> 27)) * 0x94D049BB133111EB)
    c = c ^ (c >> 31)
    return seed ^ _u64(c + 0x9E3779B9 + _u64(seed << 6) + (seed >> 2))


def _ref_hash(tokens, parent, extra=None, lora=None, salt=None, mm=()):
    seed = _u64(len(tokens) ^ _u64(parent * 0xBF58476D1CE4E5B9))
    if parent == 0 and salt is not None:  # only the first block mixes the salt
        seed = _ref_mix64(salt, seed)
    for i, t in enumerate(tokens):
        seed = _ref_mix32(t, seed)
        if extra is not None:
            seed = _ref_mix64(extra[i], seed)  # interleaved, per token
    if lora is not None:
        seed = _ref_mix64(lora, seed)
    for h, off in mm:
        h = h.ljust(32, b"\0")
        for i in range(8):
            word = h[4 * i] | h[4 * i + 1] << 8 | h[4 * i + 2] << 16 | h[4 * i + 3] << 24  # little-endian words
            seed = _ref_mix32(word, seed)
        seed = _ref_mix64(off, seed)
    return seed


# --------------------------------------------------------------------------- equality and matching
def test_equality_compares_every_field():
    base = BlockKey((1, 2, 3, 4))
    assert base == BlockKey((1, 2, 3, 4)) and hash(base) == hash(BlockKey((1, 2, 3, 4)))
    variants = [
        BlockKey((1, 2, 3, 5)),
        BlockKey((1, 2, 3)),
        BlockKey((1, 2, 3, 4), extra_ids=(0, 0, 0, 0)),
        BlockKey((1, 2, 3, 4), lora_task_id=1),
        BlockKey((1, 2, 3, 4), cache_salt_id=9),
        BlockKey((1, 2, 3, 4), mm_keys=(MM_A,)),
    ]
    for v in variants:
        assert v != base
    assert BlockKey((1,), extra_ids=(1,)) != BlockKey((1,), extra_ids=(2,))
    assert BlockKey((1,), mm_keys=(MM_A,)) != BlockKey((1,), mm_keys=(MmKey(MM_A.hash, 1),))  # start offset counts


# --------------------------------------------------------------------------- hashing
KEYS = [
    BlockKey((1, 2, 3, 4)),
    BlockKey(()),
    BlockKey((0,)),
    BlockKey((0, 0)),
    BlockKey((2**31 - 1, 7, 2**20, 5)),
    BlockKey((1, 2), extra_ids=(7, 2**63 + 5)),
    BlockKey((1, 2, 3, 4), lora_task_id=2**64 - 1),
    BlockKey((1, 2, 3, 4), cache_salt_id=cache_salt_id("tenant")),
    BlockKey((1, 2), mm_keys=(MM_A, MmKey(b"\x01\x02\x03", 5))),
    BlockKey((9, 8, 7), extra_ids=(1, 2, 3), lora_task_id=4, cache_salt_id=5, mm_keys=(MM_B,)),
]


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("parent", [0, 1, 0xDEADBEEF, 2**64 - 1])
def test_hash_matches_reference_transcription(key, parent):
    expected = _ref_hash(key.tokens, parent, key.extra_ids, key.lora_task_id, key.cache_salt_id, key.mm_keys)
    got = block_hash(key, parent)
    assert got == expected
    assert 0 <= got < 2**64


def test_hash_known_values_pin_cross_process_stability():
    # Fixed numbers: any change of the algorithm (or a per-process seed) breaks router compatibility.
    k0 = BlockKey((1, 2, 3, 4))
    h0 = block_hash(k0, 0)
    assert h0 == 924206229973855
    assert block_hash(BlockKey((5, 6, 7, 8)), h0) == 2728178455351807326
    full = BlockKey((1, 2), (7, 8), 3, cache_salt_id("abc"), (MmKey(bytes(range(32)), 2),))
    assert block_hash(full, 0) == 10922247855723071077


def test_hash_stable_in_another_process():
    code = (
        "from kvjax.ledger.block_hashing import trtllm64_block_hash; from kvjax.ledger.block_key import BlockKey, cache_salt_id;"
        "print(trtllm64_block_hash(BlockKey((1,2,3,4), cache_salt_id=cache_salt_id('abc')), 0))"
    )
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert int(out.stdout) == block_hash(BlockKey((1, 2, 3, 4), cache_salt_id=cache_salt_id("abc")), 0)


def test_hash_chains_over_parents():
    k0, k1, k2 = BlockKey((1, 2, 3, 4)), BlockKey((5, 6, 7, 8)), BlockKey((9,))
    h0 = block_hash(k0, 0)
    h1 = block_hash(k1, h0)
    h2 = block_hash(k2, h1)
    assert len({h0, h1, h2}) == 3
    assert block_hash(k1, 0) != h1  # same key, other parent
    assert block_hash(k2, block_hash(k1, 0)) != h2  # a different chain above changes every descendant


def test_every_field_changes_the_hash():
    base = BlockKey((1, 2, 3, 4), extra_ids=(0, 0, 0, 0), lora_task_id=1, cache_salt_id=2, mm_keys=(MM_A,))
    h = block_hash(base, 0)
    changed = [
        base._replace(tokens=(1, 2, 3, 5)),
        base._replace(tokens=(1, 2, 3, 4, 0), extra_ids=(0, 0, 0, 0, 0)),  # token count is mixed in
        base._replace(extra_ids=(0, 0, 0, 1)),
        base._replace(extra_ids=None),
        base._replace(lora_task_id=2),
        base._replace(lora_task_id=None),
        base._replace(cache_salt_id=3),
        base._replace(cache_salt_id=None),
        base._replace(mm_keys=(MM_B,)),
        base._replace(mm_keys=(MmKey(MM_A.hash, 1),)),
        base._replace(mm_keys=()),
    ]
    hashes = {block_hash(k, 0) for k in changed}
    assert h not in hashes and len(hashes) == len(changed)
    assert block_hash(base, 1) != h  # the parent hash too


def test_salt_mixed_only_at_the_root():
    # TRT: "only the first block hashes the salt; children inherit it through parentHash".
    a = BlockKey((1, 2, 3, 4), cache_salt_id=1)
    b = BlockKey((1, 2, 3, 4), cache_salt_id=2)
    assert block_hash(a, 0) != block_hash(b, 0)
    assert block_hash(a, 77) == block_hash(b, 77) == block_hash(BlockKey((1, 2, 3, 4)), 77)
    # ... so salted chains still differ everywhere through their roots
    ra, rb = block_hash(a, 0), block_hash(b, 0)
    assert block_hash(BlockKey((5,), cache_salt_id=1), ra) != block_hash(BlockKey((5,), cache_salt_id=2), rb)


def test_token_ids_hashed_as_uint32():
    # TRT casts token ids to uint32 before hash32Mix.
    assert block_hash(BlockKey((2**32 + 5,)), 0) == block_hash(BlockKey((5,)), 0)


# --------------------------------------------------------------------------- cache salt ids
def test_cache_salt_id():
    assert cache_salt_id(None) is None
    assert cache_salt_id(7) == 7
    assert cache_salt_id(-1) == 2**64 - 1  # ints are taken modulo 2**64
    assert cache_salt_id("abc") == 6455300059550759896  # blake2b-64, little-endian: stable across processes
    assert cache_salt_id("abc") == cache_salt_id("abc")
    assert cache_salt_id("abc") != cache_salt_id("abd")
    assert cache_salt_id("") != cache_salt_id("abc")
    assert 0 <= cache_salt_id("tenant-42") < 2**64
