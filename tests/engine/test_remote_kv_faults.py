"""Disaggregated prefill/decode faults with the producer engine in another process
(`pd_producer_main.py --stall`: its offers are described on the side channel but their bytes
never come, so each consumer pull is deterministically in flight). A pull that never completes
ends at the consumer's own pull_timeout; a producer SIGKILLed while the pulls are in flight ends
them within that bound too. Either way, with kv_load_failure_policy "recompute" the greedy
tokens equal an aggregated run's (the whole prompt computed, nothing received), with "fail" the
request ends with finish reason "error" naming the pull's error and no token; both consumers'
ledgers are idle afterwards (no block leaked, no KV published from a failed pull). A request
aborted during a pull that never completes keeps its slots until the deadline, then frees them."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import cache, engine_config

from kvjax.disagg import KVTransferConfig
from kvjax.engine import Engine, LLMEngine
from kvjax.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PRODUCER = Path(__file__).with_name("pd_producer_main.py")
PULL_TIMEOUT = 2.0
SLACK = 2.0  # a loaded 2-core box: steps, a poisoned connection's thread
MAX_TOKENS = 4


class StalledProducer:
    """`pd_producer_main.py --stall` in its own process group, bounded by `timeout -s KILL`;
    stdout lines arrive on a queue (never a blocking read)."""

    def __init__(self, prompts: dict[str, list[int]], limit: float = 90.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(
            ["timeout", "-s", "KILL", str(limit), sys.executable, str(PRODUCER), "--stall", "--limit", str(limit - 5),
             "--prompts", json.dumps(prompts)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.params: dict[str, dict] = {}

    def wait_offers(self, limit: float = 60.0) -> None:
        """Read the offers' params (the first line): the test's own setup runs meanwhile."""
        line = self.next_line(limit)
        if not line:
            self.kill()
            raise RuntimeError(f"producer did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.params = json.loads(line)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def next_line(self, limit: float) -> str:
        try:
            return self.lines.get(timeout=limit)
        except queue.Empty:
            return ""

    def kill(self) -> None:
        """SIGKILL the process group (the `timeout` wrapper and the interpreter)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def consumer(served, policy: str) -> LLMEngine:
    kv = KVTransferConfig.parse({"kv_connector": "JaxTransferConnector", "kv_role": "kv_consumer",
                                 "kv_load_failure_policy": policy, "kv_connector_extra_config": {
                                     "pull_timeout": PULL_TIMEOUT, "side_channel_timeout": 1,
                                     "heartbeat_interval": 0.5}})
    return LLMEngine(Engine(served.model, engine_config(), runner=served.runner), cache(served.model), kv_transfer=kv)


