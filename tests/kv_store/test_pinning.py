"""Why a host slot stays pinned until its put is polled: reusing it early stores another
block's bytes under the first block's key (SGLang's partial restores); keeping it pinned, as
`WritePolicy` tracks, restores every block exactly."""
from __future__ import annotations

import threading

import numpy as np

from kvjax.kv_store import MemoryStore, StoreWorker, WritePolicy


class HeldPuts(MemoryStore):
    """Puts wait for `release`: the store is slower than the engine."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.release = threading.Event()

    def batch_put(self, keys, buffers):
        assert self.release.wait(30)
        return super().batch_put(keys, buffers)


def content(key: str) -> np.ndarray:
    return np.full(64, int(key[1:]), np.uint8)


def run(pin: bool) -> dict[str, bool]:
    """Host tier of one slot; write_through of x, then y needs the slot while x's put runs."""
    store = HeldPuts()
    worker = StoreWorker(store, num_threads=1)
    policy = WritePolicy("write_through")
    host = np.zeros((1, 64), np.uint8)
    pinned: dict[int, int] = {}  # slot -> job id of the put that reads it

    host[0] = content("k1")
    (k,) = policy.on_host_stored(["k1"])
    pinned[0] = worker.put([k], [host[0]]).job_id
    assert policy.on_host_evicted(["k1"]) == []  # write_through: already being written
    if pin:  # the slot may be reused only once the put's result has been polled
        store.release.set()
        while pinned:
            for r in worker.poll(timeout=0.05):
                policy.on_store_result(r.keys, r.ok)
                pinned = {s: j for s, j in pinned.items() if j != r.handle.job_id}
    host[0] = content("k2")  # the slot now holds another block
    store.release.set()
    while worker.pending:
        worker.poll(timeout=0.05)
    buf = np.zeros(64, np.uint8)
    ok = store.batch_get_into(["k1"], [buf]) == [True]
    worker.close()
    return {"stored": ok, "exact": ok and bool((buf == content("k1")).all())}


def test_reusing_a_slot_before_the_put_is_polled_corrupts_the_stored_block():
    assert run(pin=False) == {"stored": True, "exact": False}


def test_pinned_until_polled_restores_exactly():
    assert run(pin=True) == {"stored": True, "exact": True}
