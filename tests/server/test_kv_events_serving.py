"""A serving engine publishes its KV events: a subscriber on 127.0.0.1 that joins after the
traffic rebuilds exactly the full blocks the serving ledger caches (per medium), the stream
starts with `AllBlocksCleared`, `/kv_events_info` says where to connect and how to hash, and
shutdown closes the sockets. `kvjax serve`'s --kv-events-* flags reach the engine."""
import dataclasses
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq

import kvjax.server
from kvjax import Request
from kvjax.cli import main
from kvjax.engine import KVEventsConfig, LLMEngine
from kvjax.kv_events import AllBlocksCleared, KVEventSubscriber
from kvjax.ledger.block_hashing import prompt_block_hashes
from kvjax.router import PrefixIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv_events"))
from kv_helpers import index_view, ledger_view  # noqa: E402

ANY = "tcp://127.0.0.1:*"
MODEL = "micro"


@pytest.mark.parametrize("event_hash", ["sha256", "trtllm64"])
def test_subscriber_rebuilds_the_serving_ledgers_blocks(stack, event_hash):
    plain = stack.engine()  # the stack's engine settings, with publishing on:
    cc = dataclasses.replace(plain.core.cache_config, event_hash=event_hash)
    engine = LLMEngine(plain.engine, cc, tokenizer=stack.tokenizer,
                       kv_events=KVEventsConfig(ANY, replay_endpoint=ANY, topic="micro@0", data_parallel_rank=3))
    assert engine.core.cache_config.event_buffer_max_size > 0  # turned on for publishing
    srv = stack.server(engine).start()
    try:
        http = httpx.Client(timeout=60)
        info = http.get(srv.url + "/kv_events_info").json()
        assert info["tokens_per_block"] == 8 and info["hash_kind"] == event_hash and info["status"] == "ok"
        ev = info["kv_events"]
        assert ev["endpoint"].startswith("tcp://127.0.0.1:") and ev["replay_endpoint"] != ev["endpoint"]
        assert ev["topic"] == "micro@0" and ev["data_parallel_rank"] == 3
        assert info["tokenizer"]["fingerprint"] == stack.tokenizer.fingerprint()
        system = [(5 * i) % 400 + 1 for i in range(40)]
        for i in range(6):  # shared prefixes, distinct suffixes; some long enough to evict
            prompt = system[: 16 + 4 * i] + [100 + i] * (3 + i)
            r = http.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20
        while srv.engine_loop.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        # a subscriber joining now: catch_up replays every batch from the first one
        index = PrefixIndex()
        with KVEventSubscriber(ev["endpoint"], replay_endpoint=ev["replay_endpoint"], topic="micro@0") as sub:
            batches = sub.catch_up()
            assert [s for s, _ in batches] == list(range(len(batches))) and len(batches) >= 2
            assert isinstance(batches[0][1].events[0], AllBlocksCleared)
            assert all(b.data_parallel_rank == 3 for _, b in batches)
            for _, b in batches:
                index.apply("r", b)
        ledger = engine.core.ledger
        assert index_view(index, "r", 1) == ledger_view(ledger)
        hashes = prompt_block_hashes(system[:24] + [7], 8, hash_kind=info["hash_kind"])
        assert index.match(hashes, ["r"])["r"].blocks == ledger.analyze_prefix_reuse(
            Request("q", system[:24] + [7])).reusable_blocks_all > 0
    finally:
        srv.stop()
    # shutdown closed the publisher: its port can be bound again
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    try:
        sock.bind(ev["endpoint"])
    finally:
        sock.close(linger=0)
        ctx.term()


def test_serve_kv_events_flags(monkeypatch, capsys):
    seen = {}

    def fake_serve(engine, config, *, host, port, log_level):
        seen.update(engine=engine, config=config)

    monkeypatch.setattr(kvjax.server, "serve", fake_serve)
    code = main(["serve", MODEL, "--tokens-per-block", "8", "--max-seq-len", "128", "--primary-blocks", "16",
                 "--kv-events-endpoint", ANY, "--kv-events-replay-endpoint", ANY, "--kv-events-topic", "t",
                 "--data-parallel-rank", "2", "--option", 'event_hash="trtllm64"', "--warmup", "none"])
    assert code == 0, capsys.readouterr().err
    info = seen["engine"].kv_events_info()
    assert info["endpoint"].startswith("tcp://127.0.0.1:") and info["topic"] == "t" and info["data_parallel_rank"] == 2
    assert seen["engine"].core.events.publisher._closed  # closed when serve returned
    assert seen["config"].tokenizer_source == MODEL
    assert seen["engine"].core.cache_config.event_hash == "trtllm64"  # the hash kind a router must use
    assert "KV events on tcp://127.0.0.1:" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--kv-events-endpoint", "127.0.0.1:5557"], "must look like tcp://HOST:PORT"),
    (["--kv-events-replay-endpoint", ANY], "need --kv-events-endpoint"),
    (["--kv-events-topic", "t"], "need --kv-events-endpoint"),
    (["--data-parallel-rank", "-1"], "expected an int >= 0"),
])
def test_serve_bad_kv_events_flags(flags, message, capsys):
    assert main(["serve", MODEL, *flags]) == 2
    assert message in capsys.readouterr().err
