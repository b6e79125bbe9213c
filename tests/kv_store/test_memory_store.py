"""MemoryStore: an LRU bounded by value bytes."""
from __future__ import annotations

import pytest

from kvjax.kv_store import MemoryStore


def test_lru_by_bytes_evicts_least_recently_used():
    s = MemoryStore(300)
    s.batch_put(["a", "b", "c"], [b"a" * 100, b"b" * 100, b"c" * 100])
    assert s.batch_get_into(["a"], [bytearray(100)]) == [True]  # a is now most recent
    s.batch_put(["d"], [b"d" * 150])  # needs 150: evicts b, then c
    assert s.batch_exists(["a"]) == 1 and s.batch_exists(["d"]) == 1
    assert s.batch_exists(["b"]) == 0 and s.batch_exists(["c"]) == 0
    assert s.used_bytes == 250 and len(s) == 2 and s.stats.evictions == 2


def test_value_larger_than_budget_is_refused_without_evicting():
    s = MemoryStore(100)
    s.batch_put(["a"], [b"a" * 60])
    assert s.batch_put(["big", "b"], [b"x" * 101, b"b" * 40]) == [False, True]
    assert s.batch_exists(["a", "b"]) == 2 and s.batch_exists(["big"]) == 0 and s.used_bytes == 100


def test_overwrite_accounts_bytes_once():
    s = MemoryStore(100)
    s.batch_put(["a"], [b"1" * 80])
    s.batch_put(["a"], [b"2" * 90])
    assert s.used_bytes == 90 and len(s) == 1


def test_copies_the_value_at_put_time():
    s = MemoryStore(100)
    buf = bytearray(b"before")
    s.batch_put(["a"], [buf])
    buf[:] = b"after!"
    out = bytearray(6)
    s.batch_get_into(["a"], [out])
    assert bytes(out) == b"before"


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_bad_budget(bad):
    with pytest.raises(ValueError, match="max_bytes"):
        MemoryStore(bad)
