"""The KV event stream, pinned bit for bit (a faster event path must publish the same stream).

A seeded driver serves requests of every key shape (plain, extra ids, LoRA, cache salt,
multimodal items, retention priorities, partial last blocks that grow, sliding windows,
offload and onboard) with events on. Two checks:

- every published event, serialised by `repr`, digests to a pinned SHA-256: any change to an
  event's type, order, fields or hash values fails it (the digests were taken before the
  hashing fast paths existed);
- every Stored block's hash is recomputed from the event's own fields with an independent
  transcription of the documented encoding (no ledger code), chained on the event's parent
  hash, and every Removed / Updated hash names a block stored before and not yet removed
  (with full attention the parent hash too).
"""
from __future__ import annotations

import dataclasses
import hashlib
import random

import pytest
from ledger_helpers import make_config
from test_event_hashes import _ref_encode

from kvjax import KVCacheManager, Request
from kvjax.errors import KVCacheError
from kvjax.ledger import CreatedData, KVCacheEvent, RemovedData, StoredBlock, StoredData, UpdatedData
from kvjax.ledger.block_hashing import trtllm64_block_hash
from kvjax.ledger.block_key import BlockKey
from kvjax.request import MultimodalItem, RetentionConfig, TokenRangeRetention

ROOT_SHA = hashlib.sha256(b"kvjax/block-hash/sha256/v1").digest()


def drive(event_hash: str, windows: tuple[int, ...] | None, salts: bool, seed: int) -> list:
    """Serve a seeded mix of requests; returns every event published, oldest first."""
    cfg = make_config(
        event_buffer_max_size=100_000,
        event_hash=event_hash,
        num_layers=1 if windows is None else len(windows),
        attention_windows=windows,
        primary_blocks=40,
        secondary_blocks=12,
        max_seq_len=64,
    )
    m = KVCacheManager(cfg)
    rng = random.Random(seed)
    bases = [[rng.randrange(50) for _ in range(24)] for _ in range(4)]
    live: dict[int, int] = {}  # request id -> tokens left to generate
    events: list = []
    next_id = 0
    for _ in range(300):
        action = rng.random()
        if action < 0.35 and len(live) < 3:
            base = rng.choice(bases)
            prompt = base[: rng.randrange(1, len(base))] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
            kw: dict = {}
            shape = rng.randrange(6)
            if shape == 1:
                kw["extra_ids"] = [rng.randrange(3) for _ in prompt]
            elif shape == 2:
                kw["lora_task_id"] = rng.choice([3, 5])
            elif shape == 3 and salts:
                kw["cache_salt"] = rng.choice(["a", 7])
            elif shape == 4 and len(prompt) >= 6:
                start = rng.randrange(0, len(prompt) - 4)
                kw["mm_items"] = (MultimodalItem(bytes([rng.randrange(1, 4)]) * 32, start, rng.randrange(1, 5)),)
            elif shape == 5:
                kw["retention"] = RetentionConfig((TokenRangeRetention(0, 8, rng.choice([10, 80])),), decode_priority=60)
            try:
                m.add_sequence(Request(next_id, prompt, max_new_tokens=24, **kw))
            except KVCacheError:
                pass
            else:
                live[next_id] = rng.randrange(1, 20)
                if rng.random() < 0.5:
                    m.store_context_blocks(next_id)
            next_id += 1
        elif action < 0.8 and live:
            for rid in list(live):
                try:
                    m.add_token(rid, rng.randrange(50) if rng.random() < 0.7 else 0)
                except KVCacheError:
                    m.remove_sequence(rid)
                    del live[rid]
                    continue
                r = rng.random()
                if r < 0.6:
                    m.store_new_block(rid)
                elif r < 0.75:  # the partial last block too: it moves to a new key when it grows
                    m.store_blocks_for_reuse(rid)
                live[rid] -= 1
                if live[rid] <= 0:
                    m.remove_sequence(rid, store_for_reuse=rng.random() < 0.9)
                    del live[rid]
        elif live:
            rid = rng.choice(list(live))
            m.remove_sequence(rid, store_for_reuse=rng.random() < 0.9)
            del live[rid]
        if rng.random() < 0.3:
            m.flush_iteration_events()
            events.extend(m.get_latest_events())
    for rid in list(live):
        m.remove_sequence(rid)
    m.flush_iteration_events()
    events.extend(m.get_latest_events())
    m.verify_integrity()
    return events


def stream_digest(events: list) -> str:
    return hashlib.sha256("\n".join(map(repr, events)).encode()).hexdigest()