@pytest.fixture(scope="module")
def setup(micro):
    """The producer (four prompts prefilled and offered, stalled), a recompute and a fail consumer,
    and the aggregated greedy tokens of the recompute consumer's two prompts."""
    rng = np.random.default_rng(23)
    prs = {rid: rng.integers(1, micro.model.spec.vocab_size, n).tolist()
           for rid, n in (("t-r", 31), ("t-f", 26), ("a-f", 27), ("k-r", 29), ("k-f", 25))}  # one prefill chunk bucket (32)
    prod = StalledProducer(prs)  # starts while the reference runs here
    d_r, d_f = consumer(micro, "recompute"), consumer(micro, "fail")
    try:
        for rid in ("t-r", "k-r"):  # the aggregated reference: D_f computing them itself, no kv_transfer_params
            d_f.add_request(rid, prs[rid], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        want = {rid: o.outputs[0].token_ids for rid, o in drive([d_f]).items()}
        prod.wait_offers()
        yield prod, d_r, d_f, prs, want
    finally:
        d_r.close()
        d_f.close()
        prod.kill()


def drive(engines, limit: float = 60.0, on_step=None) -> dict:
    """Step every engine until all are idle; the final outputs by request id."""
    final = {}
    stop = time.monotonic() + limit
    while any(e.has_unfinished_requests() for e in engines):
        assert time.monotonic() < stop, "the consumers did not finish in time"
        for e in engines:
            if e.has_unfinished_requests():
                for out in e.step():
                    if out.finished:
                        final[out.request_id] = out
        if on_step is not None:
            on_step()
        time.sleep(0.002)
    return final


def until_pulling(pairs) -> None:
    """Step each (engine, request id) until its pull is issued and waits for bytes."""
    stop = time.monotonic() + 20
    while not all(d.core.remote_kv.consumer.stage(rid) == "pulling" for d, rid in pairs):
        assert time.monotonic() < stop, "the pulls never got in flight"
        for d, _ in pairs:
            d.step()
        time.sleep(0.002)


def pull_both(setup, r_id: str, f_id: str, during=None):
    """Send `r_id` to the recompute consumer and `f_id` to the fail one with P's params; step until
    both pulls are in flight ("pulling": the transfer issued, no byte come), call `during`, then
    step to the end. Returns (outputs, seconds from the pulls in flight to both finished)."""
    prod, d_r, d_f, prs, _ = setup
    for d, rid in ((d_r, r_id), (d_f, f_id)):
        d.add_request(rid, prs[rid], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                      kv_transfer_params=prod.params[rid])
    until_pulling(((d_r, r_id), (d_f, f_id)))
    t0 = time.monotonic()
    if during is not None:
        during()
    outs = drive([d_r, d_f])
    return outs, time.monotonic() - t0


def check_outcome(setup, outs, r_id: str, f_id: str, before) -> None:
    _, d_r, d_f, prs, want = setup
    assert outs[r_id].outputs[0].token_ids == want[r_id]  # recompute: the aggregated tokens
    rc = d_r.core.remote_kv.counters
    assert rc.transferred_tokens == 0 and rc.recomputed == before["recomputed"] + 1
    # nothing of the prompt came from the failed pull: every prompt token was computed here
    assert d_r.core.counters.computed_prompt_tokens - before["computed"] == len(prs[r_id])
    f = outs[f_id].outputs[0]
    assert f.finish_reason == "error" and f.token_ids == []  # fail: no token from partial KV
    assert "Error" in str(f.stop_reason)
    assert d_f.core.remote_kv.counters.failed == before["failed"] + 1
    for d in (d_r, d_f):
        d.core.verify_idle()  # no block leaked, none pinned or published from the failed pull
        assert not d.core.remote_kv.busy


def snapshot(setup) -> dict:
    _, d_r, d_f, _, _ = setup
    return {"recomputed": d_r.core.remote_kv.counters.recomputed, "failed": d_f.core.remote_kv.counters.failed,
            "computed": d_r.core.counters.computed_prompt_tokens}


def test_pull_that_never_completes_ends_at_pull_timeout(setup):
    prod, d_r, d_f, _, _ = setup
    before = snapshot(setup)
    outs, took = pull_both(setup, "t-r", "t-f")
    assert took < PULL_TIMEOUT + SLACK
    assert "PullTimeoutError" in str(outs["t-f"].outputs[0].stop_reason)  # the deadline ended it, P is alive
    assert prod.proc.poll() is None
    check_outcome(setup, outs, "t-r", "t-f", before)
    # D told P its pulls failed: P ends both offers at once (not at lease expiry) and unpins
    assert sorted(prod.next_line(10.0) for _ in range(2)) == ["released consumer_failed"] * 2


def test_abort_during_a_stalled_pull_frees_its_blocks_at_the_deadline(setup):
    prod, _, d_f, prs, _ = setup
    d_f.add_request("a-f", prs["a-f"], SamplingParams(max_tokens=MAX_TOKENS), kv_transfer_params=prod.params["a-f"])
    until_pulling([(d_f, "a-f")])
    t0 = time.monotonic()
    out = d_f.abort_request("a-f")
    assert out is not None and out.outputs[0].finish_reason == "abort"  # answered at once
    assert len(d_f.core.ledger) == 1  # its slots stay reserved while bytes for them could still come
    drive([d_f])  # the pull reports at its deadline: only then the sequence leaves
    assert time.monotonic() - t0 < PULL_TIMEOUT + SLACK
    assert len(d_f.core.ledger) == 0
    d_f.core.verify_idle()
    assert prod.next_line(10.0) == "released consumer_failed"


def test_producer_killed_mid_pull(setup):
    prod, d_r, d_f, _, _ = setup
    before = snapshot(setup)
    outs, took = pull_both(setup, "k-r", "k-f", during=prod.kill)
    assert prod.proc.returncode is not None
    assert took < PULL_TIMEOUT + SLACK
    check_outcome(setup, outs, "k-r", "k-f", before)
    stop = time.monotonic() + 5  # the failed pulls' threads end (their connections poisoned)
    while (d_r.core.remote_kv.consumer.live_threads or d_f.core.remote_kv.consumer.live_threads):
        assert time.monotonic() < stop
        time.sleep(0.01)
