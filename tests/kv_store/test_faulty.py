"""FaultyStore: injected failures are reported as failures, never as partial successes."""
from __future__ import annotations

import numpy as np
import pytest

from kvjax.kv_store import FaultyStore, FileStore, MemoryStore, StoreWorker
from kvjax.kv_store.file import fanout_dir


def payload(i: int, size: int = 256) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_failed_gets_are_reported_and_successes_are_exact(kind, tmp_path):
    inner = MemoryStore(1 << 20) if kind == "memory" else FileStore(tmp_path, 1 << 20)
    keys = [f"k{i}" for i in range(200)]
    inner.batch_put(keys, [payload(i) for i in range(200)])
    faulty = FaultyStore(inner, fail_rate=0.3, seed=7)
    bufs = [np.zeros(256, np.uint8) for _ in keys]
    ok = faulty.batch_get_into(keys, bufs)
    assert 30 < ok.count(False) < 90 and faulty.failed_gets == ok.count(False)
    for i, (good, b) in enumerate(zip(ok, bufs, strict=True)):
        if good:
            np.testing.assert_array_equal(b, payload(i))
        else:  # the torn bytes it left would be caught by any reader that trusted them
            assert not np.array_equal(b, payload(i))
    inner.close()


def test_failures_are_reproducible_from_the_seed():
    def run(seed):
        inner = MemoryStore(1 << 20)
        f = FaultyStore(inner, fail_rate=0.5, seed=seed)
        return f.batch_put([f"k{i}" for i in range(64)], [b"x"] * 64)

    assert run(3) == run(3) and run(3) != run(4)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_failed_put_never_leaves_a_readable_key(kind, tmp_path):
    inner = MemoryStore(1 << 20) if kind == "memory" else FileStore(tmp_path, 1 << 20)
    faulty = FaultyStore(inner, fail_rate=0.4, seed=11)
    keys = [f"k{i}" for i in range(100)]
    ok = faulty.batch_put(keys, [payload(i) for i in range(100)])
    assert 20 < ok.count(False) < 60 and faulty.failed_puts == ok.count(False)
    for i, k in enumerate(keys):
        buf = np.zeros(256, np.uint8)
        got = inner.batch_get_into([k], [buf]) == [True]
        assert got == ok[i]
        if got:
            np.testing.assert_array_equal(buf, payload(i))
    if kind == "file":
        on_disk = {p.stem for p in tmp_path.rglob("*.bin")}
        assert on_disk == {k for k, good in zip(keys, ok, strict=True) if good}
        assert not list(tmp_path.rglob("*.tmp"))
        assert all((tmp_path / fanout_dir(k) / f"{k}.bin").exists() for k in on_disk)
        inner.close()


def test_lookup_faults_only_shorten_the_prefix():
    inner = MemoryStore(1 << 20)
    keys = [f"k{i}" for i in range(32)]
    inner.batch_put(keys, [b"x"] * 32)
    f = FaultyStore(inner, fail_rate=0.1, seed=5, fail_lookups=True)
    answers = [f.batch_exists(keys) for _ in range(20)]
    assert all(0 <= a <= 32 for a in answers) and min(answers) < 32


def test_through_the_worker_with_delays():
    """Delays and failures through the thread pool: each result is either ok with exact bytes
    or failed, and every job completes."""
    inner = MemoryStore(1 << 20)
    w = StoreWorker(FaultyStore(inner, fail_rate=0.25, delay=0.005, seed=2), num_threads=3, max_pending=16)
    puts = [w.put([f"k{i}"], [payload(i)]) for i in range(12)]
    res, _ = w.wait(puts, 30)
    stored = {r.keys[0] for r in res if r.ok == (True,)}
    assert len(res) == 12 and 0 < len(stored) < 12
    bufs = {i: np.zeros(256, np.uint8) for i in range(12)}
    gets = [w.get_into([f"k{i}"], [bufs[i]]) for i in range(12)]
    res, _ = w.wait(gets, 30)
    for r in res:
        i = int(r.keys[0][1:])
        if r.ok == (True,):
            assert r.keys[0] in stored
            np.testing.assert_array_equal(bufs[i], payload(i))
    w.close()


def test_bad_parameters():
    for bad in ({"fail_rate": 1.5}, {"fail_rate": -0.1}, {"delay": -1}, {"fail_rate": True}):
        with pytest.raises(ValueError):
            FaultyStore(MemoryStore(1), **bad)
