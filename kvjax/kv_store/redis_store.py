"""`RedisStore`: blocks as Redis string values (redis-py), one round trip per batch."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import redis

from kvjax.kv_store.errors import StoreClosedError, StoreIOError
from kvjax.kv_store.interface import check_batch, check_keys, longest_present_prefix
from kvjax.kv_store.stats import StoreStats
from kvjax.kv_store.url import redact


class RedisStore:
    """Values under `<prefix><key>` in one Redis database.

    `batch_exists` and `batch_put` are one non-transactional pipeline each (EXISTS per key;
    SET per key, with `EX ttl_s` when a TTL is set), `batch_get_into` one MGET. A Redis SET
    replaces a value whole, so a key is absent or complete. Eviction is Redis's own
    (`maxmemory` + `maxmemory-policy allkeys-lru` on the server) or the TTL. A lost
    connection or server error fails the whole batch with `StoreIOError`. redis-py's
    connection pool makes the client safe to share between threads.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "",
        ttl_s: int | None = None,
        socket_timeout_s: float = 5.0,
        client: redis.Redis | None = None,
    ) -> None:
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 1):
            raise ValueError(f"ttl_s must be a positive int (seconds) or None, got {ttl_s!r}")
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a str, got {prefix!r}")
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.stats = StoreStats()
        self._stats_lock = threading.Lock()
        self._closed = False
        if client is None:
            try:
                client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
            except ValueError as e:
                raise ValueError(f"invalid Redis URL {redact(url)!r}: {e}") from None
        self._client = client

    def _names(self, keys: list[str]) -> list[str]:
        return [self.prefix + k for k in keys]

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("RedisStore is closed")

    def batch_exists(self, keys: Sequence[str]) -> int:
        ks = check_keys(keys)
        self._check_open()
        if not ks:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for name in self._names(ks):
            pipe.exists(name)
        try:
            present = pipe.execute()
        except redis.RedisError as e:
            raise StoreIOError(f"Redis EXISTS failed: {e}") from e
        return longest_present_prefix([bool(p) for p in present])

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ks, views = check_batch(keys, buffers, writable=False)
        self._check_open()
        if not ks:
            return []
        pipe = self._client.pipeline(transaction=False)
        for name, v in zip(self._names(ks), views, strict=True):
            pipe.set(name, v, ex=self.ttl_s)  # a memoryview is sent as is: no extra copy
        try:
            results = pipe.execute(raise_on_error=False)
        except redis.RedisError as e:
            raise StoreIOError(f"Redis SET failed: {e}") from e
        out = [r is True for r in results]
        with self._stats_lock:
            for ok, v in zip(out, views, strict=True):
                if ok:
                    self.stats.puts += 1
                    self.stats.bytes_written += v.nbytes
                else:
                    self.stats.put_failures += 1
        return out

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        ks, views = check_batch(keys, buffers, writable=True)
        self._check_open()
        if not ks:
            return []
        try:
            values = list(self._client.mget(self._names(ks)))
        except redis.RedisError as e:
            raise StoreIOError(f"Redis MGET failed: {e}") from e
        out: list[bool] = []
        with self._stats_lock:
            for data, v in zip(values, views, strict=True):
                if data is None:
                    self.stats.misses += 1
                    out.append(False)
                elif not isinstance(data, bytes) or len(data) != v.nbytes:
                    self.stats.size_mismatches += 1
                    out.append(False)
                else:
                    v[:] = data
                    self.stats.hits += 1
                    self.stats.bytes_read += v.nbytes
                    out.append(True)
        return out

    def remove(self, keys: Sequence[str]) -> int:
        ks = check_keys(keys)
        self._check_open()
        if not ks:
            return 0
        try:
            return int(self._client.delete(*self._names(ks)))
        except redis.RedisError as e:
            raise StoreIOError(f"Redis DEL failed: {e}") from e

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()
