"""FP8 KV accuracy: attention outputs and greedy generations with FP8 (e4m3) pools against
bfloat16 pools (and bfloat16 against float32, for scale), on the built-in `tiny` model.

    python benchmarks/fp8_accuracy.py [--prompts 64] [--new-tokens 32] [--out results/fp8_accuracy.json]

Figures:
  attention   relative error of paged_attention over random K/V: max |o_fp8 - o_bf16| /
              max |o_bf16|, and the RMS of (o_fp8 - o_bf16) over the RMS of o_bf16
  greedy      free-running greedy decoding from random prompts:
                exact    fraction of prompts whose continuations are identical
                prefix   mean fraction of each continuation before the first differing token
              teacher-forced: the FP8 run is fed the reference's tokens, and
                agree    fraction of positions whose argmax equals the reference's token
The driver (`greedy_paged`) runs the paged forward step by step with `kvjax.device.step_inputs`
(one prefill chunk per prompt, then decode steps) over shuffled block tables.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvjax import CacheConfig  # noqa: E402
from kvjax.device import allocate_pools, bucket, paged_attention, step_inputs, write_kv  # noqa: E402
from kvjax.models import Transformer, jit_paged_forward  # noqa: E402


def random_prompts(n: int, vocab: int, seed: int, lengths=(8, 48)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(*lengths))).tolist() for _ in range(n)]


def greedy_paged(model, cache_dtype: str, prompts, max_new: int, *, tokens_per_block: int = 16, prefill_chunk=None,
                 forced=None, fwd=None, seed: int = 0):
    """Greedy continuations of `prompts` through the paged cache with `cache_dtype` pools.

    `prefill_chunk`: prompt tokens a row feeds per step (None: the whole prompt at once; 1:
    token by token, so prefill runs the decode shape and writes blocks one token at a time).
    With `forced` (one token list per prompt, >= max_new long) the next input is the forced
    token instead of the argmax (teacher forcing); the argmaxes are returned either way.
    """
    spec = model.spec
    tpb = tokens_per_block
    n = len(prompts)
    longest = max(len(p) for p in prompts) + max_new
    per_request = -(-longest // tpb)
    config = spec.cache_config(primary_blocks=n * per_request, tokens_per_block=tpb, max_seq_len=bucket(longest),
                               dtype=cache_dtype)
    pools = allocate_pools(config)
    slots = np.random.default_rng(seed).permutation(n * per_request).astype(np.int32)
    table = slots.reshape(n, per_request)  # shuffled blocks: paging is exercised
    fwd = fwd or jit_paged_forward(model)
    seq = np.zeros(n, np.int32)
    pending = [list(p) for p in prompts]  # per row: tokens still to feed
    out = [[] for _ in prompts]
    while any(len(o) < max_new for o in out):
        feed = []
        for r in range(n):
            take = (
                0 if len(out[r]) >= max_new else len(pending[r]) if prefill_chunk is None else min(prefill_chunk, len(pending[r]))
            )
            feed.append(pending[r][:take])
            pending[r] = pending[r][take:]
        chunk = np.array([len(f) for f in feed], np.int32)
        seq = seq + chunk
        s = step_inputs(config, table, seq, chunk, q_len=bucket(int(chunk.max())), max_blocks=bucket(per_request))
        b, t, _ = s.shape
        tokens = np.zeros((b, t), np.int32)
        for r, toks in enumerate(feed):
            tokens[r, t - len(toks):] = toks
        logits, pools = fwd(jnp.asarray(tokens), jnp.asarray(s.positions), pools, jnp.asarray(s.block_table),
                            jnp.asarray(s.seq_lens), jnp.asarray(s.slots))
        nxt = np.asarray(jnp.argmax(logits[:n, -1], axis=-1))  # [n]
        for r in range(n):
            if chunk[r] and not pending[r] and len(out[r]) < max_new:  # the row's last fed token predicts
                out[r].append(int(nxt[r]))
                pending[r] = [forced[r][len(out[r]) - 1] if forced is not None else int(nxt[r])]
    return out


def token_agreement(a, b) -> dict:
    exact = float(np.mean([x == y for x, y in zip(a, b, strict=True)]))
    prefix = []
    for x, y in zip(a, b, strict=True):
        same = next((i for i, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), len(x))
        prefix.append(same / len(x))
    return {"exact": exact, "prefix": float(np.mean(prefix))}


def forced_agreement(pred, ref) -> float:
    return float(np.mean([p == r for ps, rs in zip(pred, ref, strict=True) for p, r in zip(ps, rs, strict=True)]))


def attention_error(seed: int = 0, *, batch: int = 8, blocks: int = 16, tpb: int = 16, kv_heads: int = 2, heads: int = 8,
                    head_dim: int = 64, q_len: int = 1, dtypes=("float32", "bfloat16", "float8_e4m3fn")) -> dict:
    """paged_attention with FP8 vs bfloat16 pools holding the same K/V (unit normal, with
    per-head magnitudes spread over 16x and a few 8-sigma outliers, like real keys)."""
    rng = np.random.default_rng(seed)
    n = batch * blocks * tpb
    head_scale = 2.0 ** rng.uniform(-2, 2, (1, kv_heads, 1))
    k = rng.standard_normal((n, kv_heads, head_dim)) * head_scale
    v = rng.standard_normal((n, kv_heads, head_dim)) * head_scale
    k[rng.random(k.shape) < 1e-3] *= 8
    q = jnp.asarray(rng.standard_normal((batch, q_len, heads, head_dim)), jnp.float32)
    table = rng.permutation(batch * blocks).astype(np.int32).reshape(batch, blocks)
    lens = rng.integers(blocks * tpb // 2, blocks * tpb + 1, batch).astype(np.int32)
    sm = (table[:, :, None] * tpb + np.arange(tpb)).reshape(-1).astype(np.int32)  # every position of every block
    order = np.argsort(sm)
    outs = {}
    for dtype in dtypes:
        cfg = CacheConfig(tokens_per_block=tpb, num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim,
                          max_seq_len=blocks * tpb, primary_blocks=batch * blocks, dtype=dtype)
        pools = allocate_pools(cfg)
        # blocks written a chunk of 4 tokens at a time, in position order (how a serving loop fills them)
        for c in range(0, tpb, 4):
            sel = order.reshape(-1, tpb)[:, c:c + 4].reshape(-1)
            pools = write_kv(pools, 0, jnp.asarray(k[sel], jnp.float32), jnp.asarray(v[sel], jnp.float32), sm[sel])
        outs[dtype] = np.asarray(paged_attention(q, pools, 0, table, lens), np.float64)
    res = {}
    pairs = {"float8_vs_bfloat16": ("float8_e4m3fn", "bfloat16"), "bfloat16_vs_float32": ("bfloat16", "float32"),
             "float8_vs_float32": ("float8_e4m3fn", "float32")}
    for name, (test, ref) in pairs.items():
        if test not in outs or ref not in outs:
            continue
        got = outs[test]
        d = got - outs[ref]
        res[name] = {"max_rel": float(np.abs(d).max() / np.abs(outs[ref]).max()),
                     "rms_rel": float(np.sqrt((d ** 2).mean() / (outs[ref] ** 2).mean()))}
    return res


def greedy_figures(model, prompts, max_new: int) -> dict:
    fwd = jit_paged_forward(model)
    runs = {d: greedy_paged(model, d, prompts, max_new, fwd=fwd) for d in ("float32", "bfloat16", "float8_e4m3fn")}
    forced = greedy_paged(model, "float8_e4m3fn", prompts, max_new, forced=runs["bfloat16"], fwd=fwd)
    forced_bf16 = greedy_paged(model, "bfloat16", prompts, max_new, forced=runs["float32"], fwd=fwd)
    return {
        "float8_vs_bfloat16": {**token_agreement(runs["float8_e4m3fn"], runs["bfloat16"]),
                               "forced_agree": forced_agreement(forced, runs["bfloat16"])},
        "bfloat16_vs_float32": {**token_agreement(runs["bfloat16"], runs["float32"]),
                                "forced_agree": forced_agreement(forced_bf16, runs["float32"])},
        "prompts": len(prompts),
        "new_tokens": max_new,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny", help="catalog model of the greedy figures (gpu_check's dry run: micro)")
    ap.add_argument("--out", default="results/fp8_accuracy.json")
    args = ap.parse_args()
    res = {"jax": jax.__version__, "backend": jax.default_backend()}
    res["attention"] = {f"q_len={ql}": attention_error(args.seed, q_len=ql) for ql in (1, 8)}
    for ql, r in res["attention"].items():
        for name, e in r.items():
            print(f"attention {ql:8s} {name:20s} max rel {e['max_rel']:.4f}  rms rel {e['rms_rel']:.4f}")
    model = Transformer.from_spec(args.model, seed=0)
    prompts = random_prompts(args.prompts, model.spec.vocab_size, args.seed)
    res["greedy"] = greedy_figures(model, prompts, args.new_tokens)
    for name in ("float8_vs_bfloat16", "bfloat16_vs_float32"):
        g = res["greedy"][name]
        print(f"greedy {name:20s} identical continuations {g['exact']:.3f}  prefix before first difference "
              f"{g['prefix']:.3f}  teacher-forced token agreement {g['forced_agree']:.4f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