def reference_hash(event_hash: str, block, parent):
    """A Stored block's hash from its own fields (a block's cache salt is not in the event:
    only streams without salts are checked this way)."""
    tokens = block.tokens
    if tokens and isinstance(tokens[0], tuple):
        key = BlockKey(tuple(t for t, _ in tokens), tuple(e for _, e in tokens), block.lora_id, None, block.mm_keys)
    else:
        key = BlockKey(tuple(tokens), None, block.lora_id, None, block.mm_keys)
    if event_hash == "sha256":
        return hashlib.sha256((ROOT_SHA if parent is None else parent) + _ref_encode(key)).digest()
    return trtllm64_block_hash(key, 0 if parent is None else parent)


# (hash, windows, salts, seed) -> SHA-256 of the stream's reprs, taken before the columnar event work
PINNED = {
    ("sha256", None, True, 1): "dae045151edc0899476e64d62edc7bb5556a7102569ca567ed70f15a52bcefe7",
    ("sha256", (64, 8), True, 2): "acf1214874682e0952e32c1b8f4bb7c0cc643d44e3a84a6d3cccd8843a2c3b17",
    ("trtllm64", None, True, 3): "cd23402ca633e7ea629512a63f7ffc46b63c20d130a8cfbac9d68cbb7c0604ea",
    ("sha256", None, False, 4): "3276767b1249e44b41fd6367a0233126f2c8bb97ee04fa517780b7f5e4c3ca6d",
    ("trtllm64", (64, 8), False, 5): "0273e616041dd1770fca52722edfc01d38c2a9b7dadbd9ebd86c7f7e25ca6d50",
}


@pytest.mark.parametrize("case", list(PINNED), ids=lambda c: f"{c[0]}-{'swa' if c[1] else 'full'}-salt{int(c[2])}-{c[3]}")
def test_event_stream_is_pinned(case):
    events = drive(*case)
    kinds = {type(e.data).__name__ for e in events}
    assert {"StoredData", "RemovedData", "UpdatedData"} <= kinds  # the driver reaches every kind
    assert stream_digest(events) == PINNED[case]


@pytest.mark.parametrize("event_hash", ["sha256", "trtllm64"])
@pytest.mark.parametrize("windows", [None, (64, 8)])
def test_stored_hashes_recompute_from_the_event_fields(event_hash, windows):
    events = drive(event_hash, windows, False, 11)
    live: dict[int, set] = {}
    stored = 0
    for e in events:
        hashes = live.setdefault(e.window_size, set())
        d = e.data
        if isinstance(d, StoredData):
            # a sliding window may have dropped the parent's block: its position still has a hash
            assert windows is not None or d.parent_hash is None or d.parent_hash in hashes
            parent = d.parent_hash
            for b in d.blocks:
                assert b.block_hash == reference_hash(event_hash, b, parent)
                assert b.block_hash not in hashes
                hashes.add(b.block_hash)
                parent = b.block_hash
                stored += 1
        elif isinstance(d, RemovedData):
            for h in d.block_hashes:
                hashes.remove(h)
        elif isinstance(d, UpdatedData):
            assert d.block_hash in hashes
    assert stored > 100


def test_published_records_are_the_frozen_dataclasses():
    """The ledger builds event records without their `__init__` (mutable twins turned into
    the frozen classes): what it publishes must be those classes, frozen, equal to and hashing
    like records built by the constructors."""
    events = drive("sha256", None, True, 6)
    assert events
    for e in events:
        assert type(e) is KVCacheEvent
        assert type(e.data) in (CreatedData, StoredData, RemovedData, UpdatedData)
        if isinstance(e.data, StoredData):  # not a dataclass: its blocks are built from columns on first read
            data = StoredData(e.data.parent_hash, e.data.blocks)
        else:
            data = dataclasses.replace(e.data)
        rebuilt = dataclasses.replace(e, data=data)
        assert rebuilt == e and hash(rebuilt) == hash(e) and repr(rebuilt) == repr(e)
        with pytest.raises(dataclasses.FrozenInstanceError):
            e.event_id = -1
        if isinstance(e.data, StoredData):
            with pytest.raises(dataclasses.FrozenInstanceError):
                e.data.parent_hash = None
            assert type(e.data.blocks) is tuple and e.data.num_blocks == len(e.data.blocks)
            for b in e.data.blocks:
                assert type(b) is StoredBlock and type(b.tokens) is tuple
                assert StoredBlock(*(getattr(b, f.name) for f in dataclasses.fields(StoredBlock))) == b
                with pytest.raises(dataclasses.FrozenInstanceError):
                    b.block_hash = b""
