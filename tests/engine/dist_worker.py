"""One rank of the multi-process engine tests (`test_distributed.py` launches it; not a test).

    python dist_worker.py --process-id I --num-processes N --port P --out FILE [--diverge] [--primary-blocks B]

Every process builds the same seeded model (8 query / 8 KV heads, so both processes hold
heads), an `Engine` on a mesh of all processes' CPU devices (gloo collectives), and serves
the same work items, writing the outputs. With `--diverge` it then starts a fresh core on the
same engine (compiled executables reused), corrupts process 1's ledger after a few steps and
records the error every rank must raise. With `--num-processes 1 --no-mesh` it is the
single-process reference.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback


def items():
    from kvjax.engine import SamplingParams, WorkItem

    system = tuple((9 * i) % 400 + 1 for i in range(40))
    out = [WorkItem(f"r{i}", system[: 24 + 4 * i] + tuple(100 + 7 * i + j for j in range(3 + i)), 6 + i % 3,
                    arrival_step=i) for i in range(5)]
    # a sampled request too: the same seeded draws on every rank
    out.append(WorkItem("s", system[:30] + (5, 6), 6, arrival_step=2, sampling=SamplingParams(temperature=0.8, seed=11)))
    # a follow-up turn reusing its parent's conversation
    out.append(WorkItem("r0.1", (300, 301, 302), 5, arrival_step=1, parent="r0"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--diverge", action="store_true")
    ap.add_argument("--primary-blocks", type=int, default=64)
    ap.add_argument("--no-mesh", action="store_true")
    a = ap.parse_args()

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if a.num_processes > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}", num_processes=a.num_processes,
                                   process_id=a.process_id, initialization_timeout=120)
    from flax import nnx

    from kvjax.engine import Engine, EngineConfig, RankDivergenceError, cache_config
    from kvjax.model_catalog import load_model_spec
    from kvjax.models import Transformer

    spec = dataclasses.replace(load_model_spec("micro"), name="micro-mha8", num_attention_heads=8, num_kv_heads=8, head_dim=8)
    model = Transformer(spec, rngs=nnx.Rngs(params=0))
    mesh = None
    if not a.no_mesh:
        mesh = jax.make_mesh((jax.device_count(),), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    config = EngineConfig.from_dict({"max_batch_size": 4, "max_num_tokens": 64, "min_batch_bucket": 4,
                                     "min_chunk_bucket": 64, "min_blocks_bucket": 16, "prefill_rows": 1})
    cc = cache_config(spec, {"tokens_per_block": 8, "max_seq_len": 128, "primary_blocks": a.primary_blocks},
                      max_num_tokens=64)
    engine = Engine(model, config, mesh=mesh)
    result: dict = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
                    "local_devices": jax.local_device_count()}
    run = engine.run(items(), cc)
    ledger = run.ledger
    result.update(outputs=run.outputs, logits=run.chosen_logits,
                  primary_blocks=ledger.config.primary_blocks_for(ledger.windows[0]),
                  reused=run.metrics.summary()["prefill_reused_tokens"], copied=run.metrics.summary()["blocks_copied"])
    if mesh is not None:
        wq = model.blocks[0].attn.wq[...]
        result["wq_spec"] = str(wq.sharding.spec)
        result["wq_local_shape"] = list(wq.addressable_shards[0].data.shape)
        result["checks"] = run.metrics.summary()["steps"]
    if a.diverge:
        from kvjax import Request

        core = engine.core(cc)
        for it in items()[:4]:
            core.add_request(it, seed=0)
        steps = 0
        try:
            while core.has_unfinished_requests():
                if steps == 3 and jax.process_index() == 1:  # a rank that does something the others do not
                    core.ledger.add_sequence(Request("rogue", list(range(1, 20)), max_new_tokens=1))
                core.step()
                steps += 1
            result["error"] = None
        except RankDivergenceError as e:
            result["error"] = str(e)
        result["diverge_steps"] = steps
        result["diverge_checks"] = core.rank_digest.checks
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # never hang in jax.distributed's shutdown after a failure
