"""Dispatch cost of one engine step: the host time from calling the jitted step to its return
(the device may still be computing), old path against new, in one run.

    python benchmarks/dispatch_bench.py [--periods 1,6] [--repeats 200] [--batch 1]

The model is the micro decoder (width 64, vocab 512: its device time is negligible), with its
layers repeating every `P` layers (`--periods`): P = 1 is Llama-like (12 weight arrays, the
layers stacked), P = 6 is Gemma-3-like (five sliding-window layers and a global one, q/k norms
and sandwich norms: 6 stacks, 81 weight arrays; a real Gemma 3 checkpoint has a few hundred).

"before" is the engine's former call, rebuilt here: the nnx State passed as a pytree (flattened
on every call), eleven host arrays (tokens, positions, per-window tables and slot mappings,
sequence lengths, five sampling arrays) and the LM head on every position; a mixed step made
two such calls (decode [B, 1], then prefill [1, T]). "after" is `ModelRunner.dispatch`: the
weights as a list flattened once, three packed host arrays, one call per step for the decode
rows and the prefill chunk together, the LM head on the sampled positions only. Both are timed
on the same ledger state and model. Columns, milliseconds per step (best of `--repeats`):
`call->return` (the host batch built and the program dispatched; on a CPU a small program
runs inline, so this includes its compute), `then wait` (until the results are ready), `device
floor` (the same programs on inputs already on the device, passed as one flat list: the
device's work plus the least dispatch jit has) and `host overhead` = call->return + wait -
floor: what the engine's dispatch path costs beyond the device. Writes
`results/dispatch_bench.json`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvjax.engine import Engine, EngineConfig, SchedulerConfig, WorkItem  # noqa: E402
from kvjax.engine.batching import Buckets, Row, build_batch  # noqa: E402
from kvjax.engine.sampling import sample  # noqa: E402
from kvjax.model_catalog import load_model_spec  # noqa: E402
from kvjax.models import Transformer  # noqa: E402


def old_step(model):
    """The former runner's jitted step (nnx State in, full logits, sampling of the last position)."""
    graphdef, state = nnx.split(model)

    def step(state, tokens, positions, pools, tables, seq_lens, slots, temperature, top_p, top_k, seed, index):
        logits, pools = nnx.merge(graphdef, state).paged_forward(tokens, positions, pools, tables, seq_lens, slots)
        return sample(logits[:, -1, :], temperature, top_p, seed, index, top_k), pools

    return state, jax.jit(step, donate_argnums=(3,))


def device_floor(jitted, args: tuple, static: dict):
    """A call of `jitted`'s program on inputs already on the device, passed as one flat list
    (the cheapest dispatch jit has): its time is the device's work plus a floor of dispatch."""
    leaves, tree = jax.tree.flatten(args)
    dev = [jnp.copy(x) if isinstance(x, jax.Array) else jax.device_put(x) for x in leaves]  # own copies
    flat = jax.jit(lambda *xs: jitted(*jax.tree.unflatten(tree, xs), **static))
    return lambda: flat(*dev)


