"""Concurrent readers: one writer thread drives the ledger while reader
threads call the thread-safe reads; no read may be torn or raise a spurious IntegrityError.

The interpreter's switch interval is cut to 20 µs so threads interleave inside operations,
and the run is bounded by the writer's operation count (seeded)."""
from __future__ import annotations

import random
import sys
import threading

import pytest
from ledger_helpers import FakeClock, make_config

from kvjax import KVCacheManager, OutOfBlocksError, Request, UnknownRequestError
from kvjax.ledger import decode_batch

TPB = 4


DRAFTS = 4  # rewinds stay within the draft count: deeper ones may be refused under a sliding window


def writer_ops(m: KVCacheManager, clock: FakeClock, n_ops: int, seed: int, done: threading.Event, errors: list) -> None:
    rng = random.Random(seed)
    live: list = []
    unverified: dict = {}  # request -> tokens added since its last rewind
    bases = [list(range(100 * k, 100 * k + 40)) for k in range(4)]
    next_id = 0
    try:
        for _ in range(n_ops):
            op = rng.random()
            if op < 0.25 or not live:
                reqs = []
                for _ in range(rng.choice([1, 1, 2])):
                    next_id += 1
                    base = rng.choice(bases)
                    prompt = base[: rng.randrange(2, 30)] + [rng.randrange(5) for _ in range(rng.randrange(3))]
                    reqs.append(Request(next_id, prompt, max_new_tokens=24, num_draft_tokens=DRAFTS))
                try:
                    m.add_sequences(reqs)
                    live += [r.request_id for r in reqs]
                except OutOfBlocksError:
                    pass
            elif op < 0.6:  # a batched decode step (under the lock throughout)
                rows = rng.sample(live, min(len(live), rng.randrange(1, 9)))
                try:
                    m.add_tokens(rows, [rng.randrange(50) for _ in rows])
                    for rid in rows:
                        unverified[rid] = unverified.get(rid, 0) + 1
                except OutOfBlocksError:
                    pass
            elif op < 0.75:
                rid = rng.choice(live)
                try:
                    m.add_token(rid, rng.randrange(50))  # mostly the unlocked fast path
                    unverified[rid] = unverified.get(rid, 0) + 1
                    if rng.random() < 0.3:
                        m.store_new_block(rid)
                except OutOfBlocksError:
                    pass
            elif op < 0.8:
                rid = rng.choice(live)
                drafts = min(unverified.pop(rid, 0), DRAFTS)  # tokens added since its last rewind
                if drafts:
                    m.rewind(rid, rng.randrange(1, drafts + 1))  # rejected drafts
            elif op < 0.95:
                rid = live.pop(rng.randrange(len(live)))
                m.remove_sequence(rid, store_for_reuse=rng.random() < 0.8)
            else:
                clock.advance(1.0)
                m.refresh_blocks()
                m.take_transfers()
                m.flush_iteration_events()
    except BaseException as e:  # pragma: no cover - reported by the test
        errors.append(("writer", repr(e)))
    finally:
        done.set()


def check_snapshot(snap: tuple) -> None:
    """A snapshot is one instant: per window, ref counts equal the block lists holding them."""
    windows, _nodes, sequences, *_ = snap
    refs = [{} for _ in windows]
    for rid, tokens, num_tokens, _cp, per_window in sequences:
        assert len(tokens) == num_tokens, f"torn sequence {rid}: {len(tokens)} tokens, num_tokens {num_tokens}"
        for w, (beams, slots, _front) in enumerate(per_window):
            for beam, row in zip(beams, slots, strict=True):
                assert len(beam) == len(row) == -(-num_tokens // TPB), f"torn block list of {rid}"
            for b in {b for beam in beams for b in beam if b >= 0}:
                refs[w][b] = refs[w].get(b, 0) + 1
    for w, (window, blocks, _queues, _counters, num_free) in enumerate(windows):
        assert sum(1 for b in blocks if b[3] == 0) == sum(num_free), f"window {window}: free count torn"
        for block_id, _slot, _level, ref_count, pins, *_ in blocks:
            assert ref_count == refs[w].get(block_id, 0) + pins, f"window {window}: block {block_id} ref count torn"


def reader_loop(m: KVCacheManager, kind: str, done: threading.Event, errors: list, counts: dict) -> None:
    n = 0
    try:
        while not done.is_set():
            if kind == "stats":
                s = m.stats()
                assert s.free_num_blocks + s.used_num_blocks == s.max_num_blocks
                assert sum(s.num_free_blocks_per_window.values()) == s.free_num_blocks
                m.num_free_blocks()
            elif kind == "tables":
                ids = m.request_ids
                try:
                    tables = [m.block_table(ids, w) for w in m.windows]
                    offsets = m.block_offsets(ids)
                except UnknownRequestError:
                    continue  # removed between the calls: a legitimate answer
                null = m.config.primary_blocks
                for table in tables:
                    assert table.shape[0] == len(ids) and ((table >= 0) & (table <= null)).all()
                    for row in table:  # one sequence never holds a block twice
                        real = row[row != null]
                        assert len(set(real.tolist())) == len(real)
                assert offsets.shape[1] == len(ids)
            elif kind == "integrity":
                m.verify_integrity()
                check_snapshot(m.snapshot())
            elif kind == "router":
                m.analyze_prefix_reuse(Request("probe", list(range(0, 20))))
                m.get_latest_events()
            n += 1
    except BaseException as e:
        errors.append((kind, repr(e)))
    counts[kind] = n


@pytest.mark.parametrize("row_by_row", [True, False], ids=["small-steps-row-by-row", "every-step-batched"])
def test_readers_never_see_a_torn_ledger(monkeypatch, row_by_row):
    """With `row_by_row` off, every `add_tokens` takes the batched path, so requests' tokens
    move into the token store and (on a single `add_token`) back to a list, under the readers."""
    if not row_by_row:
        monkeypatch.setattr(decode_batch, "SMALL_BATCH", 0)
    clock = FakeClock()
    cfg = make_config(num_layers=2, attention_windows=(64, 12), primary_blocks=24, secondary_blocks=6, event_buffer_max_size=1000)
    m = KVCacheManager(cfg, clock=clock)
    done = threading.Event()
    errors: list = []
    counts: dict = {}
    old = sys.getswitchinterval()
    sys.setswitchinterval(2e-5)
    try:
        readers = [
            threading.Thread(target=reader_loop, args=(m, k, done, errors, counts))
            for k in ("stats", "tables", "integrity", "router")
        ]
        writer = threading.Thread(target=writer_ops, args=(m, clock, 6000, 7, done, errors))
        for t in readers:
            t.start()
        writer.start()
        writer.join(timeout=120)
        done.set()
        for t in readers:
            t.join(timeout=30)
    finally:
        sys.setswitchinterval(old)
    assert not writer.is_alive() and not any(t.is_alive() for t in readers)
    assert errors == []
    assert all(counts.get(k, 0) > 5 for k in ("stats", "tables", "integrity", "router")), counts
    m.verify_integrity()
    if not row_by_row:
        assert m._tok.next_row > 0  # tokens did move into the store
