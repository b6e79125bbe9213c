"""`MemoryStore`: a byte-bounded LRU dict in this process, for tests and single-process use."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvjax.kv_store.errors import StoreClosedError
from kvjax.kv_store.interface import check_batch, check_keys, longest_present_prefix
from kvjax.kv_store.stats import StoreStats


class MemoryStore:
    """Values held as `bytes` in an LRU `OrderedDict`, at most `max_bytes` of values in all.

    A put that does not fit evicts least recently used keys (a get or a put counts as a use); a
    value larger than `max_bytes` is refused (False) and evicts nothing. One lock guards the
    dict, so every method is safe from any thread; copies happen under it, which is what a
    memory store costs anyway.
    """

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._closed = False
        self.stats = StoreStats()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._data)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("MemoryStore is closed")

    def batch_exists(self, keys: Sequence[str]) -> int:
        ks = check_keys(keys)
        with self._lock:
            self._check_open()
            return longest_present_prefix([k in self._data for k in ks])

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ks, views = check_batch(keys, buffers, writable=False)
        out: list[bool] = []
        with self._lock:
            self._check_open()
            for k, v in zip(ks, views, strict=True):
                n = v.nbytes
                if n > self.max_bytes:
                    self.stats.put_failures += 1
                    out.append(False)
                    continue
                old = self._data.pop(k, None)
                if old is not None:
                    self._used -= len(old)
                while self._used + n > self.max_bytes:
                    _, ev = self._data.popitem(last=False)
                    self._used -= len(ev)
                    self.stats.evictions += 1
                self._data[k] = v.tobytes()
                self._used += n
                self.stats.puts += 1
                self.stats.bytes_written += n
                out.append(True)
        return out

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ks, views = check_batch(keys, buffers, writable=True)
        out: list[bool] = []
        with self._lock:
            self._check_open()
            for k, v in zip(ks, views, strict=True):
                data = self._data.get(k)
                if data is None:
                    self.stats.misses += 1
                    out.append(False)
                elif len(data) != v.nbytes:
                    self.stats.size_mismatches += 1
                    out.append(False)
                else:
                    v[:] = data
                    self._data.move_to_end(k)
                    self.stats.hits += 1
                    self.stats.bytes_read += len(data)
                    out.append(True)
        return out

    def remove(self, keys: Sequence[str]) -> int:
        ks = check_keys(keys)
        n = 0
        with self._lock:
            self._check_open()
            for k in ks:
                data = self._data.pop(k, None)
                if data is not None:
                    self._used -= len(data)
                    n += 1
        return n

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._data.clear()
            self._used = 0
