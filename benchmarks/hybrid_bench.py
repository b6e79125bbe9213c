"""Hybrid models (recurrent + attention layers): what prefix caching of recurrent states costs and
what it buys.

(a) State memory per cached token. A hybrid cache keeps a snapshot of every recurrent layer's
    state each `snapshot_interval` tokens (docs/semantics.md, "Recurrent states"), so a cached
    token costs its attention KV plus `state block / interval`; the running requests hold
    2 state blocks each on top (live + write). Printed for Qwen3.5's transformers-default config
    in bf16 (24 gated-DeltaNet + 8 attention layers) and the test fixtures, at snapshot
    intervals of 1, 2, 4 and 8 blocks, with the tokens a budget then holds
    (`kvjax.capacity.hybrid_pool_split`).
(b) A multi-turn chat workload on a hybrid checkpoint through the public `kvjax.LLM` API, with
    block reuse (prefix caching) on and off: every user shares a system prompt, each turn sends
    the whole conversation so far plus a new message; printed per mode: prefix hit rate (prompt
    tokens the cache supplied, `RequestOutput.num_cached_tokens`), prefill tokens computed and
    time to first token (`RequestOutput.metrics`). Greedy; the replies with caching on and off
    must be equal (it stops otherwise). A first pass of both modes on the same runner compiles
    the step programs, so the timed passes exclude compilation.

    python benchmarks/hybrid_bench.py                      # (a), then (b) on the Qwen3.5 fixture
    python benchmarks/hybrid_bench.py --part a --quick     # the table only (the test's smoke run)
    python benchmarks/hybrid_bench.py --part b --model DIR --users 8 --turns 6
    python benchmarks/hybrid_bench.py --part b --random-lfm2 512   # a larger random-weight LFM2
"""
from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvjax.capacity import hybrid_pool_split  # noqa: E402
from kvjax.config import RECURRENT_STATES  # noqa: E402
from kvjax.hybrid_capacity import HybridGeometry, hybrid_geometry, hybrid_geometry_from_config  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "hf_hybrid"
GiB = 2**30


def models(quick: bool) -> list[HybridGeometry]:
    """Qwen3.5 as transformers builds it with no arguments (bf16), then the fixtures."""
    out = [hybrid_geometry_from_config({"model_type": "qwen3_5_text", "dtype": "bfloat16"}, name="qwen3.5-default")]
    names = ["qwen3_5", "lfm2", "granite"] if quick else sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
    return out + [hybrid_geometry(FIXTURES / n) for n in names]


def state_rows(geo: HybridGeometry, tokens_per_block: int, budget: int, batch: int) -> list[dict]:
    """One row per snapshot interval (1, 2, 4, 8 blocks): bytes per cached token and the tokens
    `budget` bytes hold with `batch` running requests."""
    cfg = geo.cache_config(tokens_per_block=tokens_per_block)
    attn = sum(b for w, b in cfg.cache_size_per_token.items() if w != RECURRENT_STATES)
    block = cfg.recurrent_block_bytes
    rows = []
    for k in (1, 2, 4, 8):
        interval = k * tokens_per_block
        state = block / interval
        try:
            tokens, states = hybrid_pool_split(budget, attn, block, interval, batch)
        except ValueError:  # the running requests' state blocks alone exceed the budget
            tokens = states = 0
        rows.append(dict(model=geo.name, interval=interval, attn=attn, block=block, state=state, total=attn + state,
                         share=state / (attn + state), tokens=tokens, states=states))
    return rows


