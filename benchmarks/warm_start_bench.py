"""A cold start against a warm one: the same `--warmup` in two fresh processes sharing one
persistent compilation cache directory (empty before the first).

    python benchmarks/warm_start_bench.py [--layers 30] [--warmup common] [--max-batch-size 8]

Each process builds a SmolLM2-135M-shaped Llama model (random weights; `--layers` shrinks it),
an `LLM` with `warmup=LEVEL` (the step programs a serving run would compile first, see
`kvjax.engine.warmup`), then serves one greedy request. It prints the warmup's seconds, the
programs it traced, how many of them XLA compiled (cache misses) or read from the cache (hits),
and the second process's warmup time over the first's: the target is <= 25% (`kvjax serve`
and `LLM` compile once per machine).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import json, sys, time
import jax
counts = {"hits": 0, "misses": 0}
names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
def count(event, *args, **kwargs):
    if event in names:
        counts[names[event]] += 1
jax.monitoring.register_event_listener(count)
from kvjax import LLM, SamplingParams
from kvjax.model_spec import ModelSpec
from kvjax.models import Transformer
layers, level, batch = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
spec = ModelSpec(name="smollm2-135m-shaped", num_layers=layers, num_attention_heads=9, num_kv_heads=3, head_dim=64,
                 hidden_size=576, intermediate_size=1536, vocab_size=49152, max_seq_len=2048, dtype="float32")
model = Transformer.from_spec(spec, seed=0)
start = time.perf_counter()
llm = LLM(model, warmup=level, max_batch_size=batch, max_num_tokens=256, primary_blocks=256, tokens_per_block=16,
          max_seq_len=1024)
built = time.perf_counter() - start
t0 = time.perf_counter()
out = llm.generate({"prompt_token_ids": list(range(10, 110))}, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
first = time.perf_counter() - t0
print(json.dumps({"warmup_s": llm.warmup.seconds, "programs": llm.warmup.traced, "shapes": llm.warmup.shapes,
                  "build_s": built, "first_request_s": first, "tokens": list(out[0].outputs[0].token_ids), **counts}))
"""


def run(cache_dir: str, args) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "KVJAX_COMPILATION_CACHE_DIR": cache_dir}
    env.pop("KVJAX_COMPILATION_CACHE", None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.layers), args.warmup, str(args.max_batch_size)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--warmup", choices=["common", "all"], default="common")
    ap.add_argument("--max-batch-size", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir:
        cold, warm = run(cache_dir, args), run(cache_dir, args)
    assert cold["tokens"] == warm["tokens"], "the warm process served other tokens"
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"{name}: warmup {r['warmup_s']:7.2f} s for {r['programs']} programs ({r['shapes']} shapes; "
              f"{r['misses']} compiled, {r['hits']} from the cache), first request {r['first_request_s']:.2f} s")
    print(f"warm / cold warmup time: {warm['warmup_s'] / cold['warmup_s']:.2f}  (target <= 0.25)")


if __name__ == "__main__":
    main()