def timed(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """name -> (ms from call to return, ms waiting for the results after it), each the best of
    `repeats` rounds (as timeit: on a shared machine the minimum is the cost, the rest is other
    processes' noise), the functions called in turn each round so that noise hits them alike."""
    calls: dict[str, list[float]] = {k: [] for k in fns}
    waits: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            out = fn()
            t1 = time.perf_counter()
            jax.block_until_ready(out)
            t2 = time.perf_counter()
            calls[k].append(t1 - t0)
            waits[k].append(t2 - t1)
    return {k: (min(calls[k]) * 1e3, min(waits[k]) * 1e3) for k in fns}


def micro_model(period: int) -> Transformer:
    """The micro decoder with a layer period of `period` (see the module docstring)."""
    spec = load_model_spec("micro-swa")
    if period > 1:
        spec = dataclasses.replace(spec, name=f"micro-period{period}", num_layers=period, qk_norm=True,
                                   sandwich_norms=True, attention_windows=(32,) * (period - 1) + (1024,))
    else:
        spec = load_model_spec("micro")
    return Transformer.from_spec(spec, seed=0)


def measure(period: int, batch: int, repeats: int, chunk: int = 32) -> dict:
    model = micro_model(period)
    buckets = Buckets(min_batch=1, min_chunk=chunk, min_blocks=8, prefill_rows=1)
    engine = Engine(model, EngineConfig(SchedulerConfig(max_batch_size=batch + 1, max_num_tokens=chunk + batch + 1),
                                        buckets))
    cc = model.spec.cache_config(primary_blocks=16 * (batch + 2), tokens_per_block=16, max_seq_len=256)
    core = engine.core(cc)
    runner = engine.runner
    rng = np.random.default_rng(0)
    vocab = model.spec.vocab_size
    for i in range(batch):  # decoding requests
        core.add_request(WorkItem(f"d{i}", tuple(rng.integers(1, vocab, 20).tolist()), 100), seed=i)
    while any(r.phase.value != "generation" for r in core.running.values()) or not core.running:
        core.step()
    core.add_request(WorkItem("p", tuple(rng.integers(1, vocab, 200).tolist()), 4), seed=99)
    core.step()  # admits "p" and runs its first chunk with the decode rows
    led = core.ledger
    decode = [Row(r.request_id, [r.output[-1]], len(r.prompt) + len(r.output) - 1)
              for r in core.running.values() if r.request_id != "p"]
    p = core.running["p"]
    prefill = [Row("p", p.context[p.context_pos : p.context_pos + chunk], p.context_pos)]
    for r in decode:  # their next tokens' slots exist: the decode rows write where the next step will
        led.add_tokens([r.request_id], [0])
    decode = [Row(r.request_id, r.tokens, r.start + 1) for r in decode]
    n = len(decode)
    f32, i32 = np.float32, np.int32
    state, old = old_step(model)
    pools = {"p": core.pools}

    def old_args(rows, chunk_bucket):
        b = build_batch(led, rows, buckets, chunk_bucket=chunk_bucket)
        rows_b = b.tokens.shape[0]
        pad = np.zeros(rows_b, f32)
        return (state, b.tokens, b.positions, pools["p"], b.tables, b.seq_lens, b.slots, pad, pad + 1,
                np.zeros(rows_b, i32), np.zeros(rows_b, i32), np.zeros(rows_b, i32))

    def old_call(rows, chunk_bucket):
        args = old_args(rows, chunk_bucket)
        (tok, chosen, margin), pools["p"] = old(*args)
        return tok

    def new_args(drows, prows):
        batch_ = runner.batch(led, drows, prows, buckets)
        k = batch_.num_rows
        return (pools["p"], batch_, np.zeros(k, f32), np.ones(k, f32), np.zeros(k, i32), np.zeros(k, i32),
                np.zeros(k, i32))

    def new_call(drows, prows):
        pending, pools["p"] = runner.dispatch(*new_args(drows, prows))
        return pending.arrays()  # the device arrays, not waited for

    def new_floor(drows, prows):  # the runner's jitted program on device-resident inputs
        pools_, batch_, *sampling = new_args(drows, prows)
        arrays, static = runner.step_inputs(batch_, *sampling, None)
        return device_floor(runner.step_program, (runner.weights, pools_, *arrays), static)

    cases = {
        "decode step": (lambda: [old_call(decode, 1)], lambda: new_call(decode, [])),
        "mixed step": (lambda: [old_call(decode, 1), old_call(prefill, None)], lambda: new_call(decode, prefill)),
    }
    floors = {
        "decode step": ([device_floor(old, old_args(decode, 1), {})], [new_floor(decode, [])]),
        "mixed step": ([device_floor(old, old_args(decode, 1), {}), device_floor(old, old_args(prefill, None), {})],
                       [new_floor(decode, prefill)]),
    }
    out = {"model": model.spec.name, "period": period, "weight_arrays": len(jax.tree.leaves(nnx.split(model)[1])),
           "decode_rows": n, "chunk": chunk, "repeats": repeats}
    for name, (before, after) in cases.items():
        for f in (before, after):  # compile and warm
            jax.block_until_ready(f())
            jax.block_until_ready(f())
        fb, fa = floors[name]
        fns = {"before": before, "after": after, **{f"fb{i}": f for i, f in enumerate(fb)},
               **{f"fa{i}": f for i, f in enumerate(fa)}}
        for f in fb + fa:
            jax.block_until_ready(f())
        t = timed(fns, repeats)
        (b_call, b_wait), (a_call, a_wait) = t["before"], t["after"]
        b_floor = sum(sum(t[f"fb{i}"]) for i in range(len(fb)))
        a_floor = sum(sum(t[f"fa{i}"]) for i in range(len(fa)))
        out[name] = {"before_forwards": len(fb), "before_dispatch_ms": b_call, "before_device_ms": b_wait,
                     "before_floor_ms": b_floor, "before_host_ms": b_call + b_wait - b_floor,
                     "after_forwards": 1, "after_dispatch_ms": a_call, "after_device_ms": a_wait,
                     "after_floor_ms": a_floor, "after_host_ms": a_call + a_wait - a_floor}
    # the pieces of the new dispatch: the host batch alone, and the jitted call alone
    out["build_step_ms"] = timed({"b": lambda: runner.batch(led, decode, prefill, buckets).rows}, repeats)["b"][0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--periods", default="1,6", help="layer periods of the micro model to measure (default 1,6)")
    ap.add_argument("--batch", type=int, default=1, help="decode rows (default 1)")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="results/dispatch_bench.json")
    args = ap.parse_args()
    rows = []
    for period in (int(p) for p in args.periods.split(",")):
        r = measure(period, args.batch, args.repeats)
        rows.append(r)
        print(f"model {r['model']} ({r['weight_arrays']} weight arrays), {r['decode_rows']} decode row(s), prefill "
              f"chunk {r['chunk']} tokens, best of {r['repeats']}; ms per step (host batch build included)")
        print(f"  {'step':<12} {'':>7} {'forwards':>9} {'call->return':>13} {'then wait':>10} {'device floor':>13} "
              f"{'host overhead':>14}")
        for name in ("decode step", "mixed step"):
            c = r[name]
            for when in ("before", "after"):
                print(f"  {name:<12} {when:>7} {c[when + '_forwards']:>9} {c[when + '_dispatch_ms']:>13.3f} "
                      f"{c[when + '_device_ms']:>10.3f} {c[when + '_floor_ms']:>13.3f} {c[when + '_host_ms']:>14.3f}")
        print(f"  of which build_step (the mixed step's host arrays): {r['build_step_ms']:.3f} ms", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
