"""A restart with the third KV tier against one without: prefix hit rate and time to first token.

    python benchmarks/tier3_bench.py [--model micro] [--prompts 8] [--prompt-len 768] [--store file|memory]

One process, CPU by default (JAX_PLATFORMS=cpu). A first engine serves `--prompts` prompts and
enough filler prompts to push them out of device memory into the host tier, which writes them
through to the store; it is closed (its puts finish). Then two "restarted" engines (fresh
ledgers and pools, as a new process has) serve the same prompts one at a time: one on the same
store, one without a store. Printed: per run the token hit rate (reused / admitted prompt
tokens), mean TTFT (from `add_request` to the request's first token), and the ratios. Every
engine shares one jitted runner and a warm-up pass runs first, so compilation is not timed.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from kvjax import SamplingParams  # noqa: E402
from kvjax.engine import Engine, EngineConfig, LLMEngine, ModelRunner, SchedulerConfig, cache_config  # noqa: E402
from kvjax.engine.batching import Buckets  # noqa: E402
from kvjax.engine.store_tier_driver import KVStoreConfig  # noqa: E402
from kvjax.kv_store import FileStore, MemoryStore  # noqa: E402
from kvjax.models import Transformer  # noqa: E402

TPB = 16


def make(model, runner, args, store=None) -> LLMEngine:
    cfg = EngineConfig(SchedulerConfig(max_batch_size=4, max_num_tokens=256),
                       Buckets(min_batch=4, min_chunk=256, min_blocks=args.max_seq_len // TPB, prefill_rows=1))
    cc = cache_config(model.spec, {"tokens_per_block": TPB, "max_seq_len": args.max_seq_len,
                                   "primary_blocks": args.primary_blocks, "secondary_blocks": args.secondary_blocks},
                      max_num_tokens=256)
    kv = None if store is None else KVStoreConfig(store=store, close_store=False, model_id=f"{args.model}@seed0",
                                                  prefetch_policy="wait_complete", prefetch_min_tokens=TPB)
    return LLMEngine(Engine(model, cfg, runner=runner), cc, kv_store=kv)


def serve_one_by_one(eng: LLMEngine, prompts, tag: str) -> tuple[list[float], list[list[int]]]:
    """TTFT of each prompt served alone (seconds), and its tokens."""
    ttft, toks = [], []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        eng.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=4))
        first = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if first is None and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if o.finished:
                    toks.append(list(o.outputs[0].token_ids))
        assert first is not None
        ttft.append(first)
    return ttft, toks


def hit_rate(eng: LLMEngine) -> float:
    c = eng.core.counters
    return c.reused_prompt_tokens / c.admitted_prompt_tokens if c.admitted_prompt_tokens else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="micro")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=768)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--primary-blocks", type=int, default=128)
    ap.add_argument("--secondary-blocks", type=int, default=512)
    ap.add_argument("--store", choices=["file", "memory"], default="file")
    args = ap.parse_args()

    model = Transformer.from_spec(args.model, seed=0)
    runner = ModelRunner(model)
    rng = np.random.default_rng(0)
    vocab = model.spec.vocab_size

    def draw(n):
        return [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(n)]

    num_fillers = args.primary_blocks * TPB // args.prompt_len + 2
    with tempfile.TemporaryDirectory() as tmp:
        trial(model, runner, args, draw(args.prompts), draw(num_fillers), os.path.join(tmp, "warm"))  # compiles everything
        out = trial(model, runner, args, draw(args.prompts), draw(num_fillers), os.path.join(tmp, "kv"))
    print(json.dumps(out, indent=1))


def trial(model, runner, args, prompts, fillers, path: str) -> dict:
    """First engine (writes the store), then a restart with the store and one without."""
    mem = MemoryStore(1 << 34)

    def open_store():
        return FileStore(path, 1 << 34) if args.store == "file" else mem

    store = open_store()
    a = make(model, runner, args, store)
    t0 = time.perf_counter()
    serve_one_by_one(a, prompts, "a")
    serve_one_by_one(a, fillers, "f")
    a.close()
    fill_s = time.perf_counter() - t0
    stats_a = a.core.store_tier.stats()
    if args.store == "file":
        store.close()
    results: dict = {}
    for label, st in (("with_store", open_store()), ("without_store", None)):
        e = make(model, runner, args, st)
        ttft, toks = serve_one_by_one(e, prompts, label)
        results[label] = {"hit_rate": round(hit_rate(e), 4), "ttft_mean_ms": round(1e3 * float(np.mean(ttft)), 2),
                          "ttft_p50_ms": round(1e3 * float(np.median(ttft)), 2), "tokens": toks}
        if st is not None:
            results[label]["store"] = e.core.store_tier.stats()
        e.close()
        if st is not None and args.store == "file":
            st.close()
    same = results["with_store"].pop("tokens") == results["without_store"].pop("tokens")
    w, wo = results["with_store"], results["without_store"]
    return {"model": args.model, "store": args.store, "prompts": args.prompts, "prompt_len": args.prompt_len,
            "first_engine_s": round(fill_s, 2), "blocks_written": stats_a.get("store_puts"), **results,
            "same_tokens": same, "hit_rate_with_minus_without": round(w["hit_rate"] - wo["hit_rate"], 4),
            "ttft_mean_ratio_with_over_without": round(w["ttft_mean_ms"] / wo["ttft_mean_ms"], 3),
            "ttft_p50_ratio_with_over_without": round(w["ttft_p50_ms"] / wo["ttft_p50_ms"], 3)}


if __name__ == "__main__":
    main()
