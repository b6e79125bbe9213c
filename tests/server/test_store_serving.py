"""`kvjax serve --kv-store ...` as users run it: two live servers share one real redis-server
(started on a free 127.0.0.1 port, stopped by pid), and a server restarted on the same file
store; each time the second server serves a prompt the first one served, with
`usage.prompt_tokens_details.cached_tokens` > 0 and the same tokens."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "kv_store"))  # the redis-server helper


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`kvjax serve micro --kv-store STORE` on a free port: `start()` launches it (several may
    start at once), `wait_healthy()` waits for /health, `complete()` sends one token-id prompt,
    `stop()` ends it with SIGTERM (finishing its store puts) and returns its exit code."""

    def __init__(self, tmp_path: Path, name: str, store: str) -> None:
        self.port = free_port()
        self.log = tmp_path / f"{name}.log"
        self.cmd = [sys.executable, "-m", "kvjax.cli", "serve", "micro", "--host", "127.0.0.1", "--port", str(self.port),
                    "--max-model-len", "192", "--block-size", "8", "--primary-blocks", "24", "--secondary-blocks", "32",
                    "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--option", "min_batch_bucket=4",
                    "--option", "min_chunk_bucket=64", "--option", "min_blocks_bucket=24", "--option", "prefill_rows=1",
                    "--warmup", "none", "--shutdown-timeout", "2", "--kv-store", store,
                    "--kv-store-prefetch-policy", "wait_complete", "--kv-store-prefetch-min-tokens", "16"]
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def start(self) -> Server:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return self

    def wait_healthy(self, limit: float = 120.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + limit
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "not healthy in time:\n" + self.log.read_text()[-3000:]
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def complete(self, prompt: list[int]) -> dict:
        r = self.http.post("/v1/completions", json={"model": "micro", "prompt": prompt, "max_tokens": 4,
                                                    "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    def store_blocks(self, event: str) -> float:
        """`kvjax_kv_store_blocks_total{event=...}` from /metrics."""
        for ln in self.http.get("/metrics").text.splitlines():
            if ln.startswith(f'kvjax_kv_store_blocks_total{{event="{event}"'):
                return float(ln.split()[-1])
        return 0.0

    def stop(self) -> int | None:
        self.http.close()
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


@pytest.fixture
def redis_url():
    from kv_store_helpers import start_redis

    server = start_redis()
    yield server.url
    server.stop()


def test_two_servers_share_one_redis(tmp_path, redis_url):
    """Server B finds in Redis the blocks server A wrote while both are live: same greedy text,
    cached_tokens > 0, blocks restored from the store."""
    rng = np.random.default_rng(3)
    target = rng.integers(1, 500, 100).tolist()
    fillers = [rng.integers(1, 500, 90).tolist() for _ in range(4)]
    a, b = Server(tmp_path, "a", redis_url), Server(tmp_path, "b", redis_url)
    try:
        a.start()  # both start at once and stay up
        b.start()
        a.wait_healthy()
        b.wait_healthy()
        first = a.complete(target)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for f in fillers:  # push target's blocks off A's device: their host copies are written through
            a.complete(f)
        # target's 12 full blocks leave A's device first: wait for at least that many puts, settled
        deadline, last = time.monotonic() + 30, -1.0
        while (n := a.store_blocks("written")) < len(target) // 8 or n != last:
            assert time.monotonic() < deadline, f"A wrote {n} blocks"
            last = n
            time.sleep(0.3)
        again = b.complete(target)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert b.store_blocks("restored") > 0
    finally:
        codes = [a.stop(), b.stop()]
    for server, code in zip((a, b), codes, strict=True):  # uvicorn re-raises SIGTERM
        assert code in (0, -signal.SIGTERM), server.log.read_text()[-3000:]


def test_a_restarted_server_finds_its_blocks_in_a_file_store(tmp_path):
    """The first server writes host blocks to the store (and finishes its puts at shutdown); a
    second one on the same directory serves the prompt from disk."""
    rng = np.random.default_rng(4)
    target = rng.integers(1, 500, 100).tolist()
    fillers = [rng.integers(1, 500, 90).tolist() for _ in range(4)]
    store = tmp_path / "kv"
    url = f"file://{store}?max_bytes=64MiB"
    first_server = Server(tmp_path, "first", url).start()
    try:
        first_server.wait_healthy()
        first = first_server.complete(target)
        for f in fillers:  # push target's blocks off the device: the host tier writes them through
            first_server.complete(f)
    finally:
        code = first_server.stop()
    assert code in (0, -signal.SIGTERM), first_server.log.read_text()[-3000:]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert any(store.rglob("*.bin"))
    second_server = Server(tmp_path, "second", url).start()
    try:
        second_server.wait_healthy()
        again = second_server.complete(target)
        restored = second_server.store_blocks("restored")
    finally:
        code = second_server.stop()
    assert code in (0, -signal.SIGTERM), second_server.log.read_text()[-3000:]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert restored > 0


def test_kv_store_flags():
    """The --kv-store flags become a `KVStoreConfig` (no model loads); the others alone are refused."""
    from kvjax.cli import build_parser
    from kvjax.serve_command import kv_store_config

    args = build_parser().parse_args(["serve", "micro", "--kv-store", "memory://", "--kv-store-write-policy", "write_back",
                                      "--kv-store-prefetch-policy", "best_effort", "--kv-store-prefetch-min-tokens", "64",
                                      "--kv-store-prefetch-timeout", "0.25", "--kv-store-threads", "3", "--model-seed", "2"])
    kv = kv_store_config(args)
    assert (kv.url, kv.write_policy, kv.prefetch_policy, kv.prefetch_min_tokens, kv.prefetch_timeout_s, kv.threads) == (
        "memory://", "write_back", "best_effort", 64, 0.25, 3)
    assert kv.model_id == "micro@seed2@None"  # another seed, other weights: other keys
    assert kv_store_config(build_parser().parse_args(["serve", "micro"])) is None
    with pytest.raises(ValueError, match="need --kv-store"):
        kv_store_config(build_parser().parse_args(["serve", "micro", "--kv-store-write-policy", "write_back"]))
