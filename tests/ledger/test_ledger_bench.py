"""The ledger benchmark's own machinery on a tiny trace: the floor and kvjax agree on what they
reuse, the trace is the same one in every process, and a peer refuses any other trace. The peers
themselves (vLLM, SGLang) need their own venv and are not run here."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import ledger_bench  # noqa: E402
from ledger_trace import TRACE_PARAMS, make_trace, trace_digest  # noqa: E402

TINY = ["--requests", "96", "--num-prompts", "3", "--system-tokens", "64", "--unique-tokens", "20",
        "--gen-tokens", "12", "--block-size", "8", "--concurrency", "4", "--seed", "7"]
# sha256 of the TINY trace's tokens; a change here means every recorded figure used another trace
TINY_DIGEST = "4152c382e2200f0cec3893acf7d577a41ce1cab9b564afebf776a9c9a24a92b3"


def tiny(*extra):
    return ledger_bench.parse_args(TINY + list(extra))


def test_floor_and_kvjax_reuse_the_same_prefix_for_every_request_without_eviction():
    a = tiny("--num-blocks", "4096")
    trace = make_trace(a)
    best, digest = ledger_bench.measure(a, trace)
    ours, floor = best["kvjax"], best["floor"]
    assert digest == trace_digest(trace)
    assert len(ours["hits"]) == len(floor["hits"]) == a.requests
    assert ours["hits"] == floor["hits"]
    assert ledger_bench.compare_hits(ours["hits"], {"floor": floor["hits"]}, a.block_size) == ({"floor": 0}, (0, 0))
    assert floor["evicted_blocks"] == 0  # the pool outlasts the trace: nothing was lost to eviction
    # every repeat of a system prompt hits all its blocks, nothing else hits
    seen = set()
    for (p, _, _), hit in zip(trace, ours["hits"], strict=True):
        assert hit == (a.system_tokens if p in seen else 0)
        seen.add(p)


def test_under_eviction_both_sides_finish_the_trace_and_kvjax_stays_consistent():
    a = tiny("--num-blocks", "64", "--repeats", "2", "--mode", "sequential")
    best, _ = ledger_bench.measure(a, make_trace(a))  # kvjax's result() runs verify_integrity
    assert best["kvjax"]["evicted"] > 0 and best["floor"]["evicted_blocks"] > 0
    for side in ("kvjax", "floor"):
        r = best[side]
        assert r["requests_per_s"] > 0 and 0 < r["hit_rate"] < 1 and len(r["hits"]) == a.requests


def test_trace_digest_is_stable_and_sees_every_parameter():
    a = tiny()
    assert trace_digest(make_trace(a)) == trace_digest(make_trace(tiny())) == TINY_DIGEST
    changed = dict(requests=97, num_prompts=4, system_tokens=65, unique_tokens=21, gen_tokens=13, zipf=1.1,
                   vocab=1000, seed=8)  # (vocab + 1 draws the same tokens: both use 15 random bits)
    assert set(changed) == set(TRACE_PARAMS)
    for name, value in changed.items():
        b = tiny()
        setattr(b, name, value)
        assert trace_digest(make_trace(b)) != TINY_DIGEST, name


def test_a_peer_refuses_a_trace_other_than_the_benchmarks():
    """run_peer.py rebuilds the trace and checks the digest before it imports any peer, so this
    runs under the project's own Python."""
    a = tiny()
    params = {k: getattr(a, k) for k in TRACE_PARAMS}
    params.update(block_size=a.block_size, concurrency=a.concurrency, num_blocks=a.num_blocks, events=False, gc=False,
                  clock="cpu")
    wrong = TINY_DIGEST[::-1]
    out = subprocess.run([sys.executable, str(BENCH / "peer_adapters" / "run_peer.py"), "vllm", json.dumps(params), wrong],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stdout.startswith(f"error trace digest {TINY_DIGEST} differs from the benchmark's {wrong}")


def test_without_the_peer_venv_the_benchmark_runs_and_says_how_to_get_the_peers(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = ledger_bench.main(TINY + ["--peers", "--peer-python", str(tmp_path / "none" / "python"),
                                       "--no-extras", "--out", str(out)])
    text = capsys.readouterr().out
    assert "peers not measured" in text and "setup_peer_venv.sh" in text
    assert result["peers"] == {} and "ratio_to_best_peer" not in result
    saved = json.loads(out.read_text())
    assert saved["ratio_to_floor"] == result["ratio_to_floor"] > 0


def test_a_peer_venv_that_cannot_import_the_peer_is_reported_and_the_rest_still_runs(tmp_path, capsys):
    """A 'peer venv' whose torch cannot be imported: the peer fails before `ready`, the benchmark
    says so and measures kvjax and the floor."""
    broken = tmp_path / "python"
    broken.write_text(
        "#!/bin/sh\n"
        f"exec {sys.executable} -c \"import runpy, sys; sys.modules['torch'] = None; "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')\" \"$@\"\n"
    )
    broken.chmod(0o755)
    result = ledger_bench.main(TINY + ["--peers", "--peer-python", str(broken), "--only-peers", "vllm",
                                       "--no-extras", "--out", str(tmp_path / "bench.json")])
    text = capsys.readouterr().out
    assert "peer vllm not measured: vllm: error ModuleNotFoundError" in text
    assert result["peers"] == {} and result["ratio_to_floor"] > 0
