"""Disaggregated prefill/decode vs one aggregated engine, on a prefill-heavy workload.

    python benchmarks/pd_bench.py [--requests 16] [--prompt-tokens 192] [--max-tokens 16]
                                  [--interval 0.05] [--model micro]

Both setups serve the same requests (random token prompts, greedy, `--max-tokens` each, one
arriving every `--interval` seconds) in this process:

- aggregated: one engine on its own thread;
- P/D: a producer engine (P) and a consumer engine (D), each on its own thread, linked as
  vLLM's proxy links them: each request goes to P with max_tokens=1 and
  `kv_transfer_params={"do_remote_decode": true}`; when it finishes, its returned params go
  with the request to D, which pulls the prompt's KV (kvjax.disagg, 127.0.0.1) and decodes.

Per setup: TTFT (arrival to the first token the client sees: D's, in P/D) p50 / mean,
inter-token latency (mean over requests of (finish - first token) / (tokens - 1)), output
tokens/s over the run's wall time, and the prompt tokens the decode side computed vs
received. Then the P/D / aggregated ratios. Every step shape (and the transfer's gather and
scatter) is compiled by a warm-up before the measured runs. On a CPU host both engines share
the same cores, so P/D cannot add compute; what it changes is that decode steps never wait
behind prefill chunks (ITL), at the cost of the transfer and the extra hop (TTFT).
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvjax.disagg import KVTransferConfig  # noqa: E402
from kvjax.engine import LLMEngine  # noqa: E402
from kvjax.engine.sampling import SamplingParams  # noqa: E402


class Loop(threading.Thread):
    """One engine driven by its own thread: requests come in through `submit`, every output
    goes to `on_output` (on this thread)."""

    def __init__(self, engine: LLMEngine, on_output) -> None:
        super().__init__(daemon=True)
        self.engine, self.on_output = engine, on_output
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, kv: dict | None = None) -> None:
        self.inbox.put((rid, prompt, params, kv))

    def run(self) -> None:
        eng = self.engine
        try:
            while not self.stopping.is_set():
                busy = eng.has_unfinished_requests()
                try:
                    while True:
                        rid, prompt, params, kv = self.inbox.get_nowait() if busy else self.inbox.get(timeout=0.002)
                        eng.add_request(rid, prompt, params, kv_transfer_params=kv)
                        busy = True
                except queue.Empty:
                    pass
                if eng.has_unfinished_requests():
                    for out in eng.step():
                        self.on_output(out)
                elif eng.core.remote_kv is not None:
                    eng.core.remote_kv.poll([])
        except BaseException as e:  # reported by the driver
            self.error = e


class Recorder:
    """Arrival, first-token and finish times of the requests a client sees."""

    def __init__(self) -> None:
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.finish: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.lock = threading.Lock()

    def seen(self, out) -> None:
        now = time.perf_counter()
        with self.lock:
            if out.outputs[0].token_ids and out.request_id not in self.first:
                self.first[out.request_id] = now
            if out.finished:
                self.finish[out.request_id] = now
                self.tokens[out.request_id] = list(out.outputs[0].token_ids)

    def by_index(self) -> dict[int, list[int]]:
        return {int(k.rpartition("-")[2]): v for k, v in self.tokens.items()}

    def summary(self, wall: float) -> dict:
        ids = sorted(self.arrival)
        ttft = np.array([self.first[i] - self.arrival[i] for i in ids])
        itl = [(self.finish[i] - self.first[i]) / (len(self.tokens[i]) - 1) for i in ids if len(self.tokens[i]) > 1]
        out_tokens = sum(len(self.tokens[i]) for i in ids)
        return {"ttft_p50": float(np.median(ttft)), "ttft_mean": float(ttft.mean()), "itl_mean": float(np.mean(itl)),
                "tokens_per_s": out_tokens / wall}


def make_engine(args, role: str | None) -> LLMEngine:
    kv = None if role is None else KVTransferConfig.parse({"kv_connector": "JaxTransferConnector", "kv_role": role})
    return LLMEngine.from_options(args.model, kv_transfer=kv, tokens_per_block=16, primary_blocks=args.primary_blocks,
                                  max_seq_len=512, max_batch_size=8, max_num_tokens=args.chunk,
                                  min_batch_bucket=8, min_chunk_bucket=args.chunk, min_blocks_bucket=32, prefill_rows=1)


def drive(args, prompts, tag: str, submit, rec: Recorder, done) -> float:
    """Submit the requests at `--interval`, wait until all finished; returns the wall time."""
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        target = start + i * args.interval
        time.sleep(max(0.0, target - time.perf_counter()))
        rid = f"{tag}-{i}"
        with rec.lock:
            rec.arrival[rid] = time.perf_counter()
        submit(rid, p)
    deadline = time.perf_counter() + args.timeout
    while not done():
        if time.perf_counter() > deadline:
            raise SystemExit("the run did not finish in time")
        time.sleep(0.005)
    return time.perf_counter() - start


class Aggregated:
    """One engine on its own thread."""

    name = "aggregated"

    def __init__(self, args) -> None:
        self.args = args
        self.engine = make_engine(args, None)
        self.engine.core.warm_up("all")
        self.rec = Recorder()
        self.loop = Loop(self.engine, lambda out: self.rec.seen(out))
        self.loop.start()

    def measure(self, prompts, tag: str) -> tuple[dict, dict, int, int]:
        """(summary, tokens by prompt index, prompt tokens computed, received) of one round."""
        self.rec = rec = Recorder()
        params = SamplingParams(max_tokens=self.args.max_tokens, ignore_eos=True)
        computed0 = self.engine.core.counters.computed_prompt_tokens
        wall = drive(self.args, prompts, tag, lambda rid, p: self.loop.submit(rid, p, params), rec,
                     lambda: len(rec.finish) == len(prompts) or self.loop.error is not None)
        if self.loop.error:
            raise self.loop.error
        return rec.summary(wall), rec.by_index(), self.engine.core.counters.computed_prompt_tokens - computed0, 0

    def close(self) -> None:
        self.loop.stopping.set()
        self.loop.join()
        self.engine.close()


class Disaggregated:
    """A producer and a consumer engine, each on its own thread, linked as vLLM's proxy links them."""

    name = "P/D"

    def __init__(self, args, warm_prompt) -> None:
        self.args = args
        self.p, self.d = make_engine(args, "kv_producer"), make_engine(args, "kv_consumer")
        for e in (self.p, self.d):
            e.core.warm_up("all")
        self.rec = Recorder()
        self.prompt_of: dict[str, list[int]] = {}
        self.params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        self.d_loop = Loop(self.d, lambda out: self.rec.seen(out))
        self.p_loop = Loop(self.p, self._prefilled)
        self.p_loop.start()
        self.d_loop.start()
        self.measure([warm_prompt], "warm")  # connections, gather / scatter programs

    def _prefilled(self, out) -> None:  # the proxy's second step: the decode request, with P's params
        if out.finished:
            self.d_loop.submit(out.request_id, self.prompt_of[out.request_id], self.params, out.kv_transfer_params)

    def _submit(self, rid: str, prompt: list[int]) -> None:
        self.prompt_of[rid] = prompt
        self.p_loop.submit(rid, prompt, SamplingParams(max_tokens=1), {"do_remote_decode": True})

    def measure(self, prompts, tag: str) -> tuple[dict, dict, int, int]:
        self.rec = rec = Recorder()
        core = self.d.core
        computed0, received0 = core.counters.computed_prompt_tokens, core.remote_kv.counters.transferred_tokens
        wall = drive(self.args, prompts, tag, self._submit, rec, lambda: len(rec.finish) == len(prompts) or (
            self.p_loop.error or self.d_loop.error) is not None)
        if self.p_loop.error or self.d_loop.error:
            raise self.p_loop.error or self.d_loop.error  # type: ignore[misc]
        return (rec.summary(wall), rec.by_index(), core.counters.computed_prompt_tokens - computed0,
                core.remote_kv.counters.transferred_tokens - received0)

    def close(self) -> None:
        for loop in (self.p_loop, self.d_loop):
            loop.stopping.set()
            loop.join()
        rc = self.d.core.remote_kv.counters
        print(f"P/D: {rc.pulls} pulls, {rc.pull_seconds / max(rc.pulls, 1) * 1e3:.1f} ms each from start to arrival "
              f"(mean), {rc.pull_failures} failed")
        self.d.close()
        self.p.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="micro")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between arrivals")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per setup, alternating (medians shown)")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (token budget per step)")
    ap.add_argument("--primary-blocks", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    agg = Aggregated(args)
    vocab = agg.engine.engine.model.spec.vocab_size
    pd = Disaggregated(args, rng.integers(1, vocab, args.prompt_tokens).tolist())
    rows: dict[str, list[dict]] = {agg.name: [], pd.name: []}
    computed = {agg.name: 0, pd.name: 0}
    received = same = total = 0
    for k in range(args.rounds):  # fresh prompts per round (no prefix hits), both setups on the same ones
        prompts = [rng.integers(1, vocab, args.prompt_tokens).tolist() for _ in range(args.requests)]
        results = {}
        for setup in (agg, pd) if k % 2 == 0 else (pd, agg):
            summary, tokens, c, r = setup.measure(prompts, f"{k}")
            rows[setup.name].append(summary)
            computed[setup.name] += c
            received += r
            results[setup.name] = tokens
        same += sum(results[agg.name][i] == results[pd.name][i] for i in results[agg.name])
        total += len(prompts)
    agg.close()
    pd.close()
    med = {name: {key: float(np.median([r[key] for r in rs])) for key in rs[0]} for name, rs in rows.items()}
    print(f"{args.requests} requests x {args.prompt_tokens} prompt tokens, {args.max_tokens} new tokens, one every "
          f"{args.interval} s, model {args.model!r}; medians of {args.rounds} rounds")
    print(f"{'':12}{'TTFT p50':>10}{'TTFT mean':>11}{'ITL mean':>10}{'tok/s':>9}{'prompt computed':>17}")
    for name, s in med.items():
        print(f"{name:12}{s['ttft_p50'] * 1e3:>8.1f}ms{s['ttft_mean'] * 1e3:>9.1f}ms{s['itl_mean'] * 1e3:>8.2f}ms"
              f"{s['tokens_per_s']:>9.1f}{computed[name]:>17}")
    a, p = med[agg.name], med[pd.name]
    print(f"P/D decode side received {received} prompt tokens' KV; greedy outputs identical for {same}/{total}")
    print(f"ratios P/D / aggregated: TTFT p50 {p['ttft_p50'] / a['ttft_p50']:.2f}, "
          f"ITL {p['itl_mean'] / a['itl_mean']:.2f}, throughput {p['tokens_per_s'] / a['tokens_per_s']:.2f}")

if __name__ == "__main__":
    main()
