"""load_store: every URL form, and a typed error for every malformed one."""
from __future__ import annotations

import pytest
from kv_store_helpers import ExampleUserStore

from kvjax.kv_store import FileStore, KVStore, MemoryStore, RedisStore, StoreURLError, load_store
from kvjax.kv_store.sizes import parse_bytes


def test_memory_url():
    s = load_store("memory://?max_bytes=2MiB")
    assert isinstance(s, MemoryStore) and s.max_bytes == 2 << 20


def test_file_url(tmp_path):
    s = load_store(f"file://{tmp_path}/kv%20cache?max_bytes=1GB&fsync=yes")
    assert isinstance(s, FileStore) and s.max_bytes == 10**9 and s.fsync and s.root == f"{tmp_path}/kv cache"
    s.close()
    s = load_store(f"file://{tmp_path}?max_bytes=1000")
    assert not s.fsync
    s.close()


def test_redis_url_parses_without_connecting():
    s = load_store("redis://127.0.0.1:1/3?ttl_s=60&prefix=kvjax:&socket_timeout_s=0.5")
    assert isinstance(s, RedisStore) and s.ttl_s == 60 and s.prefix == "kvjax:"
    kw = s._client.connection_pool.connection_kwargs
    assert kw["port"] == 1 and kw["db"] == 3 and kw["socket_timeout"] == 0.5
    s.close()


def test_user_class_by_module_path():
    s = load_store("kv_store_helpers:ExampleUserStore?capacity=4096&label=x")
    assert isinstance(s, ExampleUserStore) and isinstance(s, KVStore) and s.capacity == 4096 and s.label == "x"
    assert s.batch_put(["a"], [b"1"]) == [True]


@pytest.mark.parametrize(
    "url,match",
    [
        ("", "non-empty"),
        ("memory://", "missing parameter"),
        ("memory://?max_bytes=lots", "byte size"),
        ("memory://?max_bytes=-5", "byte size"),
        ("memory://?max_bytes=1&max_bytes=2", "given twice"),
        ("memory://?max_bytes=1&colour=red", "unknown parameter"),
        ("memory://host?max_bytes=1", "no host or path"),
        ("memory://?max_bytes=1#frag", "fragment"),
        ("file://relative/dir?max_bytes=1", "local directory"),
        ("file:///?max_bytes=1", "absolute directory"),
        ("file:///tmp/x", "missing parameter"),
        ("file:///tmp/x?max_bytes=1&fsync=maybe", "fsync"),
        ("redis://?ttl_s=1", "needs a host"),
        ("redis://127.0.0.1:99999/0", "Port"),
        ("redis://127.0.0.1:6379/0?ttl_s=0", "ttl_s"),
        ("redis://127.0.0.1:6379/0?ttl_s=1.5", "ttl_s"),
        ("redis://127.0.0.1:6379/0?socket_timeout_s=x", "socket_timeout_s"),
        ("redis://127.0.0.1:6379/0?db=2", "unknown parameter"),
        ("s3://bucket/x", "unknown scheme"),
        ("not a url", "expected scheme"),
        ("kvjax.no_such_module:Store", "cannot import"),
        ("kv_store_helpers:Missing", "no class"),
        ("kv_store_helpers:NotAStore", "does not implement"),
        ("kv_store_helpers:ExampleUserStore", "failed"),
        ("kv_store_helpers:ExampleUserStore?capacity=big", "failed"),
        ("kv_store_helpers:ExampleUserStore?capacity=1&bogus=2", "failed"),
        ("kv_store_helpers:ExampleUserStore?capacity", "malformed"),
    ],
)
def test_malformed_urls(url, match):
    with pytest.raises(StoreURLError, match=match):
        load_store(url)


def test_a_refused_file_url_creates_nothing(tmp_path):
    with pytest.raises(StoreURLError):
        load_store(f"file://{tmp_path}/new?max_bytes=1&fsync=maybe")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("text,n", [("0", 0), ("17", 17), ("2KiB", 2048), ("3 MB", 3 * 10**6), ("1gib", 1 << 30), (5, 5)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "1.5GiB", "-1", "10 parsecs", True, -3, None])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_passwords_never_reach_error_messages():
    with pytest.raises(StoreURLError) as e:
        load_store("redis://user:s3cret@127.0.0.1:6379/0?ttl_s=-1")
    assert "s3cret" not in str(e.value) and "user:***@127.0.0.1:6379" in str(e.value)
    with pytest.raises(ValueError) as e2:
        RedisStore("http://user:s3cret@127.0.0.1:1/0")
    assert "s3cret" not in str(e2.value)
