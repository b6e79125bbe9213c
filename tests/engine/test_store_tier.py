"""The third KV tier in the engine (`kvjax.engine.store_tier_driver`) on the micro model: a
restarted engine finds its blocks in a file store, two live engines share one redis-server, a
store failing at random never costs a request nor changes a token, each write policy writes
what it should on one deterministic trace, STORAGE events reach the publisher, and a cache
without host blocks is refused."""
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import ROOMY, cache, engine_config

from kvjax import SamplingParams
from kvjax.engine import Engine, LLMEngine
from kvjax.engine.store_tier_driver import KVStoreConfig
from kvjax.errors import InvalidArgumentError
from kvjax.kv_store import FaultyStore, FileStore, MemoryStore

MODEL_ID = "micro@seed0"


def store_engine(micro, store=None, *, secondary=32, **kw) -> LLMEngine:
    """An engine on the shared runner and the engine tests' ROOMY geometry (their compiled shapes)."""
    kv = None
    if store is not None:
        kv = KVStoreConfig(store=store, close_store=False, model_id=MODEL_ID,
                           **{"prefetch_policy": "wait_complete", "prefetch_min_tokens": 16, **kw})
    return LLMEngine(Engine(micro.model, engine_config(), runner=micro.runner),
                     cache(micro.model, primary=ROOMY, secondary=secondary), kv_store=kv)


def serve(eng: LLMEngine, prompts, tag: str, max_tokens: int = 4) -> dict:
    """Every prompt at once, to completion: request id -> final RequestOutput."""
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=max_tokens))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert len(done) == len(prompts)
    return done


def settle(eng: LLMEngine, timeout: float = 30.0) -> None:
    """Step an idle engine until its store jobs in flight are all polled (puts acknowledged)."""
    worker = eng.core.store_tier.tier.worker
    deadline = time.monotonic() + timeout
    while worker.pending:
        assert time.monotonic() < deadline, "store jobs still pending"
        eng.step()
        time.sleep(0.001)


def tokens(outs: dict) -> list:
    return [list(outs[k].outputs[0].token_ids) for k in sorted(outs, key=lambda k: int(k[1:]))]


RNG = np.random.default_rng(7)
TARGET = RNG.integers(1, 500, 100).tolist()  # 12 reusable blocks of 8 tokens
FILLERS = [RNG.integers(1, 500, 90).tolist() for _ in range(9)]  # push TARGET out of the 96 primary blocks


def test_restart_finds_blocks_in_file_store(micro, tmp_path):
    store = FileStore(tmp_path / "kv", 1 << 26)
    a = store_engine(micro, store)
    first = serve(a, [TARGET], "a")
    serve(a, FILLERS, "f")  # TARGET's blocks are offloaded to host, written through to the store
    a.close()  # waits for the puts in flight
    assert a.core.store_tier.stats()["store_puts"] > 0
    store.close()

    store = FileStore(tmp_path / "kv", 1 << 26)  # a new process would open the directory the same way
    b = store_engine(micro, store)
    again = serve(b, [TARGET], "b")
    assert again["b0"].num_cached_tokens == 96  # every reusable block came back from the store
    assert tokens(again) == tokens(first)
    st = b.core.store_tier.stats()
    assert st["driver_restored_blocks"] == 12 and st["store_hits"] == 12
    b.core.verify_idle()
    b.close()
    store.close()


def test_two_engines_share_one_redis(micro, redis_server):
    from kvjax.kv_store import RedisStore

    sa, sb = RedisStore(redis_server.url, prefix="share:"), RedisStore(redis_server.url, prefix="share:")
    a, b = store_engine(micro, sa), store_engine(micro, sb)
    first = serve(a, [TARGET], "a")
    serve(a, FILLERS, "f")
    settle(a)
    before = b.core.counters.reused_prompt_tokens
    other = serve(b, [TARGET], "b")  # b never saw TARGET: its blocks come from a's writes
    assert other["b0"].num_cached_tokens == 96 and b.core.counters.reused_prompt_tokens - before == 96
    assert tokens(other) == tokens(first)
    for e in (a, b):
        e.core.verify_idle()
        e.close()
    sa.close()
    sb.close()


def test_faulty_store_loses_no_request_and_changes_no_token(micro):
    prompts = [TARGET, TARGET[:60] + FILLERS[0][:40], *FILLERS, TARGET[:80] + FILLERS[1][:30]]
    plain = tokens(serve(store_engine(micro), prompts, "p"))
    inner = MemoryStore(1 << 26)
    for seed in (1, 2):  # two restarts on the same store, each failing at random
        faulty = FaultyStore(inner, fail_rate=0.3, seed=seed, fail_lookups=True)
        eng = store_engine(micro, faulty, prefetch_policy="timeout", prefetch_timeout_s=0.05)
        got = serve(eng, prompts, "p")
        assert tokens(got) == plain
        eng.core.verify_idle()  # ledger integrity included
        eng.close()
    assert inner.stats.puts > 0 and inner.stats.hits > 0  # the store did serve blocks between failures


