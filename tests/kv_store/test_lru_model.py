"""MemoryStore and FileStore against a reference LRU model on seeded random operation
sequences (puts of varied sizes, gets of right and wrong sizes, removes, FileStore reopens)."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from kvjax.kv_store import FileStore, MemoryStore

BUDGET = 1000


class Model:
    def __init__(self) -> None:
        self.d: OrderedDict[str, bytes] = OrderedDict()

    def used(self) -> int:
        return sum(map(len, self.d.values()))

    def put(self, k: str, v: bytes) -> bool:
        if len(v) > BUDGET:
            return False
        self.d.pop(k, None)
        self.d[k] = v
        while self.used() > BUDGET:
            self.d.popitem(last=False)
        return True

    def get(self, k: str, n: int) -> bytes | None:
        v = self.d.get(k)
        if v is None or len(v) != n:
            return None
        self.d.move_to_end(k)
        return v


@pytest.mark.parametrize("kind", ["memory", "file"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_lru(kind, seed, tmp_path):
    rng = np.random.default_rng(seed)
    make = (lambda: MemoryStore(BUDGET)) if kind == "memory" else (lambda: FileStore(tmp_path, BUDGET))
    store = make()
    model = Model()
    keys = [f"k{i}" for i in range(12)]
    for step in range(300):
        op = rng.choice(["put", "put", "get", "get", "exists", "remove", "reopen"])
        k = keys[int(rng.integers(len(keys)))]
        if op == "put":
            v = bytes(rng.integers(0, 256, int(rng.choice([10, 100, 250, 400, 1001])), dtype=np.uint8))
            assert store.batch_put([k], [v]) == [model.put(k, v)], step
        elif op == "get":
            want = model.d.get(k)
            n = len(want) if want is not None and rng.random() < 0.8 else int(rng.integers(1, 50))
            buf = bytearray(n)
            expect = model.get(k, n)
            assert store.batch_get_into([k], [buf]) == [expect is not None], step
            if expect is not None:
                assert bytes(buf) == expect
        elif op == "exists":
            chain = [keys[int(i)] for i in rng.integers(len(keys), size=3)]
            expect = next((i for i, c in enumerate(chain) if c not in model.d), 3)
            assert store.batch_exists(chain) == expect, step
        elif op == "remove":
            assert store.remove([k]) == int(model.d.pop(k, None) is not None), step
        elif kind == "file":  # reopen: the index comes back from the directory in LRU order
            store.close()
            store = make()
        assert store.used_bytes == model.used() and len(store) == len(model.d), step
    assert [k for k in keys if store.batch_exists([k])] == [k for k in keys if k in model.d]
    store.close()
