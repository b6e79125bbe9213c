"""RedisStore against a real redis-server (started by the session fixture, stopped by pid)."""
from __future__ import annotations

import numpy as np
import pytest
import redis
from kv_store_helpers import start_redis

from kvjax.kv_store import RedisStore, StoreIOError, StoreWorker, load_store


def test_keys_live_under_the_prefix_with_ttl(redis_server):
    s = load_store(redis_server.url + "?prefix=ns1:&ttl_s=100")
    assert s.batch_put(["a", "b"], [b"1", np.arange(4, dtype=np.int32)]) == [True, True]
    raw = redis.Redis.from_url(redis_server.url)
    assert sorted(raw.keys("ns1:*")) == [b"ns1:a", b"ns1:b"]
    assert 0 < raw.ttl("ns1:a") <= 100
    assert raw.get("ns1:b") == np.arange(4, dtype=np.int32).tobytes()
    other = RedisStore(redis_server.url, prefix="ns2:")
    assert other.batch_exists(["a"]) == 0  # another prefix sees nothing
    no_ttl = RedisStore(redis_server.url, prefix="ns3:")
    no_ttl.batch_put(["a"], [b"1"])
    assert raw.ttl("ns3:a") == -1
    for st in (s, other, no_ttl):
        st.close()
    raw.close()


def test_a_large_batch_is_one_pipeline(redis_server):
    s = RedisStore(redis_server.url, prefix="big:")
    keys = [f"k{i}" for i in range(500)]
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, 1024, dtype=np.uint8) for _ in keys]
    assert all(s.batch_put(keys, data))
    assert s.batch_exists(keys) == 500
    out = np.zeros((500, 1024), np.uint8)
    assert all(s.batch_get_into(keys, list(out)))
    np.testing.assert_array_equal(out, np.stack(data))
    assert s.remove(keys) == 500 and s.batch_exists(keys) == 0
    s.close()


def test_worker_over_redis(redis_server):
    s = RedisStore(redis_server.url, prefix="w:")
    w = StoreWorker(s, num_threads=2)
    h = w.put(["a", "b"], [b"xx", b"yy"])
    (r,), _ = w.wait([h], 10)
    assert r.ok == (True, True)
    bufs = [bytearray(2), bytearray(2)]
    (r,), _ = w.wait([w.get_into(["a", "b"], bufs)], 10)
    assert r.ok == (True, True) and bufs == [bytearray(b"xx"), bytearray(b"yy")]
    w.close()
    s.close()


def test_a_dead_server_fails_whole_batches_with_store_io_error():
    server = start_redis()  # its own server: this test stops it
    try:
        s = RedisStore(server.url, prefix="d:", socket_timeout_s=2.0)
        assert s.batch_put(["a"], [b"1"]) == [True]
        server.stop()
        with pytest.raises(StoreIOError, match="Redis"):
            s.batch_get_into(["a"], [bytearray(1)])
        with pytest.raises(StoreIOError):
            s.batch_put(["a"], [b"1"])
        with pytest.raises(StoreIOError):
            s.batch_exists(["a"])
        w = StoreWorker(s, num_threads=1)
        (r,), _ = w.wait([w.get_into(["a"], [bytearray(1)])], 10)
        assert isinstance(r.error, StoreIOError) and not r.succeeded
        w.close()
        s.close()
    finally:
        server.stop()


def test_bad_parameters():
    with pytest.raises(ValueError, match="ttl_s"):
        RedisStore("redis://127.0.0.1:1/0", ttl_s=0)
    with pytest.raises(ValueError, match="prefix"):
        RedisStore("redis://127.0.0.1:1/0", prefix=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Redis URL"):
        RedisStore("http://127.0.0.1:1/0")


def test_missing_redis_server_fails_unless_skipped_on_request(monkeypatch):
    import kv_store_helpers

    monkeypatch.setattr(kv_store_helpers.shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("KVJAX_SKIP_REDIS_TESTS", "1")
    with pytest.raises(pytest.fail.Exception, match="CI must run them"):  # CI may not opt out
        start_redis()
    monkeypatch.delenv("CI")
    monkeypatch.delenv("KVJAX_SKIP_REDIS_TESTS")
    with pytest.raises(pytest.fail.Exception, match="KVJAX_SKIP_REDIS_TESTS=1"):
        start_redis()
    monkeypatch.setenv("KVJAX_SKIP_REDIS_TESTS", "1")
    with pytest.raises(pytest.skip.Exception, match="on request"):
        start_redis()


def test_a_full_server_refuses_puts_per_key():
    """With maxmemory reached and no eviction, Redis answers OOM to a SET: that key is False
    (so may later keys of the same pipeline be, while its input buffer counts as used memory),
    the keys before it went through, nothing partial is readable, and with room it works."""
    server = start_redis()
    try:
        raw = redis.Redis.from_url(server.url)
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", str(raw.info("memory")["used_memory"] + (256 << 10)))
        s = RedisStore(server.url, prefix="oom:")
        ok = s.batch_put(["small", "huge"], [b"s" * 100, b"h" * (1 << 20)])
        assert ok == [True, False]
        assert s.batch_exists(["huge"]) == 0 and s.batch_get_into(["huge"], [bytearray(1 << 20)]) == [False]
        buf = bytearray(100)
        assert s.batch_get_into(["small"], [buf]) == [True] and bytes(buf) == b"s" * 100
        raw.config_set("maxmemory", "0")  # room again: the same put now succeeds
        assert s.batch_put(["huge"], [b"h" * (1 << 20)]) == [True]
        assert s.stats.put_failures == 1 and s.stats.puts == 2
        s.close()
        raw.close()
    finally:
        server.stop()
