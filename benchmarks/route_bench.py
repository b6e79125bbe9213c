"""KV-aware routing vs round-robin vs least-loaded on a multi-tenant chat workload.

The `multi-tenant-chat` workload (96 users in multi-turn conversations behind 6 long system
prompts, 3 tenants) goes through 4 simulated replicas (`kvjax.router.sim`: real ledgers and the
engine's scheduler, a time model instead of a model, events through the real wire format into
the router's index), once per routing policy, and once through a single replica holding all
four replicas' cache (the hit-rate reference). Prints cluster prefix hit rate, TTFT p50 / p99
and load imbalance (max / mean time-averaged running requests) per policy, checks the targets
(KV-aware: >= 90% of the single replica's hit rate, imbalance <= 1.3), and writes a PNG + JSON.

    python benchmarks/route_bench.py                      # results/route_bench.{json,png}
    python benchmarks/route_bench.py --replicas 8 --tick-s 0.01
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax.router.sim import format_table, run_route_sim, write_report  # noqa: E402

HIT_TARGET = 0.90  # of the single replica's hit rate
IMBALANCE_TARGET = 1.3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="multi-tenant-chat")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--tick-s", type=float, default=0.02, help="seconds between two users' first messages")
    ap.add_argument("--out", default=str(ROOT / "results"))
    a = ap.parse_args(argv)
    t0 = time.perf_counter()

    def progress(r):
        print(f"  {r.label:<14} done ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)

    run = run_route_sim(a.workload, replicas=a.replicas, tick_s=a.tick_s, progress=progress)
    print(f"workload {run.workload!r}: {run.results[0].requests} requests over {a.replicas} replicas "
          f"(tick {a.tick_s} s; per replica: {run.settings['cache_per_replica']})")
    print(format_table(run.results, run.reference))
    kv = next(r for r in run.results if r.label == "kv-aware")
    ref = run.reference
    rel = kv.hit_rate / ref.hit_rate
    ok_hit, ok_imb = rel >= HIT_TARGET, kv.imbalance <= IMBALANCE_TARGET
    print(f"kv-aware hit rate {kv.hit_rate:.1%} = {rel:.1%} of the single replica's {ref.hit_rate:.1%} "
          f"(target >= {HIT_TARGET:.0%}): {'PASS' if ok_hit else 'FAIL'}")
    print(f"kv-aware load imbalance {kv.imbalance:.2f} (target <= {IMBALANCE_TARGET}): {'PASS' if ok_imb else 'FAIL'}")
    for r in run.results:
        print(f"  {r.label}: index promised {r.predicted_tokens} cached tokens at routing time, replicas reused "
              f"{r.reused_tokens}; {r.wire_batches} event batches, {r.wire_bytes / 1e6:.2f} MB on the wire; "
              f"evicted {r.evicted_blocks}, offloaded {r.offloaded_blocks}, onboarded {r.onboarded_blocks} blocks")
    js, png = write_report(run, a.out, "route_bench")
    print(f"wrote {js} and {png} ({time.perf_counter() - t0:.1f} s)")
    return 0 if ok_hit and ok_imb else 1


if __name__ == "__main__":
    sys.exit(main())
