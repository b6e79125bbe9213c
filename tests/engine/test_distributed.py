"""Multi-process ranks on `jax.distributed`: 2 processes x 4 CPU devices on localhost (gloo
collectives) serve a workload on one mesh spanning both (weights and KV pools sharded over the
8 KV heads, so every layer's attention is split across the processes), and produce exactly a
single process's tokens; the ranks agree on the smaller block count; a rank whose ledger
diverges stops every rank with `RankDivergenceError`. The rank checks themselves are also
tested in process with a fake all-gather."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvjax import CacheConfig
from kvjax.engine import ranks
from kvjax.engine.ranks import RankDigest, RankDivergenceError, agree_on_cache

WORKER = Path(__file__).with_name("dist_worker.py")
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, args0=(), args1=()) -> list[subprocess.Popen]:
    """Start 2 ranks; returns them with their result files and logs (see `finish`)."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    procs = []
    for i, extra in enumerate((args0, args1)):
        out, log = tmp_path / f"rank{i}.json", tmp_path / f"rank{i}.log"
        with open(log, "wb") as f:
            procs.append((subprocess.Popen(
                [sys.executable, str(WORKER), "--process-id", str(i), "--num-processes", "2", "--port", str(port),
                 "--out", str(out), *extra], stdout=f, stderr=subprocess.STDOUT, env=env), out, log))
    return procs


def finish(procs, timeout=TIMEOUT_S) -> list[dict]:
    """Wait for every process (killed after `timeout`); each one's JSON result."""
    try:
        for p, _, _ in procs:
            p.wait(timeout)
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    for p, _, log in procs:
        assert p.returncode == 0, log.read_text()[-4000:]
    return [json.loads(out.read_text()) for _, out, _ in procs]


@pytest.mark.slow
def test_two_processes_match_one_and_stop_together_on_divergence(tmp_path):
    # rank 1 has less memory (fewer blocks): both settle on its count
    ranks_ = launch(tmp_path, ("--diverge",), ("--diverge", "--primary-blocks", "60"))
    ref = tmp_path / "ref.json"  # the single-process reference, meanwhile
    single_proc = subprocess.Popen([sys.executable, str(WORKER), "--process-id", "0", "--num-processes", "1", "--port", "0",
                                    "--no-mesh", "--primary-blocks", "60", "--out", str(ref)],
                                   env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE)
    try:
        _, err = single_proc.communicate(timeout=TIMEOUT_S)
    finally:
        if single_proc.poll() is None:
            single_proc.kill()
            single_proc.wait(30)
    r0, r1 = finish(ranks_)
    assert single_proc.returncode == 0, err.decode()[-4000:]
    single = json.loads(ref.read_text())

    assert (r0["processes"], r0["devices"], r0["local_devices"]) == (2, 8, 4)
    assert r0["primary_blocks"] == r1["primary_blocks"] == 60
    assert r0["wq_spec"] == "P(None, 'tp', None)" and r0["wq_local_shape"] == [64, 1, 8]  # one query head per device
    assert r0["outputs"] == r1["outputs"] and r0["logits"] == r1["logits"]  # every rank read the same tokens
    assert r0["outputs"] == single["outputs"] and len(single["outputs"]) == 7
    assert r0["reused"] == single["reused"] > 0  # same prefix reuse (the follow-up and the shared system prompt)
    assert r0["copied"] == single["copied"] > 0  # a partial block copied on the cross-process pools
    diff = max(abs(a - b) for k in single["logits"] for a, b in zip(r0["logits"][k], single["logits"][k], strict=True))
    assert diff < 1e-4, diff

    for r in (r0, r1):  # process 1 corrupted its ledger after 3 steps: both stop at the next step's check
        assert r["error"] is not None and "diverged" in r["error"] and "processes [1]" in r["error"]
        assert r["diverge_steps"] == 3 and r["diverge_checks"] == 4


# ---------------------------------------------------------------------- in process, fake collectives
def fake_allgather(monkeypatch, others):
    """`ranks._allgather` as if rank 0 (this process) ran beside ranks whose arrays `others` makes."""

    def gather(values):
        return np.stack([values, *[o(values) for o in others]])

    monkeypatch.setattr(ranks, "_allgather", gather)


