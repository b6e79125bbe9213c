"""How long would the device sit idle while kvjax's engine does its host work, serial and overlapped?

The device is replaced by a time model: every forward takes a fixed `--device-ms` (sleep), the
time an accelerator would spend on the step (about 7 ms for an 8B decode step at batch 64 on an
H200), and answers with simulated tokens (`kvjax.router.sim.TimeModelRunner`). Everything else
is the real engine's host work: the scheduler, the ledger (admission, decode batches, pending
tokens, block tables, stores, transfers), the bucketed numpy batch the device would receive; no
detokenisation and no host-to-device copies (they belong to the device time here).

The modelled device is a queue, as a real one is: a forward dispatched at time t starts at
max(t, the end of the previous one) and ends `device_s` later; reading its tokens waits for
that end. Serially (`async_scheduling` off) the host prepares step n+1 only after step n's
tokens are back, so the device is idle for all of the host's time; overlapped
(kvjax/engine/overlap.py) the host schedules and dispatches step n+1 while step n runs, so
the device idles only when the host takes longer than a device step. Either way

    idle fraction = (wall - device busy time) / wall

is printed per batch size and mode, for the decode steps (the steady state: each step's wall
window against the device time inside it) and for the whole run, with the host's own time per
decode step (the step's wall time minus the time spent waiting for tokens). Target: <= 10% at
batch 64.

    python benchmarks/engine_overhead.py [--batches 1,64,256] [--device-ms 7] [--prompt-len 128] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvjax.config import CacheConfig  # noqa: E402
from kvjax.engine.batching import build_step  # noqa: E402
from kvjax.engine.config import EngineConfig  # noqa: E402
from kvjax.engine.core import EngineCore  # noqa: E402
from kvjax.engine.engine import Engine  # noqa: E402
from kvjax.engine.scheduler import SchedulerConfig  # noqa: E402
from kvjax.engine.workloads import WorkItem  # noqa: E402
from kvjax.router.sim import TimeModelRunner  # noqa: E402


def _sleep_until(end: float) -> None:
    """Sleep for most of it, spin the last 0.2 ms for accuracy."""
    while time.perf_counter() < end:
        left = end - time.perf_counter()
        if left > 2e-4:
            time.sleep(left - 2e-4)


class _TimedForward:
    """A dispatched forward of the modelled device: `fetch` waits for its end."""

    def __init__(self, runner: SleepingRunner, inner, end: float) -> None:
        self.runner, self.inner, self.end = runner, inner, end
        self.tokens, self.real_rows = inner.tokens, inner.real_rows

    def fetch(self):
        t = time.perf_counter()
        _sleep_until(self.end)
        self.runner.waited += time.perf_counter() - t
        return self.inner.fetch()


class SleepingRunner(TimeModelRunner):
    """A time-model runner whose device runs each forward for `device_s` of wall time, one after
    the other, from when it is dispatched (or the previous one ends)."""

    def __init__(self, vocab_size: int, device_s: float) -> None:
        super().__init__(vocab_size)
        self.device_s = device_s
        self.device_total = 0.0
        self.busy: list[tuple[float, float]] = []  # (start, end) of every forward
        self.waited = 0.0  # host time spent waiting for tokens

    def batch(self, ledger, decode, prefill, buckets):
        """The real host-side batch (block tables, positions, slot mappings as numpy arrays)."""
        return build_step(ledger, decode, prefill, buckets)

    def dispatch(self, pools, batch, temperature, top_p, seed, index, top_k=None, extras=None, feed=None):
        pending, pools = super().dispatch(pools, batch, temperature, top_p, seed, index, top_k, extras, feed)
        start = max(time.perf_counter(), self.busy[-1][1] if self.busy else 0.0)
        self.busy.append((start, start + self.device_s))
        self.device_total += self.device_s
        return _TimedForward(self, pending, start + self.device_s), pools

    def busy_within(self, t0: float, t1: float) -> float:
        """Device time inside the wall window [t0, t1]."""
        return sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in self.busy[-64:] if e > t0)


def measure(batch: int, device_s: float, prompt_len: int, new_tokens: int, tpb: int, seed: int,
            overlap: bool = False) -> dict:
    vocab = 32000
    runner = SleepingRunner(vocab, device_s)
    blocks = batch * (-(-(prompt_len + new_tokens) // tpb) + 2) + 16
    cache = CacheConfig(tokens_per_block=tpb, num_layers=1, num_kv_heads=1, head_dim=8,
                        max_seq_len=prompt_len + new_tokens + tpb, primary_blocks=blocks, secondary_blocks=0)
    sched = SchedulerConfig(max_batch_size=batch, max_num_tokens=max(batch, 2048))
    config = EngineConfig(sched, async_scheduling=overlap)
    engine = Engine(runner.model, config, runner=runner)  # type: ignore[arg-type]  # a duck-typed runner
    core = EngineCore(engine, cache)
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, vocab, prompt_len // 2).tolist()  # half of each prompt is a shared system prompt
    for i in range(batch):
        prompt = shared + rng.integers(1, vocab, prompt_len - len(shared)).tolist()
        core.add_request(WorkItem(f"r{i}", tuple(prompt), new_tokens), prompt, seed=i)
    t0 = time.perf_counter()
    steps = decode_steps = 0
    decode_wall = decode_device = decode_host = 0.0
    while core.has_unfinished_requests():
        waited = runner.waited
        ts = time.perf_counter()
        core.step()
        te = time.perf_counter()
        steps += 1
        last = core.last_step
        if last.prefill_tokens == 0 and last.admitted == 0 and last.decode_rows > 0:  # a pure decode step
            decode_steps += 1
            decode_wall += te - ts
            decode_device += runner.busy_within(ts, te)
            decode_host += te - ts - (runner.waited - waited)
    wall = time.perf_counter() - t0
    core.verify_idle()
    return {
        "batch": batch, "overlap": overlap, "steps": steps, "forwards": runner.forwards, "decode_steps": decode_steps,
        "wall_s": wall, "device_s": runner.device_total,
        "idle_fraction": max(0.0, wall - runner.device_total) / wall,
        "decode_host_ms_per_step": decode_host / max(decode_steps, 1) * 1e3,
        "decode_idle_fraction": (decode_wall - decode_device) / decode_wall if decode_wall else float("nan"),
        "overlapped_steps": core.counters.overlapped_steps, "wasted_rows": core.counters.wasted_rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--device-ms", type=float, default=7.0, help="modelled device time of one forward (default 7)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/engine_overhead.json")
    args = ap.parse_args()
    rows = []
    print(f"device time model: {args.device_ms} ms per forward; prompts {args.prompt_len} tokens (half shared), "
          f"{args.new_tokens} new tokens each")
    print(f"{'batch':>6} {'mode':>10} {'steps':>6} {'forwards':>9} {'host ms/decode step':>20} "
          f"{'idle (decode steps)':>20} {'idle (whole run)':>17}")
    for b in (int(x) for x in args.batches.split(",")):
        for overlap in (False, True):
            r = measure(b, args.device_ms / 1e3, args.prompt_len, args.new_tokens, args.tokens_per_block, args.seed,
                        overlap=overlap)
            rows.append(r)
            mode = "overlapped" if overlap else "serial"
            print(f"{b:>6} {mode:>10} {r['steps']:>6} {r['forwards']:>9} {r['decode_host_ms_per_step']:>20.2f} "
                  f"{r['decode_idle_fraction']:>20.1%} {r['idle_fraction']:>17.1%}", flush=True)
    print("target: idle <= 10% at batch 64 (serial: every host millisecond is device idle time; overlapped: only "
          "host time beyond a device step is)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device_ms": args.device_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
