"""kvjax against transformers on the same CPU, the same checkpoint and the same token-id prompts.

    python benchmarks/e2e_bench.py --hf-python /path/to/venv-with-transformers/bin/python \\
        [--checkpoint DIR] [--layers 30] [--rounds 2] [--out results/e2e_bench.json]

Without `--checkpoint`, a SmolLM2-135M-shaped Llama checkpoint (random weights, seeded) is written
by transformers' `save_pretrained` into a temporary directory (`--layers` shrinks it for a smoke
run). Every measurement runs in a fresh process pinned to one core (`taskset -c 0`; torch with
one thread, XLA's CPU client without its Eigen thread pool): two torch threads stall badly on a
shared 2-core machine, which would flatter kvjax. The sides alternate, `--rounds` times each.
transformers runs in its own Python (it needs torch; kvjax's venv does not have it).

Per side:
  single   load time; time to first token cold (process start to the first token: imports, load,
           compilation for kvjax) and warm (a second prompt of the same length); single-stream
           decode tokens/s over `--new-tokens`.
  offline  32 prompts sharing a 256-token system prompt, 64 new tokens each, warm (a first pass
           compiles): output tokens/s. kvjax through its engine (prefix reuse on, the cache
           reset before the timed pass); transformers through continuous batching
           (`generate_batch`) and through padded `generate`.
  floor    (kvjax) a decode step at batch 32 over the same batch's dense matmul-only forward
           (every weight matrix times a [32, d_in] input): the step-vs-floor ratio.
Targets on a 2-core CPU: step <= 1.5x its matmul floor at batch 32; warm offline throughput
>= 2x transformers' continuous batching; single-stream decode >= 1x; both printed as ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SYSTEM_LEN, UNIQUE_LEN, OFFLINE_N, OFFLINE_NEW = 256, 32, 32, 64
ONE_CORE = ["taskset", "-c", "0"]


def prompts(vocab: int, seed: int = 0) -> dict:
    """The token-id prompts both sides serve (ids from 10: clear of special tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    system = rng.integers(10, vocab, SYSTEM_LEN).tolist()
    return {
        "single": rng.integers(10, vocab, 128).tolist(),
        "single_warm": rng.integers(10, vocab, 128).tolist(),
        "offline": [system + rng.integers(10, vocab, UNIQUE_LEN).tolist() for _ in range(OFFLINE_N)],
    }


# ------------------------------------------------------------------------------------- kvjax side
def kvjax_side(mode: str, checkpoint: str, new_tokens: int, t_launch: float) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from kvjax.engine import Engine, EngineConfig, LLMEngine, SamplingParams
    from kvjax.engine.config import cache_config
    from kvjax.models import from_pretrained

    t0 = time.perf_counter()
    model = from_pretrained(checkpoint, dtype="float32")
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - t0
    p = prompts(model.spec.vocab_size)
    batch = 1 if mode == "single" else OFFLINE_N
    engine_cfg = EngineConfig.from_dict({"max_batch_size": batch, "max_num_tokens": 512}, "e2e")
    cc = cache_config(model.spec, {"primary_blocks": batch * 40 + 64, "tokens_per_block": 16, "max_seq_len": 1024},
                      max_num_tokens=512, source="e2e")
    llm = LLMEngine(Engine(model, engine_cfg), cc)
    params = SamplingParams(max_tokens=new_tokens if mode == "single" else OFFLINE_NEW, ignore_eos=True)

    def serve(reqs: dict[str, list[int]]) -> tuple[float, float, list[float]]:
        """(time to the first token of all, total, decode step times)."""
        for rid, ids in reqs.items():
            llm.add_request(rid, ids, params)
        start, first, steps = time.perf_counter(), None, []
        while llm.has_unfinished_requests():
            ts = time.perf_counter()
            outs = llm.step()
            took = time.perf_counter() - ts
            if first is not None and llm.core.last_step.prefill_tokens == 0:
                steps.append(took)
            if first is None and all(o.outputs[0].token_ids for o in outs) and len(outs) == len(reqs):
                first = time.perf_counter()
        end = time.perf_counter()
        return (first or end) - start, end - start, steps

    if mode == "single":
        ttft_cold, total, steps = serve({"a": p["single"]})
        ttft_cold_from_launch = t_launch and (time.time() - t_launch) - (total - ttft_cold)
        ttft_warm, total_w, steps_w = serve({"b": p["single_warm"]})
        return {"load_s": load_s, "ttft_cold_s": ttft_cold, "ttft_cold_from_launch_s": ttft_cold_from_launch,
                "ttft_warm_s": ttft_warm, "decode_tok_s": (new_tokens - 1) / (total_w - ttft_warm)}
    serve({f"w{i}": ids for i, ids in enumerate(p["offline"])})  # compiles every shape of the pass
    llm.core.reset_prefix_cache()
    _, total, steps = serve({f"o{i}": ids for i, ids in enumerate(p["offline"])})
    step_s = float(np.median(steps)) if steps else float("nan")
    return {"load_s": load_s, "offline_tok_s": OFFLINE_N * OFFLINE_NEW / total, "decode_step_s": step_s,
            "floor_s": matmul_floor(model, OFFLINE_N), "step_over_floor": step_s / matmul_floor(model, OFFLINE_N)}


def matmul_floor(model, batch: int) -> float:
    """Best time of one jitted pass of every weight matrix times a [batch, d_in] input (the
    weights a decode step must read and the matmuls it must do; nothing else)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    mats = [x for x in jax.tree.leaves(nnx.state(model)) if x.ndim >= 2]

    @jax.jit
    def floor(mats):
        total = jnp.zeros((), jnp.float32)
        for w in mats:
            w2 = w.reshape(w.shape[0], -1)
            if w2.shape[0] > w2.shape[1] * 4:  # an embedding [V, D] is read as the LM head: x[B, D] @ w.T
                total += jnp.sum(jnp.ones((batch, w2.shape[1]), w.dtype) @ w2.T)
            else:
                total += jnp.sum(jnp.ones((batch, w2.shape[0]), w.dtype) @ w2)
        return total

    floor(mats).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        floor(mats).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


# --------------------------------------------------------------------------------------- driver
def run_side(cmd: list[str], env: dict) -> dict:
    t = time.time()
    proc = subprocess.run(cmd, env=dict(env, E2E_LAUNCH=str(t)), capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = time.time() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-python", required=True, help="a Python with torch + transformers (>= 5)")
    ap.add_argument("--checkpoint", help="a Llama-architecture checkpoint directory (default: make one)")
    ap.add_argument("--layers", type=int, default=30, help="layers of the checkpoint made (default 30, SmolLM2-135M)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="results/e2e_bench.json")
    ap.add_argument("--side", choices=["kvjax"], help=argparse.SUPPRESS)  # internal: one measurement
    ap.add_argument("--mode", choices=["single", "offline"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print(json.dumps(kvjax_side(args.mode, args.checkpoint, args.new_tokens, float(os.environ.get("E2E_LAUNCH", 0)))))
        return
    hf_script = os.path.join(HERE, "e2e_hf_side.py")
    tmp = None
    if args.checkpoint is None:
        tmp = tempfile.mkdtemp(prefix="kvjax-e2e-")
        args.checkpoint = os.path.join(tmp, "ckpt")
        subprocess.run([args.hf_python, hf_script, "make", args.checkpoint, "--layers", str(args.layers)], check=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for mode in ("single", "offline"):
            for side in ("kvjax", "transformers"):
                if side == "kvjax":
                    cmd = [*ONE_CORE, sys.executable, __file__, "--hf-python", args.hf_python, "--side", "kvjax",
                           "--mode", mode, "--checkpoint", args.checkpoint, "--new-tokens", str(args.new_tokens)]
                else:
                    cmd = [*ONE_CORE, args.hf_python, hf_script, mode, args.checkpoint, "--new-tokens", str(args.new_tokens)]
                res = run_side(cmd, env)
                results.setdefault(f"{side}_{mode}", []).append(res)
                print(f"round {r + 1} {side:12s} {mode:7s} " + " ".join(f"{k}={v:.3g}" for k, v in res.items()
                                                                      if isinstance(v, float)), flush=True)

    def best(key: str, field: str, lower: bool = False) -> float:
        vals = [x[field] for x in results[key] if x.get(field) is not None]
        return min(vals) if lower else max(vals)

    kv_dec, hf_dec = best("kvjax_single", "decode_tok_s"), best("transformers_single", "decode_tok_s")
    kv_off = best("kvjax_offline", "offline_tok_s")
    hf_cb, hf_pad = best("transformers_offline", "cb_tok_s"), best("transformers_offline", "padded_tok_s")
    rows = [
        ("single-stream decode tok/s", kv_dec, hf_dec, kv_dec / hf_dec, ">= 1x"),
        ("time to first token, cold (s)", best("kvjax_single", "ttft_cold_from_launch_s", True),
         best("transformers_single", "ttft_cold_from_launch_s", True), None, ""),
        ("time to first token, warm (s)", best("kvjax_single", "ttft_warm_s", True),
         best("transformers_single", "ttft_warm_s", True), None, ""),
        ("load time (s)", best("kvjax_single", "load_s", True), best("transformers_single", "load_s", True), None, "<= 2x"),
        ("offline tok/s vs continuous batching", kv_off, hf_cb, kv_off / hf_cb, ">= 2x"),
        ("offline tok/s vs padded generate", kv_off, hf_pad, kv_off / hf_pad, ""),
    ]
    print(f"\n{'':40s} {'kvjax':>10s} {'transformers':>13s} {'ratio':>7s}  target")
    for name, a, b, ratio, target in rows:
        print(f"{name:40s} {a:10.3f} {b:13.3f} {'' if ratio is None else f'{ratio:6.2f}x':>7s}  {target}")
    floor = best("kvjax_offline", "step_over_floor", True)
    print(f"{'decode step / matmul floor, batch 32':40s} {floor:10.2f}x{'':22s}  <= 1.5x")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"checkpoint": args.checkpoint, "layers": args.layers, "results": results}, f, indent=1)
    if tmp:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
