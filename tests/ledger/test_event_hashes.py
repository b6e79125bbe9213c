"""Block hashes in KV events (both hash formulas, the trtllm64 one memoised per block).

The default hash is SHA-256 over the parent hash and a canonical encoding of the whole key
(tokens, extra ids, LoRA id, cache salt, multimodal items): different keys never encode alike,
so an index fed by events never confuses two blocks. TensorRT-LLM's 64-bit formula stays
selectable (`CacheConfig(event_hash="trtllm64")`); its bit-exactness is pinned in
test_block_key.py.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import struct
import weakref

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from ledger_helpers import make_config

from kvjax import KVCacheManager, Request
from kvjax.ledger import RemovedData, StoredData, UpdatedData
from kvjax.ledger.block_hashing import (
    SHA256_ROOT_HASH,
    TOKEN_MEMO_MAX,
    BlockHasher,
    canonical_key_bytes,
    plain_block_hash,
    plain_block_hashes,
    sha256_block_hash,
    trtllm64_block_hash,
)
from kvjax.ledger.block_key import BlockKey, MmKey


def stored_hashes(m: KVCacheManager) -> list:
    m.flush_iteration_events()
    return [b.block_hash for e in m.get_latest_events() if isinstance(e.data, StoredData) for b in e.data.blocks]


# --------------------------------------------------------------------------- the reported collision
def test_extra_id_and_lora_id_blocks_publish_different_hashes():
    """A 1-token block with extra id e and one with LoRA id e: TensorRT-LLM's formula mixes
    both through the same hash64Mix step, so they used to publish the same hash."""
    e = 7
    m = KVCacheManager(make_config(event_buffer_max_size=64))
    m.add_sequence(Request("x", [5, 9], extra_ids=[e, 0]))
    m.add_sequence(Request("l", [5, 9], lora_task_id=e))
    m.remove_sequence("x")  # stores the 1-token block [5] (the newest token has no KV)
    m.remove_sequence("l")
    hx, hl = stored_hashes(m)
    assert hx != hl
    assert isinstance(hx, bytes) and len(hx) == 32  # SHA-256 by default

    # the compatibility formula keeps TensorRT-LLM's numbers, collision included
    m64 = KVCacheManager(make_config(event_buffer_max_size=64, event_hash="trtllm64"))
    m64.add_sequence(Request("x", [5, 9], extra_ids=[e, 0]))
    m64.add_sequence(Request("l", [5, 9], lora_task_id=e))
    m64.remove_sequence("x")
    m64.remove_sequence("l")
    gx, gl = stored_hashes(m64)
    assert gx == gl == trtllm64_block_hash(BlockKey((5,), extra_ids=(e,)))
    assert isinstance(gx, int) and 0 <= gx < 2**64


def test_event_hash_config_is_validated():
    with pytest.raises(ValueError, match="event_hash"):
        make_config(event_hash="md5")
    with pytest.raises(ValueError, match="event_hash"):
        make_config(event_hash=None)


@pytest.mark.parametrize("algorithm", ["sha256", "trtllm64"])
def test_events_chain_hashes_of_the_configured_algorithm(algorithm):
    m = KVCacheManager(make_config(event_buffer_max_size=64, event_hash=algorithm, primary_blocks=3, secondary_blocks=1))
    m.add_sequence(Request("a", list(range(9))))
    m.remove_sequence("a")  # stores [0..3], [4..7]
    hasher = BlockHasher(algorithm)
    h0 = hasher.hash(BlockKey((0, 1, 2, 3)), hasher.root)
    h1 = hasher.hash(BlockKey((4, 5, 6, 7)), h0)
    m.flush_iteration_events()
    (stored,) = [e.data for e in m.get_latest_events() if isinstance(e.data, StoredData)]
    assert stored.parent_hash is None and [b.block_hash for b in stored.blocks] == [h0, h1]
    m.add_sequence(Request("b", list(range(100, 112))))  # takes every primary block
    m.flush_iteration_events()
    # the tail is offloaded, then dropped from the only secondary block to make room for the head
    assert [e.data for e in m.get_latest_events()] == [
        UpdatedData(h1, (0, 1), None),
        UpdatedData(h0, (0, 1), None),
        RemovedData((h1,)),
    ]


# --------------------------------------------------------------------------- the canonical encoding
ints = st.one_of(st.integers(0, 2**31 - 1), st.integers(-(2**70), 2**70))
mm_keys = st.lists(st.builds(MmKey, st.binary(min_size=1, max_size=32), st.integers(0, 2**40)), max_size=2).map(tuple)


@st.composite
def block_keys(draw):
    tokens = tuple(draw(st.lists(st.one_of(st.integers(0, 4), ints), max_size=5)))
    extra = draw(
        st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 4), ints), min_size=len(tokens), max_size=len(tokens)).map(tuple))
    )
    return BlockKey(
        tokens,
        extra,
        draw(st.one_of(st.none(), st.integers(0, 4), ints)),
        draw(st.one_of(st.none(), st.integers(0, 4), st.integers(0, 2**64 - 1))),
        draw(mm_keys),
    )


@settings(max_examples=100)
@given(block_keys(), block_keys())
def test_distinct_keys_never_encode_or_hash_alike(a, b):
    if a == b:
        assert canonical_key_bytes(a) == canonical_key_bytes(b)
        return
    assert canonical_key_bytes(a) != canonical_key_bytes(b)
    assert sha256_block_hash(a) != sha256_block_hash(b)


@settings(max_examples=60)
@given(block_keys(), st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32))
def test_distinct_parents_never_hash_alike(key, p, q):
    assert (sha256_block_hash(key, p) == sha256_block_hash(key, q)) == (p == q)


def test_encoding_separates_fields_that_used_to_mix_alike():
    base = BlockKey((5,))
    variants = [
        BlockKey((5,), extra_ids=(7,)),
        BlockKey((5,), lora_task_id=7),
        BlockKey((5,), cache_salt_id=7),
        BlockKey((5, 7)),
        BlockKey((5,), mm_keys=(MmKey(b"\x07", 0),)),
        BlockKey((5,), extra_ids=(0,)),
        BlockKey((5,), lora_task_id=0),
        BlockKey((), extra_ids=()),
        BlockKey(()),
    ]
    encodings = {canonical_key_bytes(k) for k in [base, *variants]}
    assert len(encodings) == len(variants) + 1
    # the salt is part of every block's key (not only the first one's, as in TensorRT-LLM)
    assert sha256_block_hash(BlockKey((5,), cache_salt_id=1), b"\1" * 32) != sha256_block_hash(
        BlockKey((5,), cache_salt_id=2), b"\1" * 32
    )


def test_sha256_hash_is_pinned():
    # fixed numbers: a change of the encoding breaks every router fed by earlier events
    h0 = sha256_block_hash(BlockKey((1, 2, 3, 4)))
    assert h0 == sha256_block_hash(BlockKey((1, 2, 3, 4)), SHA256_ROOT_HASH)
    assert h0.hex() == SHA256_PINNED[0]
    full = BlockKey((1, 2), (7, 8), 3, 11, (MmKey(bytes(range(32)), 2),))
    assert sha256_block_hash(full, h0).hex() == SHA256_PINNED[1]
    with pytest.raises(ValueError, match="32 bytes"):
        sha256_block_hash(BlockKey((1,)), b"\0" * 8)


SHA256_PINNED = (
    "74ccee4260e32ad65a53680bb1cae122e6fb0fab2ddd3da1b4a3bfe442fae5ed",
    "bbab4182956a252eb41cf4adab68816f7fdaf9f27fc1c882a7aa00495952ffa2",
)


def _ref_int(v):
    n = (v.bit_length() + 8) // 8
    return struct.pack("<I", n) + v.to_bytes(n, "little", signed=True)


def _ref_encode(key):
    """The documented encoding, transcribed independently with struct (docs/semantics.md)."""
    t = key.tokens
    if all(0 <= x < 2**32 for x in t):
        out = b"T" + struct.pack(f"<I{len(t)}I", len(t), *t)
    else:
        out = b"t" + struct.pack("<I", len(t)) + b"".join(map(_ref_int, t))
    e = key.extra_ids
    out += b"e" if e is None else b"E" + struct.pack("<I", len(e)) + b"".join(map(_ref_int, e))
    out += b"l" if key.lora_task_id is None else b"L" + _ref_int(key.lora_task_id)
    out += b"s" if key.cache_salt_id is None else b"S" + _ref_int(key.cache_salt_id)
    out += b"M" + struct.pack("<I", len(key.mm_keys))
    for mm in key.mm_keys:
        out += struct.pack("<I", len(mm.hash)) + mm.hash + _ref_int(mm.start_offset)
    return out


@settings(max_examples=80)
@given(block_keys(), st.binary(min_size=32, max_size=32))
def test_hash_matches_an_independent_transcription(key, parent):
    assert canonical_key_bytes(key) == _ref_encode(key)
    assert sha256_block_hash(key, parent) == hashlib.sha256(parent + _ref_encode(key)).digest()
    assert SHA256_ROOT_HASH == hashlib.sha256(b"kvjax/block-hash/sha256/v1").digest()


# --------------------------------------------------------------------------- trtllm64 token memo
@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=23),
    st.integers(1, 8),
    st.binary(min_size=32, max_size=32),
)
def test_plain_block_hashes_are_the_chained_hashes_of_the_keys(tokens, tpb, parent):
    """The tree's fast path (int32 units, whole blocks then a partial one) hashes exactly as
    `sha256_block_hash` of each block's `BlockKey`."""
    units = struct.pack(f"<{len(tokens)}i", *tokens)
    want, h = [], parent
    for lo in range(0, len(tokens), tpb):
        h = sha256_block_hash(BlockKey(tuple(tokens[lo : lo + tpb])), h)
        want.append(h)
    assert plain_block_hashes(parent, units, 4 * tpb) == want
    assert plain_block_hash(parent, units[: 4 * tpb]) == want[0]


