"""`FaultyStore`: wraps a store and injects seeded failures and delays, for tests.

Modelled on SGLang's `HiCacheStorageFailureInjector`. A failed get scribbles over the target
buffer before reporting False (so a caller that trusted a False buffer would see garbage, not
plausible bytes); a failed put writes nothing, as a put that dies before its rename would.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvjax.kv_store.interface import KVStore, check_batch, check_keys


class FaultyStore:
    """Each key of a put or get fails with probability `fail_rate` (one seeded RNG shared by
    all threads, so a single-threaded run is reproducible); every call first sleeps a random
    time in [0, `delay`] seconds. `fail_lookups` also lets `batch_exists` under-report (cut
    the answer at a random point). Counters: `failed_puts`, `failed_gets`."""

    def __init__(self, store: KVStore, fail_rate: float = 0.1, delay: float = 0.0, seed: int = 0, *,
                 fail_lookups: bool = False) -> None:
        if isinstance(fail_rate, bool) or not isinstance(fail_rate, (int, float)) or not 0.0 <= fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be in [0, 1], got {fail_rate!r}")
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not delay >= 0:
            raise ValueError(f"delay must be a number of seconds >= 0, got {delay!r}")
        self.store = store
        self.fail_rate = float(fail_rate)
        self.delay = float(delay)
        self.fail_lookups = fail_lookups
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.failed_puts = 0
        self.failed_gets = 0

    def _draw(self, n: int) -> tuple[float, list[bool]]:
        with self._lock:
            pause = self._rng.uniform(0.0, self.delay) if self.delay else 0.0
            return pause, [self._rng.random() < self.fail_rate for _ in range(n)]

    def batch_exists(self, keys: Sequence[str]) -> int:
        pause, fails = self._draw(len(keys))
        if pause:
            time.sleep(pause)
        n = self.store.batch_exists(keys)
        if self.fail_lookups and any(fails[:n]):
            n = fails.index(True)
        return n

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ks, _ = check_batch(keys, buffers, writable=False)
        pause, fails = self._draw(len(ks))
        if pause:
            time.sleep(pause)
        keep = [i for i, f in enumerate(fails) if not f]
        out = [False] * len(ks)
        if keep:
            res = self.store.batch_put([ks[i] for i in keep], [buffers[i] for i in keep])
            for i, r in zip(keep, res, strict=True):
                out[i] = r
        with self._lock:
            self.failed_puts += len(ks) - len(keep)
        return out

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ks, views = check_batch(keys, buffers, writable=True)
        pause, fails = self._draw(len(ks))
        if pause:
            time.sleep(pause)
        out = self.store.batch_get_into(ks, buffers)
        for i, f in enumerate(fails):
            if f:
                v = views[i]
                v[: v.nbytes // 2] = b"\xa5" * (v.nbytes // 2)  # a torn read: half the bytes garbage
                out[i] = False
        with self._lock:
            self.failed_gets += sum(fails)
        return out

    def remove(self, keys: Sequence[str]) -> int:
        return self.store.remove(check_keys(keys))

    def close(self) -> None:
        self.store.close()



