"""Fixtures of the kv_store tests: one private redis-server per test process (started only
when a Redis test asks for it) and a factory of every built-in store."""
from __future__ import annotations

import itertools

import pytest
from kv_store_helpers import start_redis

from kvjax.kv_store import FileStore, MemoryStore, RedisStore

_prefixes = itertools.count()


@pytest.fixture(scope="session")
def redis_server():
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "file", "redis"])
def any_store(request, tmp_path):
    """Each built-in store with room for 1 MiB of values (Redis keys under a fresh prefix)."""
    if request.param == "memory":
        store = MemoryStore(1 << 20)
    elif request.param == "file":
        store = FileStore(tmp_path / "store", 1 << 20)
    else:
        server = request.getfixturevalue("redis_server")
        store = RedisStore(server.url, prefix=f"t{next(_prefixes)}:")
    yield store
    store.close()
