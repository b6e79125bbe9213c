"""Serving benchmark: concurrent multi-turn chat clients over HTTP against the kvjax server.

Each of `--users` clients holds a `--turns`-turn conversation (one of `--system-prompts`
shared system prompts, then its own messages; every turn resends the whole conversation, as
chat clients do) through streaming /v1/chat/completions requests, all clients at once. The
same trace is served four times, by four servers in this process that share one model and one
compiled runner: prefix reuse on / off x waiting-queue policy FCFS / LPM. Per configuration it
prints TTFT p50 / p99 and inter-token latency (measured by the clients), output tokens/s
(completion tokens / wall time of the run) and the prefix hit rate (prompt tokens reused /
admitted, from /metrics), and writes a JSON and a PNG.

    python benchmarks/serve_bench.py                         # tiny built-in model on the CPU
    python benchmarks/serve_bench.py --model /path/to/ckpt   # a checkpoint directory
    python benchmarks/serve_bench.py --url http://host:8000  # one run against a running server

Shapes are kept few and fixed so that timing never depends on which run compiled what: decode
batches are padded to `--max-batch-size`, block tables to `--max-seq-len`, prefill runs one row
per forward; a warm-up compiles every resulting shape (one decode, one prefill per chunk
bucket) before the first measured run, and each row reports the compilations it still saw.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = [
    "cache", "block", "token", "prefix", "reuse", "tree", "page", "layer", "memory", "host", "device", "pool", "radix",
    "window", "batch", "step", "queue", "model", "serve", "chat", "system", "user", "answer", "question", "fast", "slow",
]


def sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() + "."


def make_trace(seed: int, users: int, turns: int, system_prompts: int, system_words: int, user_words: int):
    """Per user: (system prompt, [user messages]); deterministic in `seed`."""
    rng = random.Random(seed)
    systems = [" ".join(sentence(rng, 8) for _ in range(max(1, system_words // 8))) for _ in range(system_prompts)]
    return [(systems[u % system_prompts], [sentence(rng, user_words) for _ in range(turns)]) for u in range(users)]


def metrics(http: httpx.Client, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get(url + "/metrics").text):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    return out


def chat_turn(http: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int):
    """One streamed chat request: (reply text, TTFT, gaps between content chunks, completion tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    text: list[str] = []
    tokens = 0
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            piece = chunk["choices"][0]["delta"].get("content")
            if piece:
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                else:
                    gaps.append(now - last)
                last = now
                text.append(piece)
    return "".join(text), first, gaps, tokens


def run_clients(url: str, model: str, trace, max_tokens: int) -> dict:
    """All users at once, each turn after the previous reply; returns the raw measurements."""
    ttft: list[float] = []
    gaps: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def user(system: str, messages: list[str]) -> None:
        with httpx.Client(timeout=600) as http:
            history = [{"role": "system", "content": system}]
            for m in messages:
                history.append({"role": "user", "content": m})
                reply, first, g, n = chat_turn(http, url, model, history, max_tokens)
                history.append({"role": "assistant", "content": reply})
                with lock:
                    if first is not None:
                        ttft.append(first)
                    gaps.extend(g)
                    tokens[0] += n

    with httpx.Client(timeout=60) as http:
        before = metrics(http, url)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(trace)) as pool:
            for f in [pool.submit(user, s, ms) for s, ms in trace]:
                f.result()
        wall = time.perf_counter() - t0
        after = metrics(http, url)
    reused = after["kvjax_prompt_tokens_reused_total"] - before["kvjax_prompt_tokens_reused_total"]
    computed = after["kvjax_prompt_tokens_computed_total"] - before["kvjax_prompt_tokens_computed_total"]
    return {
        "ttft": ttft, "itl": gaps, "wall_s": wall, "output_tokens": tokens[0],
        "reused_prompt_tokens": reused, "computed_prompt_tokens": computed,
        "offloaded": after["kvjax_kv_blocks_offloaded_total"] - before["kvjax_kv_blocks_offloaded_total"],
        "evicted": after["kvjax_kv_blocks_evicted_total"] - before["kvjax_kv_blocks_evicted_total"],
    }


def summarize(label: str, raw: dict, compilations: int | None) -> dict:
    ttft, itl = np.asarray(raw["ttft"]), np.asarray(raw["itl"])
    admitted = raw["reused_prompt_tokens"] + raw["computed_prompt_tokens"]
    return {
        "config": label,
        "requests": len(ttft),
        "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else float("nan"),
        "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else float("nan"),
        "itl_mean_ms": float(itl.mean() * 1e3) if len(itl) else float("nan"),
        "itl_p99_ms": float(np.percentile(itl, 99) * 1e3) if len(itl) else float("nan"),
        "output_tok_per_s": raw["output_tokens"] / raw["wall_s"],
        "prefix_hit_rate": raw["reused_prompt_tokens"] / admitted if admitted else 0.0,
        "prefill_tokens_computed": int(raw["computed_prompt_tokens"]),
        "blocks_evicted": int(raw["evicted"]),
        "wall_s": raw["wall_s"],
        "compilations": compilations,
    }


COLUMNS = [("config", "config", "{}"), ("requests", "reqs", "{:d}"), ("ttft_p50_s", "TTFT p50", "{:.3f} s"),
           ("ttft_p99_s", "TTFT p99", "{:.3f} s"), ("itl_mean_ms", "ITL mean", "{:.1f} ms"),
           ("itl_p99_ms", "ITL p99", "{:.1f} ms"), ("output_tok_per_s", "output tok/s", "{:.1f}"),
           ("prefix_hit_rate", "prefix hit rate", "{:.1%}"), ("prefill_tokens_computed", "prefill computed", "{:d}"),
           ("blocks_evicted", "evicted", "{:d}"), ("compilations", "compiles", "{}")]


