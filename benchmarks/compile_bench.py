"""Compile time of the model's programs by depth: a deep and a shallow model of the same width.

    python benchmarks/compile_bench.py [--layers 2 32] [--hidden 512] [--unroll]

For each depth it lowers and compiles `paged_forward` at a decode shape (batch 8, one token,
a 64-block table) and a prefill shape (one row of 512 tokens), from abstract weights and pools
(nothing is allocated), with the persistent compilation cache off, and prints the seconds and
the deep/shallow ratio. `--unroll` compiles the per-layer loop (`unroll=True`) instead: the
cost the scan removes.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.device import allocate_pools
from kvjax.model_spec import ModelSpec
from kvjax.models import Transformer
from kvjax.models.layers import shapes_only

TPB = 16
SHAPES = {"decode": (8, 1, 64), "prefill": (1, 512, 32)}  # batch, q_len, table width in blocks


def compile_seconds(spec: ModelSpec, shape: str, unroll: bool) -> float:
    with shapes_only():
        model = nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(params=0)))
    graphdef, state = nnx.split(model)
    batch, q_len, width = SHAPES[shape]
    config = spec.cache_config(primary_blocks=batch * width, tokens_per_block=TPB, max_seq_len=width * TPB)
    pools = jax.eval_shape(lambda: allocate_pools(config))
    i32 = jnp.int32
    args = (jax.ShapeDtypeStruct((batch, q_len), i32), jax.ShapeDtypeStruct((batch, q_len), i32), pools,
            jax.ShapeDtypeStruct((batch, width), i32), jax.ShapeDtypeStruct((batch,), i32),
            jax.ShapeDtypeStruct((batch * q_len,), i32))

    def run(state, *a):
        return nnx.merge(graphdef, state).paged_forward(*a, impl="xla", unroll=unroll)

    start = time.perf_counter()
    jax.jit(run, donate_argnums=(3,)).lower(state, *args).compile()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs=2, default=(2, 32), metavar=("SHALLOW", "DEEP"))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--unroll", action="store_true", help="compile the per-layer Python loop instead of the scan")
    args = ap.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)  # measure compilation, not cache reads
    d = args.hidden
    base = ModelSpec(name="bench", num_layers=1, num_attention_heads=d // 64, num_kv_heads=max(1, d // 256), head_dim=64,
                     hidden_size=d, intermediate_size=3 * d, vocab_size=8192, max_seq_len=4096, dtype="bfloat16")
    mode = "unrolled" if args.unroll else "scanned"
    for shape in SHAPES:
        secs = {}
        for layers in args.layers:
            spec = dataclasses.replace(base, num_layers=layers)
            compile_seconds(spec, shape, args.unroll) if layers == args.layers[0] and shape == "decode" else None  # warm-up
            secs[layers] = compile_seconds(spec, shape, args.unroll)
        shallow, deep = args.layers
        print(f"{mode} {shape} {SHAPES[shape]}: {shallow} layers {secs[shallow]:.2f} s, {deep} layers {secs[deep]:.2f} s, "
              f"ratio {secs[deep] / secs[shallow]:.2f}")


if __name__ == "__main__":
    main()
