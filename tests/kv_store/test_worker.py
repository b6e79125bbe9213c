"""StoreWorker: non-blocking jobs, back-pressure, buffer lifetime, errors and close."""
from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

from kvjax.kv_store import (
    FaultyStore,
    JobKind,
    MemoryStore,
    StoreBufferError,
    StoreClosedError,
    StoreKeyError,
    StoreWorker,
    WorkerFullError,
)


class GatedStore(MemoryStore):
    """A MemoryStore whose calls wait for `gate`, so tests control when jobs finish."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)

    def batch_put(self, keys, buffers):
        self.started.release()
        assert self.gate.wait(30)
        return super().batch_put(keys, buffers)

    def batch_exists(self, keys):
        self.started.release()
        assert self.gate.wait(30)
        return super().batch_exists(keys)


class BrokenStore(MemoryStore):
    def batch_get_into(self, keys, buffers):
        raise ConnectionError("store went away")

    def batch_exists(self, keys):
        return len(keys) + 1  # violates the contract


def test_put_lookup_get_round_trip():
    w = StoreWorker(MemoryStore(1 << 20), num_threads=2)
    src = [np.arange(16, dtype=np.float32) + i for i in range(3)]
    keys = ["a", "b", "c"]
    hp = w.put(keys, src)
    (rp,), _ = w.wait([hp], 10)
    assert rp.handle == hp and hp.kind is JobKind.PUT and rp.ok == (True, True, True) and rp.succeeded
    hl = w.lookup(["a", "b", "x", "c"])
    hg = w.get_into(keys, [np.zeros(16, np.float32) for _ in keys])
    res, _ = w.wait([hl, hg], 10)
    by_id = {r.handle.job_id: r for r in res}
    assert by_id[hl.job_id].hits == 2 and by_id[hg.job_id].ok_prefix() == 3
    assert w.pending == 0
    w.close()


def test_poll_never_blocks_and_returns_each_result_once():
    store = GatedStore()
    w = StoreWorker(store, num_threads=1)
    h = w.put(["a"], [b"1"])
    assert w.poll() == []  # the job is held at the gate: poll returns at once
    store.gate.set()
    (r,), _ = w.wait([h], 10)
    assert r.ok == (True,) and w.poll() == [] and w.pending == 0
    w.close()


def test_back_pressure_refuses_beyond_max_pending_and_queues_nothing():
    store = GatedStore()
    w = StoreWorker(store, num_threads=1, max_pending=3)
    hs = [w.lookup([f"k{i}"]) for i in range(3)]
    with pytest.raises(WorkerFullError, match="max_pending=3"):
        w.put(["x"], [b"1"])
    assert w.pending == 3
    store.gate.set()
    res, _ = w.wait(hs, 10)
    assert len(res) == 3 and w.pending == 0
    w.lookup(["x"])  # room again once polled
    w.close()
    assert store.batch_exists(["x"]) == 0  # the refused put never ran


def test_put_buffers_stay_referenced_until_the_result_is_polled():
    store = GatedStore()
    w = StoreWorker(store, num_threads=1)
    block = np.ones(1024, np.uint8)
    ref = weakref.ref(block)
    h = w.put(["a"], [block])
    del block
    store.gate.set()
    assert store.started.acquire(timeout=10)
    for _ in range(200):  # until the job has finished (its result waits for poll)
        if w._done.qsize():
            break
        threading.Event().wait(0.01)
    gc.collect()
    assert ref() is not None  # finished but not acknowledged: still held
    (r,), _ = w.wait([h], 10)
    gc.collect()
    assert r.succeeded and ref() is None  # polled: released
    w.close()


def test_store_exceptions_and_contract_violations_come_back_as_errors():
    w = StoreWorker(BrokenStore(1 << 20), num_threads=1)
    hg = w.get_into(["a"], [bytearray(4)])
    hl = w.lookup(["a"])
    res, _ = w.wait([hg, hl], 10)
    errs = {r.handle.kind: r.error for r in res}
    assert isinstance(errs[JobKind.GET], ConnectionError)
    assert isinstance(errs[JobKind.LOOKUP], TypeError)
    assert not any(r.succeeded for r in res) and all(r.ok is None for r in res)
    w.close()


def test_bad_arguments_raise_at_submit_and_queue_nothing():
    w = StoreWorker(MemoryStore(100), num_threads=1)
    with pytest.raises(StoreKeyError):
        w.lookup(["bad key"])
    with pytest.raises(StoreBufferError):
        w.get_into(["a"], [b"read-only"])
    with pytest.raises(StoreBufferError):
        w.put(["a", "b"], [b"1"])
    assert w.pending == 0
    w.close()
    for bad in ({"num_threads": 0}, {"max_pending": 0}, {"num_threads": True}):
        with pytest.raises(ValueError):
            StoreWorker(MemoryStore(1), **bad)


def test_close_drains_by_default():
    store = MemoryStore(1 << 20)
    w = StoreWorker(FaultyStore(store, fail_rate=0.0, delay=0.01, seed=1), num_threads=2)
    hs = [w.put([f"k{i}"], [b"x" * 8]) for i in range(10)]
    w.close()
    res = w.poll()
    assert sorted(r.handle.job_id for r in res) == sorted(h.job_id for h in hs)
    assert all(r.succeeded for r in res) and store.batch_exists([f"k{i}" for i in range(10)]) == 10
    with pytest.raises(StoreClosedError):
        w.lookup(["a"])
    assert all(not t.is_alive() for t in w._threads)


def test_close_with_cancel_skips_queued_jobs():
    store = GatedStore()
    w = StoreWorker(store, num_threads=1)
    first = w.put(["a"], [b"1"])
    assert store.started.acquire(timeout=10)  # `first` is running, the rest are queued
    rest = [w.put([f"k{i}"], [b"2"]) for i in range(4)]
    closer = threading.Thread(target=w.close, kwargs={"cancel": True})
    closer.start()
    while not w._closed:
        threading.Event().wait(0.005)
    store.gate.set()
    closer.join(10)
    res = {r.handle.job_id: r for r in w.poll()}
    assert res[first.job_id].succeeded  # a running job always finishes
    assert all(res[h.job_id].cancelled and not res[h.job_id].succeeded for h in rest)
    assert store.batch_exists(["k0"]) == 0  # cancelled jobs wrote nothing
