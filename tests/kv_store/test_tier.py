"""StoreTier: host-tier events to puts with pinned slots, and request prefetches chunk by chunk."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvjax.config import CacheConfig
from kvjax.kv_store import (
    MemoryStore,
    PrefetchPolicy,
    PrefetchState,
    StoreTier,
    WritePolicy,
    namespace_for_pool,
)
from kvjax.ledger.block_hashing import prompt_block_hashes

CFG = CacheConfig(tokens_per_block=4, num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=256, primary_blocks=8,
                  secondary_blocks=32)
NS = namespace_for_pool(CFG, CFG.pools[0], model="m")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Gated(MemoryStore):
    """Gets wait on a per-call event, in call order, so tests finish chunks one by one."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.gates: list[threading.Event] = []
        self.calls = 0
        self.lock = threading.Lock()

    def batch_get_into(self, keys, buffers):
        with self.lock:
            i = self.calls
            self.calls += 1
        assert self.gates[i].wait(30)
        return super().batch_get_into(keys, buffers)


def until(tier: StoreTier, cond, *, out=None):
    for _ in range(2000):
        s = tier.step()
        if out is not None:
            out.append(s)
        if cond():
            return
        threading.Event().wait(0.005)
    raise AssertionError("condition never held")


def host(n: int = 32) -> np.ndarray:
    return np.arange(n * 64, dtype=np.uint8).reshape(n, 64) % 251


def test_write_through_pins_slots_until_polled_and_restores_later():
    store = MemoryStore(1 << 20)
    clock = Clock()
    tier = StoreTier(store, NS, prefetch_policy=PrefetchPolicy("wait_complete", tokens_per_block=4, min_hit_tokens=8),
                     clock=clock, get_chunk_blocks=2)
    hp = host()
    hashes = prompt_block_hashes(list(range(41)), 4)  # 10 blocks
    slots = list(range(10))
    tier.host_stored(hashes, slots, [hp[s] for s in slots])
    assert tier.puts_submitted == 10 and tier.pinned_slots() <= set(slots)
    assert tier.host_evicting(hashes[:1], slots[:1], [hp[0]]) <= {0}  # write_through: nothing new to write
    steps: list = []
    until(tier, lambda: not tier.pinned_slots(), out=steps)
    released = sorted(s for st in steps for s in st.released_slots)
    assert released == slots and all(not st.failed_puts for st in steps)

    # a later request: its chain past a local hit of 2 blocks
    assert tier.consult("r1", hashes[2:], missing_tokens=32)
    until(tier, lambda: tier.state("r1")[0] is PrefetchState.FOUND)
    assert tier.state("r1") == (PrefetchState.FOUND, 8)
    dst = np.zeros_like(hp)
    dslots = [20, 21, 22, 23, 24, 25, 26, 27]
    tier.fetch("r1", dslots, [dst[s] for s in dslots])
    assert tier.pinned_slots() == set(dslots)
    until(tier, lambda: not tier.pinned_slots())
    d = tier.decide("r1", scheduler_ready=True)
    assert (d.stop, d.use_blocks) == (True, 8) and tier.state("r1") == (PrefetchState.DONE, 8)
    for i, s in enumerate(dslots):
        np.testing.assert_array_equal(dst[s], hp[slots[2 + i]])
    tier.forget("r1")
    tier.close()


def test_write_back_keeps_evicted_slots_pinned_until_the_put_is_polled():
    store = MemoryStore(1 << 20)
    tier = StoreTier(store, NS, prefetch_policy=PrefetchPolicy("best_effort", tokens_per_block=4),
                     write_policy=WritePolicy("write_back"))
    hp = host()
    hashes = prompt_block_hashes(list(range(13)), 4)  # 3 blocks
    tier.host_stored(hashes, [0, 1, 2], [hp[0], hp[1], hp[2]])
    assert tier.puts_submitted == 0 and not tier.pinned_slots()
    pinned = tier.host_evicting(hashes[:2], [0, 1], [hp[0], hp[1]])
    assert pinned <= {0, 1} and tier.puts_submitted == 2
    until(tier, lambda: not tier.pinned_slots())
    assert store.batch_exists(tier.keys(hashes[:2])) == 2 and store.batch_exists(tier.keys(hashes[2:])) == 0
    tier.close()


