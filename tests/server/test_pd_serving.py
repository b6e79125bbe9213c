"""Disaggregated prefill/decode end to end, as three processes on 127.0.0.1: a producer
`kvjax serve --kv-transfer-config` (P), a consumer one (D) and `kvjax router --prefill-replica
P --decode-replica D`. Greedy tokens through the router (completions, streamed or not, and chat)
equal an aggregated engine's (P's own answer to the plain request), D's /metrics count the prompt tokens
it received, bad kv_transfer_params are 400s, and both servers stop with an empty ledger (P's
unpulled offer is released at shutdown)."""
import json
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
SERVE = ["--max-model-len", "256", "--block-size", "8", "--primary-blocks", "64", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "64", "--option", "min_batch_bucket=4", "--option", "min_chunk_bucket=64",
         "--option", "min_blocks_bucket=32", "--option", "prefill_rows=1", "--warmup", "none", "--shutdown-timeout", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "JaxTransferConnector", "kv_role": role, "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"side_channel_port": 0, "pull_timeout": 20}})


def start(args, log: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kvjax.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT)


def wait_until(http: httpx.Client, url: str, procs, logs, ready=lambda r: r.status_code == 200, limit=120.0):
    deadline = time.monotonic() + limit
    while True:
        for p, log in zip(procs, logs, strict=True):
            assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{url} not ready:\n" + "\n".join(x.read_text()[-2000:] for x in logs)
        try:
            if ready(http.get(url)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def counter(metrics: str, name: str) -> float:
    m = re.search(rf"^{name}_total{{[^}}]*}} ([0-9.e+]+)$", metrics, re.M)
    assert m, name
    return float(m.group(1))


def test_pd_through_the_router_matches_aggregated(tmp_path):
    ports = {k: free_port() for k in ("p", "d", "r")}
    url = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
    logs = {k: tmp_path / f"{k}.log" for k in ports}
    procs = {}
    try:
        for k, role in (("p", "kv_producer"), ("d", "kv_consumer")):
            procs[k] = start(["serve", "micro", "--host", "127.0.0.1", "--port", str(ports[k]), *SERVE,
                              "--kv-transfer-config", kv_config(role)], logs[k])
        procs["r"] = start(["router", "--prefill-replica", url["p"], "--decode-replica", url["d"], "--port",
                            str(ports["r"]), "--health-interval", "0.5", "--log-level", "warning"], logs["r"])
        order = list(procs)
        with httpx.Client(timeout=120) as http:
            for k in ("p", "d"):
                wait_until(http, url[k] + "/health", [procs[x] for x in order], [logs[x] for x in order])
            both = lambda r: r.status_code == 200 and all(x["available"] for x in r.json()["replicas"])  # noqa: E731
            wait_until(http, url["r"] + "/health", [procs[x] for x in order], [logs[x] for x in order], both, 60)
            prompts = [list(range(3, 44)), [7, 9] * 15]  # 41 and 30 tokens: 5 and 3 full blocks
            received = 0
            for prompt in prompts:
                body = {"model": "micro", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}
                want = http.post(url["p"] + "/v1/completions", json=body)  # aggregated: P computes it all
                assert want.status_code == 200, want.text
                got = http.post(url["r"] + "/v1/completions", json=body)
                assert got.status_code == 200, got.text
                assert got.headers["x-kvjax-replica"] == url["d"]
                assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
                received += min(len(prompt) // 8 * 8, len(prompt) - 1)
            # a streamed decode (vLLM's proxy streams step 2 when the client streams): the same tokens; like
            # vLLM's stream chunks, none carries kv_transfer_params (only a non-streamed body does)
            body = {"model": "micro", "prompt": list(range(50, 83)), "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # 33 tokens, none of them held by D yet
            want = http.post(url["p"] + "/v1/completions", json=body).json()["choices"][0]["token_ids"]
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", url["r"] + "/v1/completions", json=stream) as r:
                assert r.status_code == 200 and r.headers["x-kvjax-replica"] == url["d"]
                chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
            assert not any("kv_transfer_params" in c for c in chunks)
            assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == want
            received += 32
            chat = {"model": "micro", "messages": [{"role": "user", "content": "tell me about caches " * 3}],
                    "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            want = http.post(url["p"] + "/v1/chat/completions", json=chat)
            got = http.post(url["r"] + "/v1/chat/completions", json=chat)
            assert got.status_code == want.status_code == 200, (got.text, want.text)
            assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
            # refused as 400s naming the field: a producer's request on the consumer, a foreign geometry
            bad = {"model": "micro", "prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            r = http.post(url["d"] + "/v1/completions", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
            params = http.post(url["p"] + "/v1/completions", json={**bad, "prompt": prompts[0]}).json()["kv_transfer_params"]
            r = http.post(url["d"] + "/v1/completions", json={**bad, "prompt": prompts[0],
                                                              "kv_transfer_params": {**params, "geometry_digest": "0" * 64}})
            assert r.status_code == 400 and "GeometryMismatchError" in r.json()["error"]["message"], r.text
            d_metrics = http.get(url["d"] + "/metrics").text
            assert counter(d_metrics, "kvjax_kv_transfer_tokens_received") > received  # the chat's too
            assert counter(d_metrics, "kvjax_kv_transfer_pull_failures") == 0
            assert counter(http.get(url["p"] + "/metrics").text, "kvjax_kv_transfer_offers") == 5
            assert "kvjax_router_pd_prefills_total{outcome=\"with_kv\"} 4.0" in http.get(url["r"] + "/metrics").text
    finally:
        for k in ("r", "d", "p"):
            if k in procs:
                procs[k].send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    for k in ("p", "d"):
        text = logs[k].read_text()
        assert procs[k].returncode in (0, -signal.SIGTERM), text[-3000:]
        assert "engine stopped: ledger empty, integrity holds" in text, text[-3000:]


def test_serve_refuses_a_bad_kv_transfer_config_before_loading(capsys):
    from kvjax.cli import main

    assert main(["serve", "micro", "--kv-transfer-config", '{"kv_connector": "Nixl", "kv_role": "kv_producer"}']) == 2
    assert "kv_connector must be 'JaxTransferConnector'" in capsys.readouterr().err
    assert main(["serve", "micro", "--kv-transfer-config", "{not json"]) == 2