def table(rows: list[dict]) -> str:
    cells = [[name for _, name, _ in COLUMNS]] + [
        [fmt.format(r[k]) if r[k] is not None else "-" for k, _, fmt in COLUMNS] for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def plot(path: Path, rows: list[dict], raws: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for row, raw in zip(rows, raws, strict=True):
        t = np.sort(raw["ttft"])
        axes[0].plot(t, np.arange(1, len(t) + 1) / len(t), label=row["config"])
    axes[0].set_xlabel("TTFT (s)")
    axes[0].set_ylabel("fraction of requests")
    axes[0].set_title("time to first token (CDF)")
    axes[0].legend(fontsize=8)
    axes[1].boxplot([np.asarray(raw["itl"]) * 1e3 for raw in raws], showfliers=False)
    axes[1].set_xticks(range(1, len(rows) + 1), [r["config"] for r in rows], rotation=15, fontsize=8)
    axes[1].set_ylabel("ms")
    axes[1].set_title("inter-token latency")
    x = np.arange(len(rows))
    axes[2].bar(x - 0.2, [r["output_tok_per_s"] for r in rows], 0.4, label="output tok/s")
    ax2 = axes[2].twinx()
    ax2.bar(x + 0.2, [r["prefix_hit_rate"] for r in rows], 0.4, color="tab:orange", label="prefix hit rate")
    ax2.set_ylim(0, 1)
    axes[2].set_xticks(x, [r["config"] for r in rows], rotation=15, fontsize=8)
    axes[2].set_title("throughput (blue) and prefix hit rate (orange)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def warm_up(engine, args) -> None:
    """Compile the decode shape and the prefill shape of every chunk bucket."""
    from kvjax import SamplingParams

    chunk = args.min_chunk_bucket
    while chunk <= args.max_num_tokens:  # one prompt of exactly `chunk` tokens: one prefill forward
        engine.add_request(f"warm-prefill-{chunk}", list(range(1, chunk + 1)), SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        chunk *= 2
    for i in range(args.max_batch_size):
        engine.add_request(f"warm-decode-{i}", [1 + i, 2, 3], SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="built-in model name or checkpoint directory (default tiny)")
    p.add_argument("--url", help="benchmark an already running server instead (one configuration)")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-words", type=int, default=160, help="words per system prompt")
    p.add_argument("--user-words", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn")
    p.add_argument("--primary-blocks", type=int, default=96)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--max-num-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--min-chunk-bucket", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results", help="directory for serve_bench.json / .png")
    args = p.parse_args(argv)

    trace = make_trace(args.seed, args.users, args.turns, args.system_prompts, args.system_words, args.user_words)
    rows, raws = [], []
    if args.url:
        with httpx.Client() as http:
            model = http.get(args.url + "/v1/models").json()["data"][0]["id"]
        raw = run_clients(args.url, model, trace, args.max_tokens)
        rows.append(summarize(f"{args.url}", raw, None))
        raws.append(raw)
    else:
        from kvjax.engine import Engine, EngineConfig, LLMEngine, ModelRunner
        from kvjax.engine.config import cache_config
        from kvjax.llm import load_model
        from kvjax.server import ServerConfig, ServerThread

        model, tokenizer = load_model(args.model)
        runner = ModelRunner(model)
        base = {"tokens_per_block": args.tokens_per_block, "primary_blocks": args.primary_blocks,
                "max_seq_len": args.max_seq_len}
        engine_options = {"max_batch_size": args.max_batch_size, "max_num_tokens": args.max_num_tokens,
                          "min_batch_bucket": args.max_batch_size, "min_blocks_bucket": args.max_seq_len // args.tokens_per_block,
                          "min_chunk_bucket": args.min_chunk_bucket, "prefill_rows": 1}
        configs = [("reuse on, fcfs", True, "fcfs"), ("reuse on, lpm", True, "lpm"),
                   ("reuse off, fcfs", False, "fcfs"), ("reuse off, lpm", False, "lpm")]

        def engine(reuse: bool, queue: str) -> LLMEngine:
            ec = EngineConfig.from_dict({**engine_options, "queue_policy": queue})
            cc = cache_config(model.spec, {**base, "enable_block_reuse": reuse}, max_num_tokens=args.max_num_tokens)
            return LLMEngine(Engine(model, ec, runner=runner), cc, tokenizer=tokenizer)

        def server(reuse: bool, queue: str) -> ServerThread:
            return ServerThread(engine(reuse, queue), ServerConfig(str(args.model), max_pending=4 * args.users))

        print(f"warm-up ({args.model}: compiling every shape)...", file=sys.stderr, flush=True)
        warm_up(engine(False, "fcfs"), args)
        for label, reuse, queue in configs:
            print(f"{label}...", file=sys.stderr, flush=True)
            traces0 = runner.num_traces
            with server(reuse, queue) as srv:
                raw = run_clients(srv.url, str(args.model), trace, args.max_tokens)
            rows.append(summarize(label, raw, runner.num_traces - traces0))
            raws.append(raw)
    title = (f"{args.users} users x {args.turns} turns, {args.system_prompts} system prompts, {args.max_tokens} tokens/turn, "
             f"model {args.model}")
    print(title)
    print(table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(out / "serve_bench.png", rows, raws, title)
    print(f"wrote {out / 'serve_bench.json'} and {out / 'serve_bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