def test_trtllm64_memo_is_bounded_and_per_manager():
    m1 = KVCacheManager(make_config(event_hash="trtllm64"))
    m2 = KVCacheManager(make_config(event_hash="trtllm64"))
    h1, h2 = m1.inspector.event_hasher, m2.inspector.event_hasher
    assert h1.memo is not h2.memo
    keys = [BlockKey(tuple(range(i, i + 64))) for i in range(0, TOKEN_MEMO_MAX + 5000, 64)]
    for k in keys:
        assert h1.hash(k, 0) == trtllm64_block_hash(k, 0)  # the memo never changes a value
    assert len(h1.memo) == TOKEN_MEMO_MAX and not h2.memo
    for k in keys[-3:]:  # past the bound: computed, still right, nothing added
        assert h1.hash(k, 123) == trtllm64_block_hash(k, 123)
    assert len(h1.memo) == TOKEN_MEMO_MAX
    # the memo belongs to its manager and goes with it
    ref = weakref.ref(h1)
    del m1, h1
    gc.collect()
    assert ref() is None


def test_sha256_hasher_keeps_no_memo():
    m = KVCacheManager(make_config(event_buffer_max_size=64, primary_blocks=64))
    for i in range(20):
        m.add_sequence(Request(i, list(range(i * 100, i * 100 + 30))))
        m.remove_sequence(i)
    assert stored_hashes(m) and m.inspector.event_hasher.memo == {}


