"""Disaggregated prefill/decode in one process: a producer engine (P) prefills with max_tokens=1
and offers the prompt's KV; a consumer engine (D) pulls it instead of computing it. Greedy tokens
equal one aggregated engine's; D computes no prompt token it received; failures follow
kv_load_failure_policy; an abort mid-pull frees the blocks only after the pull; a lease that
runs out unpins P's blocks."""
import dataclasses
import time

import numpy as np
import pytest
from engine_helpers import cache, engine_config

from kvjax.disagg import GeometryMismatchError, KVTransferConfig
from kvjax.engine import Engine, LLMEngine
from kvjax.engine.sampling import SamplingParams
from kvjax.errors import DuplicateRequestError

TPB = 8


def transfer_config(role, policy="fail", **extra):
    return KVTransferConfig.parse({"kv_connector": "JaxTransferConnector", "kv_role": role,
                                   "kv_load_failure_policy": policy, "kv_connector_extra_config": extra})


def make(served, role=None, policy="fail", overlap=False, **extra):
    kv = None if role is None else transfer_config(role, policy, **extra)
    engine = Engine(served.model, dataclasses.replace(engine_config(), async_scheduling=overlap), runner=served.runner)
    return LLMEngine(engine, cache(served.model), kv_transfer=kv)


def run(engine, deadline=60.0):
    """Step until idle; the final outputs by request id."""
    final = {}
    stop = time.monotonic() + deadline
    while engine.has_unfinished_requests():
        assert time.monotonic() < stop, "engine did not finish in time"
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def prompts(vocab, lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def prefill(p_engine, rid, prompt):
    p_engine.add_request(rid, prompt, SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True})
    out = run(p_engine)[rid]
    assert out.kv_transfer_params is not None and out.kv_transfer_params["do_remote_prefill"] is True
    return out


def step_until(engine, cond, deadline=10.0):
    stop = time.monotonic() + deadline
    while not cond():
        assert time.monotonic() < stop
        engine.step()
        time.sleep(0.005)


@pytest.fixture(scope="module")
def pd(micro):
    """One producer and one consumer (recompute policy) for the module; closed at the end."""
    p, d = make(micro, "kv_producer"), make(micro, "kv_consumer", "recompute", pull_timeout=10, side_channel_timeout=1)
    yield p, d
    d.close()
    p.close()


