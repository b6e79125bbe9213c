"""What a wide block table costs a step whose rows are short: paged decode attention over the
same rows through a table of `--narrow` columns and one of `--wide` columns (the engine's one
table width per engine, `kvjax.engine.batching.table_width`), best of `--repeats`.

    python benchmarks/table_width_bench.py [--batch 8] [--row-tokens 64] [--narrow 4] [--wide 128]

The attention loops over live columns only (the XLA path's column loop from `xla_chunk_range`,
the Pallas kernels' block loop from each row's length), so the two should cost about the same;
the `long` column is the wide table's rows filled (`--wide` columns of context), for scale.
Also printed: the step's table bytes sent host -> device per window (`StepBatch.rows`' table
columns) and the XLA path's columns per loop step at the CPU's and the accelerator's step
budgets (`kvjax.device.attention.CHUNK_BYTES*`: the most columns a short row's step reads).
Pools: one layer, 8 kv heads x 128, 32 query heads, 16-token blocks, bfloat16 (and FP8, the
XLA path). On a CPU it times the XLA path; on a GPU the default backend's path (Mosaic GPU for
bfloat16) and the XLA path FP8 pools take.
Writes `results/table_width_bench.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvjax import CacheConfig  # noqa: E402
from kvjax.device import allocate_pools, attention, paged_attention  # noqa: E402


def best_ms(fn, repeats: int) -> float:
    fn()  # compile
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(dtype: str, impl: str, a) -> dict:
    tpb, heads, dim = 16, 8, 128
    blocks = a.batch * a.wide + 1
    cfg = CacheConfig(tokens_per_block=tpb, num_layers=1, num_kv_heads=heads, head_dim=dim, max_seq_len=a.wide * tpb,
                      primary_blocks=blocks, dtype=dtype)
    pools = allocate_pools(cfg)
    rng = np.random.default_rng(0)
    slots = rng.permutation(blocks - 1).astype(np.int32)[: a.batch * a.wide].reshape(a.batch, a.wide)  # [B, wide]
    q = jnp.asarray(rng.standard_normal((a.batch, 1, 4 * heads, dim)), jnp.bfloat16)  # [B, 1, N, H]
    short = jnp.full((a.batch,), a.row_tokens, jnp.int32)  # [B]
    full = jnp.full((a.batch,), a.wide * tpb, jnp.int32)  # [B]
    narrow, wide = jnp.asarray(slots[:, : a.narrow]), jnp.asarray(slots)
    run = lambda t, lens: lambda: paged_attention(q, pools, 0, t, lens, impl=impl).block_until_ready()  # noqa: E731
    out = {"narrow_ms": best_ms(run(narrow, short), a.repeats), "wide_ms": best_ms(run(wide, short), a.repeats),
           "long_ms": best_ms(run(wide, full), a.repeats)}
    out["wide_over_narrow"] = out["wide_ms"] / out["narrow_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--row-tokens", type=int, default=64)
    ap.add_argument("--narrow", type=int, default=4)
    ap.add_argument("--wide", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default="results/table_width_bench.json")
    a = ap.parse_args()
    if a.row_tokens > a.narrow * 16:
        ap.error(f"--row-tokens {a.row_tokens} do not fit a table of --narrow {a.narrow} 16-token blocks")
    cpu = jax.default_backend() == "cpu"
    cases = [("bfloat16", "xla", "XLA path")] if cpu else [("bfloat16", "auto", "default path")]
    cases.append(("float8_e4m3fn", "xla", "FP8, XLA path"))
    column = 8 * 16 * 128 * 2  # one column's pages of one field as the dots read them (bfloat16)
    steps = {name: {w: attention.xla_chunk_columns(a.batch, w, column, budget) for w in (a.narrow, a.wide)}
             for name, budget in (("cpu", attention.CHUNK_BYTES), ("accelerator", attention.CHUNK_BYTES_ACCELERATOR))}
    print("XLA path columns per loop step (narrow, wide table): " + ", ".join(
        f"{name} budget {c[a.narrow]}, {c[a.wide]}" for name, c in steps.items())
          + f"; a short row's step reads at most that many columns (its own: {-(-a.row_tokens // 16)})")
    rows = []
    print(f"{jax.default_backend()} ({jax.devices()[0].device_kind}): decode attention, batch {a.batch}, rows of "
          f"{a.row_tokens} tokens; table bytes per window {a.batch * a.narrow * 4} B (narrow) vs "
          f"{a.batch * a.wide * 4} B (wide); ms, best of {a.repeats}")
    print(f"  {'case':<42} {'narrow':>8} {'wide':>8} {'wide/narrow':>12} {'long':>8}")
    for dtype, impl, label in cases:
        r = {"dtype": dtype, "impl": impl, "case": label, **measure(dtype, impl, a)}
        rows.append(r)
        print(f"  {dtype + ' ' + impl + ' (' + label + ')':<42} {r['narrow_ms']:>8.3f} {r['wide_ms']:>8.3f} "
              f"{r['wide_over_narrow']:>12.2f} {r['long_ms']:>8.3f}", flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"backend": jax.default_backend(), "args": vars(a), "columns_per_step": steps, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
