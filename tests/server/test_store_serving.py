"""`kvjax serve --kv-store file://...` across a restart: the first server writes host blocks to
the store (and finishes its puts at shutdown), a second server on the same directory serves
the same prompt with `usage.prompt_tokens_details.cached_tokens` > 0 and the same tokens."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_server(tmp_path: Path, name: str, store: Path, requests):
    """Start `kvjax serve micro` with a file store, send `requests` (token-id prompts) one by
    one, stop it with SIGTERM; returns each response's JSON."""
    port = free_port()
    log = tmp_path / f"{name}.log"
    cmd = [sys.executable, "-m", "kvjax.cli", "serve", "micro", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "192", "--block-size", "8", "--primary-blocks", "24", "--secondary-blocks", "32",
           "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--option", "min_batch_bucket=4",
           "--option", "min_chunk_bucket=64", "--option", "min_blocks_bucket=24", "--option", "prefill_rows=1",
           "--warmup", "none", "--shutdown-timeout", "2", "--kv-store", f"file://{store}?max_bytes=64MiB",
           "--kv-store-prefetch-policy", "wait_complete", "--kv-store-prefetch-min-tokens", "16"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = []
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "not healthy in time:\n" + log.read_text()[-3000:]
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            for prompt in requests:
                r = http.post("/v1/completions", json={"model": "micro", "prompt": prompt, "max_tokens": 4,
                                                       "temperature": 0})
                assert r.status_code == 200, r.text
                out.append(r.json())
            metrics = http.get("/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode in (0, -signal.SIGTERM), log.read_text()[-3000:]  # uvicorn re-raises SIGTERM
    return out, metrics


def test_serve_restart_finds_blocks_in_file_store(tmp_path):
    rng = np.random.default_rng(3)
    target = rng.integers(1, 500, 100).tolist()
    fillers = [rng.integers(1, 500, 90).tolist() for _ in range(4)]
    store = tmp_path / "kv"
    first, _ = run_server(tmp_path, "first", store, [target, *fillers])
    assert first[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert any(store.rglob("*.bin"))
    (again,), metrics = run_server(tmp_path, "second", store, [target])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == first[0]["choices"][0]["text"]
    assert 'kvjax_kv_store_blocks_total{event="restored",model_name="micro"}' in metrics
    restored = [ln for ln in metrics.splitlines() if ln.startswith('kvjax_kv_store_blocks_total{event="restored"')]
    assert float(restored[0].split()[-1]) > 0


def test_kv_store_flags():
    """The --kv-store flags become a `KVStoreConfig` (no model loads); the others alone are refused."""
    import pytest

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