def test_agree_on_cache_takes_the_minimum_and_refuses_other_settings(monkeypatch):
    cfg = CacheConfig(tokens_per_block=8, num_layers=2, num_kv_heads=2, head_dim=8, max_seq_len=128,
                      primary_blocks=32, secondary_blocks=8)

    def fewer(values):  # a rank with 20 primary blocks and the same settings
        counts = np.ascontiguousarray(values[:16]).view(np.int64).copy()
        counts[0] = 20
        return np.concatenate([counts.view(np.uint8), values[16:]])

    fake_allgather(monkeypatch, [fewer])
    agreed = agree_on_cache(cfg, ("engine",))
    assert agreed.primary_blocks_for(agreed.windows[0]) == 20 and agreed.secondary_blocks_for(agreed.windows[0]) == 8
    fake_allgather(monkeypatch, [lambda v: v])
    assert agree_on_cache(cfg, ("engine",)) is cfg  # nothing to change
    other = ranks._settings_digest(cfg, ("another engine",))
    fake_allgather(monkeypatch, [lambda v: np.concatenate([v[:16], other])])
    with pytest.raises(RankDivergenceError, match=r"processes \[1\] were started with cache or engine settings"):
        agree_on_cache(cfg, ("engine",))


def test_rank_digest_checks_at_its_interval(monkeypatch):
    calls = []
    fake_allgather(monkeypatch, [lambda v: calls.append(1) or v])
    d = RankDigest(interval=3)
    for step in range(7):
        d.update(step, [("r", 5)], np.arange(4))
        d.check(step)
    assert d.checks == len(calls) == 3  # steps 0, 3, 6
    fake_allgather(monkeypatch, [lambda v: v[::-1].copy()])
    with pytest.raises(RankDivergenceError, match="diverged from process 0's by engine step 9"):
        d.check(9)
    with pytest.raises(ValueError, match="positive int"):
        RankDigest(0)
    a, b = RankDigest(1), RankDigest(1)
    a.update(1, "x", np.array([1, 2]))
    b.update(1, "x", np.array([1, 3]))
    assert a.digest() != b.digest()


# ---------------------------------------------------------------------- one process, several devices
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_in_one_process_matches_one_device(micro, tp):
    """The same engine code with a mesh of local devices: weights and pools sharded over the KV
    heads (offload / onboard through a tight pool included), no rank checks, the same tokens.
    At TP 4 micro's 2 KV heads are replicated (each device caches one, the pools hold 4)."""
    import jax
    from engine_helpers import TIGHT, cache, engine_config
    from jax.sharding import PartitionSpec as P

    from kvjax.engine import ChatWorkload, Engine
    from kvjax.models import Transformer

    items = ChatWorkload(users=6, turns=3, system_prompts=2, system_prompt_tokens=(36, 44), user_tokens=(4, 20),
                         max_new_tokens=(4, 10), arrival_interval=1, think_steps=1, priority=80,
                         seed=7).build(micro.model.spec.vocab_size)
    ref = micro.engine().run(items, cache(micro.model, primary=TIGHT))
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp], axis_types=(jax.sharding.AxisType.Auto,))
    model = Transformer.from_spec("micro", seed=0)  # its own copy: sharding is in place
    engine = Engine(model, engine_config(), mesh=mesh)
    res = engine.run(items, cache(model, primary=TIGHT))
    assert res.outputs == ref.outputs
    s = res.metrics.summary()
    assert s["blocks_offloaded"] > 0 and s["prefill_reused_tokens"] == ref.metrics.summary()["prefill_reused_tokens"] > 0
    assert model.blocks[0].attn.wk[...].sharding.spec == P(None, "tp", None)
    assert model.spec.num_kv_heads == max(2, tp) and model.embed[...].addressable_shards[0].data.shape == (512 // tp, 64)
    core = engine.core(cache(model))
    assert core.rank_digest is None and core.pools.primary[0].sharding.spec[3] == "tp"
    assert core.pools.primary[0].shape[3] == max(2, tp) and core.pools.primary[0].addressable_shards[0].data.shape[3] == 1