def test_timeout_stop_uses_the_chunks_already_in_and_keeps_late_slots_pinned():
    store = Gated()
    clock = Clock()
    tier = StoreTier(store, NS, clock=clock, get_chunk_blocks=2,
                     prefetch_policy=PrefetchPolicy("timeout", tokens_per_block=4, min_hit_tokens=4, timeout_base_s=1.0,
                                                    timeout_per_block_s=0.0))
    hp = host()
    hashes = prompt_block_hashes(list(range(25)), 4)  # 6 blocks -> 3 chunks
    keys = tier.keys(hashes)
    store.batch_put(keys, [hp[i] for i in range(6)])
    store.gates = [threading.Event() for _ in range(3)]
    assert tier.consult("r", hashes, missing_tokens=24)
    until(tier, lambda: tier.state("r")[0] is PrefetchState.FOUND)
    dst = np.zeros_like(hp)
    tier.fetch("r", list(range(10, 16)), [dst[s] for s in range(10, 16)])
    store.gates[0].set()  # chunk 0 arrives
    until(tier, lambda: 10 not in tier.pinned_slots())
    assert not tier.decide("r", scheduler_ready=True).stop  # before the deadline: wait
    clock.t = 1.0
    d = tier.decide("r", scheduler_ready=False)
    assert (d.stop, d.use_blocks) == (True, 2) and tier.state("r") == (PrefetchState.DONE, 2)
    assert tier.pinned_slots() == {12, 13, 14, 15}  # late chunks still write there
    np.testing.assert_array_equal(dst[10:12], hp[0:2])
    store.gates[1].set()
    store.gates[2].set()
    until(tier, lambda: not tier.pinned_slots())
    assert tier.state("r") == (PrefetchState.DONE, 2)  # late arrivals change nothing
    tier.close()


class FailsOneKey(MemoryStore):
    """Present for lookups, but reading `bad` fails (a torn read, a lost file)."""

    bad = ""

    def batch_get_into(self, keys, buffers):
        out = super().batch_get_into(keys, buffers)
        return [ok and k != self.bad for k, ok in zip(keys, out, strict=True)]


def test_a_failed_chunk_ends_the_prefix_there():
    store = FailsOneKey(1 << 20)
    hp = host()
    hashes = prompt_block_hashes(list(range(33)), 4)  # 8 blocks -> 4 chunks of 2
    tier = StoreTier(store, NS, get_chunk_blocks=2,
                     prefetch_policy=PrefetchPolicy("wait_complete", tokens_per_block=4, min_hit_tokens=4))
    store.batch_put(tier.keys(hashes), [hp[i] for i in range(8)])
    store.bad = tier.keys(hashes)[5]
    assert tier.consult("r", hashes, missing_tokens=32)
    until(tier, lambda: tier.state("r")[0] is PrefetchState.FOUND)
    assert tier.state("r") == (PrefetchState.FOUND, 8)
    dst = np.zeros_like(hp)
    tier.fetch("r", list(range(8)), [dst[i] for i in range(8)])
    until(tier, lambda: not tier.pinned_slots())
    d = tier.decide("r", scheduler_ready=False)  # wait_complete, yet it stops: the chain is broken
    assert (d.stop, d.use_blocks) == (True, 4)  # chunks 0 and 1 whole; chunk 2 (blocks 4-5) failed
    np.testing.assert_array_equal(dst[:4], hp[:4])
    tier.close()


def test_policy_gates_and_bad_calls():
    tier = StoreTier(MemoryStore(1 << 20), NS,
                     prefetch_policy=PrefetchPolicy("best_effort", tokens_per_block=4, min_hit_tokens=16))
    hashes = prompt_block_hashes(list(range(33)), 4)
    assert not tier.consult("short", hashes[:2], missing_tokens=8)  # below the minimum
    assert tier.consult("r", hashes, missing_tokens=32)
    with pytest.raises(ValueError, match="already"):
        tier.consult("r", hashes, missing_tokens=32)
    until(tier, lambda: tier.state("r")[0] is PrefetchState.DONE)
    assert tier.state("r") == (PrefetchState.DONE, 0)  # empty store: nothing to fetch
    with pytest.raises(ValueError, match="not found"):
        tier.fetch("r", [0], [np.zeros(64, np.uint8)])
    with pytest.raises(ValueError, match="one of each"):
        tier.host_stored(hashes[:2], [0], [np.zeros(64, np.uint8)])
    with pytest.raises(ValueError, match="tokens per block"):
        StoreTier(MemoryStore(1), NS, prefetch_policy=PrefetchPolicy("best_effort", tokens_per_block=16))
    tier.close()
