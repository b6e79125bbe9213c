"""`kvjax serve` as a subprocess on 127.0.0.1 with vLLM's flags: Bearer auth on /v1 (401 in
OpenAI's error shape; /health and /metrics open), several served names, /v1/models's
max_model_len, the prompt-too-long error naming --max-model-len, and the operator's log lines
on stderr (banner, compilation of a new shape, the request's debug line, the stats line)."""
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_auth_names_limits_and_log_lines(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "kvjax.cli", "serve", "micro", "--host", "127.0.0.1", "--port", str(port),
           "--api-key", "sekret", "--served-model-name", "a", "b", "--max-model-len", "256", "--block-size", "8",
           "--primary-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
           "--option", "min_batch_bucket=4", "--option", "min_chunk_bucket=64", "--option", "min_blocks_bucket=32",
           "--option", "prefill_rows=1", "--log-level", "debug", "--log-stats-interval", "0.3",
           "--shutdown-timeout", "2"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("VLLM_API_KEY", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "not healthy in time:\n" + log.read_text()[-3000:]
                try:
                    if http.get("/health").status_code == 200:  # open without a key, as in vLLM
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            assert http.get("/metrics").status_code == 200
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                r = http.get("/v1/models", headers=headers)
                assert r.status_code == 401
                assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                              "param": None, "code": "invalid_api_key"}}
            assert http.post("/reset_prefix_cache").status_code == 401
            key = {"Authorization": "Bearer sekret"}
            models = http.get("/v1/models", headers=key).json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in models] == [("a", 256), ("b", 256)]
            r = http.post("/v1/completions", headers=key, json={"model": "b", "prompt": list(range(1, 250)),
                                                                "max_tokens": 16})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
            assert "--max-model-len" in r.json()["error"]["message"]
            r = http.post("/v1/completions", headers=key, json={"model": "b", "prompt": "Hi", "max_tokens": 1,  # BOS + 2 bytes
                                                                "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == "a"  # the first name is reported
            rid = r.json()["id"]
            deadline = time.monotonic() + 20
            while "Avg prompt throughput" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert proc.returncode in (0, -signal.SIGTERM), text[-3000:]  # uvicorn re-raises the signal it handled
    assert "max model len 256, max num seqs 4, max num batched tokens 64, prefix caching on" in text
    assert "KV cache (window 256, float32): primary 64 blocks = 512 tokens" in text
    # the default --warmup compiled the prefill-chunk and decode programs before the server listened
    assert re.search(r"compiled the forward for StepShape\(decode_rows=0, prefill_rows=1, chunk=64, blocks=32\) "
                     r"in [0-9.]+ s", text), text[-3000:]
    assert "warmup (common) done: 2 of 3 step shapes, 2 programs traced" in text
    assert text.index("warmup (common) done") < text.index("Uvicorn running on")
    assert re.search(rf"DEBUG .* request {rid}: 3 prompt tokens, max_tokens 1, finished \(length\) with 1 tokens, "
                     r"TTFT [0-9.]+ s, e2e [0-9.]+ s", text), text[-3000:]
    assert re.search(r"INFO .* Avg prompt throughput: [0-9.]+ tokens/s, Avg generation throughput: [0-9.]+ tokens/s, "
                     r"Running: \d+ reqs, Waiting: \d+ reqs, GPU KV cache usage: [0-9.]+%, Prefix cache hit rate: "
                     r"[0-9.]+%", text)
    assert "engine stopped: ledger empty, integrity holds" in text