def part_a(args) -> list[dict]:
    rows = [r for geo in models(args.quick) for r in state_rows(geo, args.tokens_per_block, args.budget, args.max_num_seqs)]
    print(f"(a) state memory per cached token: tokens per block {args.tokens_per_block}; tokens held in "
          f"{args.budget / GiB:g} GiB with {args.max_num_seqs} running requests (2 state blocks each)")
    head = ("model", "interval", "KV B/token", "state block B", "state B/token", "total B/token", "state share",
            "tokens held")
    cells = [(r["model"], str(r["interval"]), f"{r['attn']:,.0f}", f"{r['block']:,}", f"{r['state']:,.1f}",
              f"{r['total']:,.1f}", f"{r['share']:.1%}", f"{r['tokens']:,}") for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for c in cells:
        print("  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)))
    return rows


# --------------------------------------------------------------------------- (b)
def conversations(users: int, turns: int, system: int, message: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """Per user, the new tokens of each turn: turn 0 starts with the shared system prompt."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(system)]
    return [[(shared if t == 0 else []) + [rng.randrange(vocab) for _ in range(message)] for t in range(turns)]
            for _ in range(users)]


def random_lfm2(hidden: int, seed: int):
    """A random-weight LFM2 of LFM2-350M's layout scaled to `hidden` (10 conv + 6 attention
    layers, 16 heads, 8 kv heads of hidden / 16, an MLP of 3 x hidden, vocab 4096), float32:
    big enough that prefill dominates a step on CPU."""
    from flax import nnx

    from kvjax.models.hybrid.lfm2 import Lfm2, Lfm2Spec

    kinds = ["conv", "conv", "full_attention"] * 5 + ["conv"]
    spec = Lfm2Spec(name=f"lfm2-random-{hidden}", vocab_size=4096, hidden_size=hidden, ffn_size=3 * hidden,
                    layer_types=tuple(kinds), num_attention_heads=16, num_kv_heads=8, head_dim=hidden // 16,
                    conv_kernel=3, conv_bias=False, norm_eps=1e-5, rope_theta=1e6, max_seq_len=2048)
    return Lfm2(spec, rngs=nnx.Rngs(params=seed))


def load(args):
    """The model of (b): `--random-lfm2 HIDDEN`, else the checkpoint `--model` in `--dtype`."""
    if args.random_lfm2:
        return random_lfm2(args.random_lfm2, args.seed)
    from kvjax.hybrid_capacity import hybrid_model_type
    from kvjax.models import from_pretrained

    if hybrid_model_type(args.model) is None:
        raise SystemExit(f"hybrid_bench (b): {args.model} is not a hybrid checkpoint")
    return from_pretrained(args.model, dtype=args.dtype)


def run_chat(model, reuse: bool, args, runner=None) -> dict:
    """The workload on a fresh `kvjax.LLM` of `model` (sharing `runner`'s compiled programs);
    every turn's requests of all users in one `generate`; greedy."""
    from kvjax import LLM, SamplingParams

    options = {k: _value(v) for k, v in (o.split("=", 1) for o in args.option)}
    llm = LLM(model, enable_block_reuse=reuse, runner=runner, **{**BENCH_OPTIONS, **options})
    traces = llm.llm_engine.engine.runner.num_traces
    vocab = model.spec.vocab_size
    convs = conversations(args.users, args.turns, args.system_tokens, args.message_tokens, vocab, args.seed)
    history: list[list[int]] = [[] for _ in convs]
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)
    prompt = cached = 0
    ttft: list[float] = []
    replies: list[list[int]] = []
    t0 = time.perf_counter()
    for t in range(args.turns):
        prompts = [{"prompt_token_ids": history[u] + convs[u][t]} for u in range(len(convs))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for u, out in enumerate(outs):
            prompt += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            m = out.metrics
            if m is not None and m.first_token_time is not None:
                ttft.append(m.first_token_time - m.arrival_time)
            replies.append(list(out.outputs[0].token_ids))
            history[u] = list(out.prompt_token_ids) + replies[-1]
    wall = time.perf_counter() - t0
    runner = llm.llm_engine.engine.runner
    return dict(compiled=runner.num_traces - traces,
                reuse=reuse, prompt=prompt, cached=cached, hit=cached / max(prompt, 1), computed=prompt - cached,
                ttft_ms=1e3 * statistics.mean(ttft) if ttft else float("nan"),
                ttft_p50_ms=1e3 * statistics.median(ttft) if ttft else float("nan"), wall_s=wall, replies=replies,
                runner=runner)


#: (b)'s engine: decode batches of 8, prefill groups of up to 4 chunks of 16 tokens (a chunk
#: ends at a snapshot point: every block here, the finest reuse), a 64-token step budget
BENCH_OPTIONS = dict(primary_blocks=512, max_batch_size=8, max_num_tokens=64, min_batch_bucket=8,
                     min_chunk_bucket=16, prefill_rows=4, snapshot_interval=16)


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def part_b(args) -> list[dict]:
    model = load(args)
    name = model.spec.name
    print(f"(b) multi-turn chat on {name}: {args.users} users x {args.turns} turns, system prompt "
          f"{args.system_tokens} tokens, messages {args.message_tokens}, replies {args.reply_tokens} (greedy)")
    warm = run_chat(model, True, args)  # compiles every step program the workload uses (not timed below)
    run_chat(model, False, args, warm["runner"])
    rows = [run_chat(model, reuse, args, warm["runner"]) for reuse in (True, False)]
    if rows[0]["replies"] != rows[1]["replies"]:
        raise SystemExit("hybrid_bench (b): greedy replies differ with prefix caching on and off")
    print(f"{'prefix caching':>14}  {'prompt tokens':>13}  {'hit rate':>8}  {'prefill computed':>16}  "
          f"{'TTFT mean ms':>12}  {'TTFT p50 ms':>11}  {'wall s':>7}")
    for r in rows:
        print(f"{'on' if r['reuse'] else 'off':>14}  {r['prompt']:>13,}  {r['hit']:>8.1%}  {r['computed']:>16,}  "
              f"{r['ttft_ms']:>12.1f}  {r['ttft_p50_ms']:>11.1f}  {r['wall_s']:>7.1f}")
    print("greedy replies identical with prefix caching on and off: yes; step programs compiled in the timed "
          f"passes: {rows[0]['compiled'] + rows[1]['compiled']}")
    return [{k: v for k, v in r.items() if k != "runner"} for r in rows]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["a", "b", "all"], default="all")
    p.add_argument("--quick", action="store_true", help="(a): Qwen3.5 and three fixtures; (b): 2 users x 3 turns")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--budget", type=float, default=80 * GiB, help="(a): bytes of cache the 'tokens held' column fills")
    p.add_argument("--max-num-seqs", type=int, default=64, help="(a): running requests (2 state blocks each)")
    p.add_argument("--model", default=str(FIXTURES / "qwen3_5"), help="(b): a hybrid checkpoint directory")
    p.add_argument("--dtype", default="float32", help="(b): the checkpoint's compute dtype (default float32)")
    p.add_argument("--random-lfm2", type=int, metavar="HIDDEN",
                   help="(b): a random-weight LFM2 of this width instead of --model (e.g. 512)")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=64)
    p.add_argument("--message-tokens", type=int, default=12)
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="(b): a kvjax.LLM option")
    a = p.parse_args(argv)
    if a.quick:
        a.users, a.turns = 2, 3
    out: dict = {}
    if a.part in ("a", "all"):
        out["a"] = part_a(a)
    if a.part in ("b", "all"):
        out["b"] = part_b(a)
    return out


if __name__ == "__main__":
    main()