def test_pd_greedy_equals_aggregated_and_pulls_only_what_it_lacks(micro, pd):
    p, d = pd
    vocab = micro.model.spec.vocab_size
    shared = prompts(vocab, [16])[0]
    a, b, c = prompts(vocab, [40, 27, 23], seed=5)
    reqs = {"a": a, "b": b, "c": shared + c}  # c: D already holds its first 16 tokens (2 blocks)
    agg = make(micro)
    for rid, pr in reqs.items():
        agg.add_request(rid, pr, SamplingParams(max_tokens=6, ignore_eos=True))
    want = {rid: o.outputs[0].token_ids for rid, o in run(agg).items()}

    d.add_request("warm", shared + [7, 7], SamplingParams(max_tokens=1))  # D's local prefix
    run(d)
    before = dataclasses.replace(d.core.counters)
    moved0 = d.core.remote_kv.counters.transferred_tokens
    got = {}
    for rid, pr in reqs.items():
        out = prefill(p, rid, pr)
        assert out.outputs[0].token_ids == want[rid][:1]  # P's one token is the aggregated first token
        d.add_request(rid, pr, SamplingParams(max_tokens=6, ignore_eos=True), kv_transfer_params=out.kv_transfer_params)
        got[rid] = run(d)[rid].outputs[0].token_ids
    assert got == want
    # D computed only what it neither held nor received: the last prompt token at least (its
    # logits), the partial block's tokens, and nothing of the 16 tokens it held for c
    received = {rid: min(len(pr) // TPB * TPB, len(pr) - 1) for rid, pr in reqs.items()}
    received["c"] -= 16
    c_ = d.core.counters
    assert d.core.remote_kv.counters.transferred_tokens - moved0 == sum(received.values())
    assert c_.reused_prompt_tokens - before.reused_prompt_tokens == 16
    assert c_.computed_prompt_tokens - before.computed_prompt_tokens == sum(len(pr) for pr in reqs.values()) - 16 - sum(
        received.values())
    # P unpins once D reports each pull: its ledger is idle again (no pinned block left)
    step_until(p, lambda: sum(p.core.remote_kv.counters.released.values()) >= 3)
    assert p.core.remote_kv.counters.released.get("pulled", 0) >= 3
    p.core.verify_idle()
    d.core.verify_idle()


def test_failed_pull_recomputes_or_fails_and_bad_geometry_is_refused(micro, pd):
    p, d = pd
    vocab = micro.model.spec.vocab_size
    pr = prompts(vocab, [33], seed=9)[0]
    agg = make(micro)
    agg.add_request("x", pr, SamplingParams(max_tokens=4, ignore_eos=True))
    want = run(agg)["x"].outputs[0].token_ids
    params = prefill(p, "x", pr).kv_transfer_params
    # a mismatching geometry digest: refused at add_request, nothing queued
    with pytest.raises(GeometryMismatchError):
        d.add_request("x", pr, SamplingParams(max_tokens=4), kv_transfer_params={**params, "geometry_digest": "0" * 64})
    assert d.get_num_unfinished_requests() == 0
    # the producer is gone before the pull (closed: its offers end): recompute gives the same tokens
    dead = make(micro, "kv_producer", side_channel_timeout=1)
    gone = prefill(dead, "x", pr).kv_transfer_params
    dead.close()
    computed = d.core.counters.computed_prompt_tokens
    d.add_request("x", pr, SamplingParams(max_tokens=4, ignore_eos=True), kv_transfer_params=gone)
    assert run(d)["x"].outputs[0].token_ids == want
    assert d.core.counters.computed_prompt_tokens - computed == len(pr)  # nothing arrived: all computed
    assert d.core.remote_kv.counters.recomputed >= 1
    # the same with kv_load_failure_policy=fail: the request ends with "error"
    strict = make(micro, "kv_consumer", "fail", pull_timeout=5, side_channel_timeout=1)
    try:
        strict.add_request("x", pr, SamplingParams(max_tokens=4), kv_transfer_params=gone)
        out = run(strict)["x"]
        assert out.outputs[0].finish_reason == "error"
        assert "Error" in out.outputs[0].stop_reason  # why: the pull's error
        assert strict.core.remote_kv.counters.failed == 1
        strict.core.verify_idle()
    finally:
        strict.close()
    # the live offer of "x" is still pulled fine afterwards
    d.add_request("x", pr, SamplingParams(max_tokens=4, ignore_eos=True), kv_transfer_params=params)
    assert run(d)["x"].outputs[0].token_ids == want
    d.core.verify_idle()


def test_abort_mid_pull_frees_blocks_after_the_pull(micro, pd):
    p, d = pd
    pr = prompts(micro.model.spec.vocab_size, [48], seed=11)[0]
    params = prefill(p, "y", pr).kv_transfer_params
    d.add_request("y", pr, SamplingParams(max_tokens=4), kv_transfer_params=params)
    d.step()  # admitted: blocks reserved, pull started (it reports at a later step)
    assert d.core.running["y"].awaiting_kv
    out = d.abort_request("y")
    assert out is not None and out.outputs[0].finish_reason == "abort"
    assert len(d.core.ledger) == 1  # bytes for its slots may still be in flight: still held
    assert d.has_unfinished_requests()
    with pytest.raises(DuplicateRequestError):  # its id is still held by the pull
        d.add_request("y", pr, SamplingParams(max_tokens=4))
    run(d)  # the pull reports: only now the sequence leaves the ledger
    assert len(d.core.ledger) == 0
    d.core.verify_idle()


def test_lease_expiry_unpins(micro):
    p = make(micro, "kv_producer", kv_lease_duration=0.3, heartbeat_interval=0.1)
    try:
        prefill(p, "z", prompts(micro.model.spec.vocab_size, [24], seed=13)[0])
        with pytest.raises(Exception, match="still referenced"):
            p.core.verify_idle()  # its 3 blocks are pinned for the consumer
        step_until(p, lambda: p.core.remote_kv.counters.released.get("expired", 0) == 1)
        p.core.verify_idle()
    finally:
        p.close()


def test_pd_with_overlapped_steps(micro):
    """With async scheduling on both sides (the offer is gathered while a later step is in
    flight; the scatter lands between dispatched steps) the tokens are still the aggregated ones."""
    p, d = make(micro, "kv_producer", overlap=True), make(micro, "kv_consumer", overlap=True)
    try:
        prs = prompts(micro.model.spec.vocab_size, [35, 50], seed=17)
        agg = make(micro, overlap=True)
        for i, pr in enumerate(prs):
            agg.add_request(f"o{i}", pr, SamplingParams(max_tokens=5, ignore_eos=True))
        want = {rid: o.outputs[0].token_ids for rid, o in run(agg).items()}
        for i, pr in enumerate(prs):  # both prefills together, then both decodes together
            p.add_request(f"o{i}", pr, SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True})
        outs = run(p)
        for i, pr in enumerate(prs):
            d.add_request(f"o{i}", pr, SamplingParams(max_tokens=5, ignore_eos=True),
                          kv_transfer_params=outs[f"o{i}"].kv_transfer_params)
        got = {rid: o.outputs[0].token_ids for rid, o in run(d).items()}
        assert got == want
        assert d.core.remote_kv.counters.transferred_tokens == 32 + 48
        step_until(p, lambda: p.core.remote_kv.counters.released.get("pulled", 0) == 2)
        p.core.verify_idle()
        d.core.verify_idle()
    finally:
        d.close()
        p.close()