def test_fast_event_constructors_fill_every_field():
    """The ledger builds Stored events without the dataclasses' `__init__`; what it builds
    must equal (and hash like) what the public constructors build."""
    from kvjax.ledger.events import (
        KVCacheEvent,
        KVCacheEventManager,
        StoredBlock,
        StoredData,
        _new_stored_data,
        add_stored_blocks,
    )

    args = (b"\x01" * 32, (1, 2, 3), 7, 1, 80, ())
    slow = StoredBlock(*args)
    built: list = []
    add_stored_blocks(built, [args[0]], [args[1]], 7, [1], [80], ())
    (fast,) = built
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert _new_stored_data(None, (fast,)) == StoredData(None, (slow,))
    events = KVCacheEventManager(8)
    events.removed(64, b"r")
    events.stored_one(64, b"p", *args)  # flushes the pending Removed first
    events.flush()
    removed, stored = events.get_latest()
    assert removed == KVCacheEvent(0, 64, RemovedData((b"r",)))
    assert stored == KVCacheEvent(1, 64, StoredData(b"p", (slow,)))
    assert hash(stored) == hash(KVCacheEvent(1, 64, StoredData(b"p", (slow,)))) and type(stored.data.blocks[0]) is StoredBlock


def test_stored_data_from_columns_is_the_record_its_blocks_make():
    """A Stored event the ledger builds as columns equals, hashes, prints and pickles like the
    one built from its `StoredBlock`s; its blocks are made only when read, and it stays frozen."""
    import pickle

    from kvjax.ledger.events import StoredBlock, StoredColumns, StoredData, new_columns, stored_data_from_columns

    tokens = tuple(range(100, 110))  # two full blocks of 4 and a partial one of 2
    cols = new_columns(((b"a" * 32, b"b" * 32, b"c" * 32), tokens, 4, 7, (0, 0, 1), (35, 80, 35), ()))
    assert cols == StoredColumns(*cols) and type(cols) is StoredColumns
    lazy = stored_data_from_columns(b"p", cols)
    assert lazy.num_blocks == 3 and lazy.columns is cols and lazy._blocks is None  # nothing built yet
    eager = StoredData(b"p", (
        StoredBlock(b"a" * 32, (100, 101, 102, 103), 7, 0, 35, ()),
        StoredBlock(b"b" * 32, (104, 105, 106, 107), 7, 0, 80, ()),
        StoredBlock(b"c" * 32, (108, 109), 7, 1, 35, ()),
    ))  # fmt: skip
    assert eager.columns is None and eager.num_blocks == 3
    assert lazy == eager and eager == lazy and hash(lazy) == hash(eager) and repr(lazy) == repr(eager)
    assert lazy.blocks is lazy.blocks and type(lazy.blocks[0]) is StoredBlock  # built once
    assert pickle.loads(pickle.dumps(lazy)) == eager
    assert StoredData(b"p", eager.blocks[:2]) != lazy and lazy != "not an event"
    with pytest.raises(dataclasses.FrozenInstanceError):
        lazy.parent_hash = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        del lazy.parent_hash
    match lazy:
        case StoredData(parent, blocks):
            assert parent == b"p" and blocks == eager.blocks