def record_notices(eng: LLMEngine) -> dict:
    """Wrap the ledger's `take_host_notices`: kind name -> [block hashes], in order."""
    led = eng.core.ledger
    seen: dict = {"STORED": [], "HIT": [], "EVICTING": []}
    take = led.take_host_notices

    def recording():
        out = take()
        for n in out:
            seen[n.kind.name].append(n.block_hash)
        return out

    led.take_host_notices = recording
    return seen


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_write_policies_on_one_trace(micro, policy):
    """Host writes (offloads) are the same under every policy; store writes follow it: each
    block the host tier stored, once; each block used a second time (stored + a hit), once;
    each block the host tier evicted."""
    store = MemoryStore(1 << 26)
    eng = store_engine(micro, store, write_policy=policy, prefetch_min_tokens=10_000)  # writes only
    seen = record_notices(eng)
    serve(eng, [TARGET], "t")
    serve(eng, FILLERS, "f")  # TARGET to host
    serve(eng, [TARGET], "h")  # host hits: onboarded
    serve(eng, FILLERS + [f[::-1] for f in FILLERS], "g")  # the 32 host blocks overflow: evictions
    eng.close()  # waits for the puts
    counts = {k: len(v) for k, v in seen.items()}
    assert counts == {"STORED": 231, "HIT": 69, "EVICTING": 130}  # the same under every policy
    tier = eng.core.store_tier.tier
    keys = {kind: set(tier.keys([h for h in hashes if h is not None])) for kind, hashes in seen.items()}
    in_store = {k for k in keys["STORED"] | keys["HIT"] | keys["EVICTING"] if store.batch_exists([k])}
    source = {"write_through": "STORED", "write_through_selective": "HIT", "write_back": "EVICTING"}[policy]
    if policy == "write_through_selective":  # only blocks used twice: stored, then hit
        assert in_store <= keys["HIT"] and len(in_store) >= len(keys["HIT"]) - 1
    else:  # every block the host tier stored / let go, and nothing else
        assert in_store == keys[source]
    # each such block written at least once, at most once per notice (a block evicted and
    # stored again is written again: the policy forgets blocks that left the host tier)
    assert len(in_store) <= store.stats.puts <= counts[source]
    assert eng.core.store_tier.stats()["puts_dropped"] == 0


def test_storage_events_reach_the_publisher(micro):
    eng = store_engine(micro, MemoryStore(1 << 26))
    sent = []
    core = eng.core
    core.events = type("Recorder", (), {"publish": lambda self, led: None,
                                         "publish_wire": lambda self, evs: sent.extend(evs),
                                         "close": lambda self: None})()
    core.store_tier._events = []  # as if the engine had been built with kv_events
    serve(eng, [TARGET], "t")
    serve(eng, FILLERS, "f")
    settle(eng)
    stored = [h for e in sent if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    assert sent and all(e.medium == "STORAGE" for e in sent)
    assert len(stored) == eng.core.store_tier.stats()["store_puts"]
    from kvjax.ledger.block_hashing import prompt_block_hashes

    assert set(prompt_block_hashes(TARGET, 8)) <= set(stored)
    eng.close()


def test_a_store_needs_host_blocks(micro):
    with pytest.raises(InvalidArgumentError, match="secondary_blocks"):
        store_engine(micro, MemoryStore(1 << 20), secondary=0)
    with pytest.raises(InvalidArgumentError, match="model_id"):
        KVStoreConfig(url="memory://", model_id="")


def test_options_build_the_tier(micro):
    """`kv_store*` keyword options (what `kvjax.LLM` passes on) reach the engine's tier; a model
    object has no name to key the store by, so it needs `kv_store_model_id`."""
    opts = dict(tokens_per_block=8, max_seq_len=256, primary_blocks=ROOMY, secondary_blocks=32)
    eng = LLMEngine.from_options(micro.model, runner=micro.runner, kv_store="memory://?max_bytes=1MiB",
                                 kv_store_model_id="micro@seed0", kv_store_write_policy="write_back",
                                 kv_store_prefetch_policy="best_effort", kv_store_prefetch_min_tokens=32, **opts)
    cfg = eng.core.store_tier.config
    assert (cfg.url, cfg.write_policy, cfg.prefetch_policy, cfg.prefetch_min_tokens) == (
        "memory://?max_bytes=1MiB", "write_back", "best_effort", 32)
    eng.close()
    with pytest.raises(InvalidArgumentError, match="kv_store_model_id"):
        LLMEngine.from_options(micro.model, runner=micro.runner, kv_store="memory://", **opts)
    with pytest.raises(InvalidArgumentError, match="needs kv_store"):
        LLMEngine.from_options(micro.model, runner=micro.runner, kv_store_write_policy="write_back", **opts)


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv_store"))  # the redis-server helper


@pytest.fixture(scope="module")
def redis_server():
    from kv_store_helpers import start_redis

    server = start_redis()
    yield server
    server.stop()
