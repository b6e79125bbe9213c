"""The rows of `benchmarks/gpu_check.sh`, one process per row so a crash or hang ends one row only.

    python benchmarks/gpu_check_rows.py ROW [--dry-run] [--out DIR]

ROW is one of `env`, `kernels`, `scan`, `copy`, `throughput`. Inside a row every sub-check runs
on its own: any exception (a Mosaic compile error, an out-of-memory, a wrong result) is printed
and recorded, and the next sub-check runs. The row's last line is `ROW <name>: ok (N checks)` or
`ROW <name>: FAILED k/N (names)`, and its exit status is 0 or 1. `--dry-run` uses tiny shapes
and the `micro` model, so the whole script can be exercised on any CPU (CI runs it).

Needs only JAX, numpy and kvjax's own imports for the device and the model (no venv, no
package index: a GPU host's preinstalled JAX with kvjax on PYTHONPATH is enough).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

#: Rated peak memory bandwidth (bytes/s) by device kind substring: what "fraction of peak" divides by.
RATED_PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "GH200": 4.0e12}


def rated_peak(device_kind: str) -> float | None:
    """The rated memory bandwidth of a device kind, or None where kvjax knows none (CPUs)."""
    for name, peak in sorted(RATED_PEAK_BYTES_PER_S.items(), key=lambda kv: -len(kv[0])):
        if name in device_kind:
            return peak
    return None


class Row:
    """Sub-checks of one row: each is isolated, failures are collected, figures are kept for the JSON."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.checks: list[str] = []
        self.failed: list[str] = []
        self.figures: dict[str, object] = {}

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[None]:
        self.checks.append(name)
        t0 = time.perf_counter()
        try:
            yield
            print(f"  {name}: done in {time.perf_counter() - t0:.1f} s", flush=True)  # sizes the row's timeouts
        except Exception as e:  # noqa: BLE001 - every failure is recorded and the row goes on
            self.failed.append(name)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            print(f"  {name}: FAILED {type(e).__name__}: {first} ({time.perf_counter() - t0:.1f} s)", flush=True)
            traceback.print_exc(limit=3, file=sys.stdout)

    def expect(self, name: str, ok: bool, detail: str) -> None:
        """A check whose failure is a wrong result rather than an exception."""
        print(f"  {name}: {detail} ok={ok}", flush=True)
        if not ok:
            self.failed.append(name)

    def finish(self, out_dir: str | None) -> int:
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, f"row_{self.name}.json"), "w") as f:
                json.dump({"row": self.name, "checks": self.checks, "failed": self.failed, "figures": self.figures}, f,
                          indent=1, default=str)
        if self.failed:
            print(f"ROW {self.name}: FAILED {len(self.failed)}/{len(self.checks)} ({', '.join(self.failed)})", flush=True)
            return 1
        print(f"ROW {self.name}: ok ({len(self.checks)} checks)", flush=True)
        return 0


# ---------------------------------------------------------------------------------------- rows
def row_env(row: Row, dry: bool) -> None:
    import jax
    import jax.numpy as jnp

    with row.check("devices"):
        d = jax.devices()[0]
        print("  python", sys.version.split()[0], "| jax", jax.__version__, "| backend", jax.default_backend(), "|",
              d.device_kind, "| rated peak", rated_peak(d.device_kind))
        row.figures.update(jax=jax.__version__, backend=jax.default_backend(), device=d.device_kind)
        print("  memories:", [m.kind for m in d.addressable_memories()])
    with row.check("kernel choice"):
        from kvjax.device import backend

        print("  compute capability:", backend.compute_capability())
        for dt in ("bfloat16", "float8_e4m3fn", "float32"):
            print(f"  auto paged_attention, {dt}, head_dim 128, 16-token pages ->",
                  backend.resolve("auto", "paged_attention", dtype=jnp.dtype(dt), head_dim=128, tokens_per_block=16))
    with row.check("optional imports"):
        missing = []
        for mod in ("flax", "chex", "jaxtyping", "msgspec", "zmq", "starlette", "uvicorn", "hypothesis", "tokenizers"):
            try:
                __import__(mod)
            except ImportError:
                missing.append(mod)
        print("  missing (rows that need them are skipped or fail alone):", missing or "none")


def row_kernels(row: Row, dry: bool) -> None:
    """Native kernels vs their references at serving-sized shapes, 16-bit and FP8 pools."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax import CacheConfig, TransferKind, TransferPlan
    from kvjax.device import (
        allocate_pools,
        apply_transfers,
        apply_transfers_reference,
        gather_kv,
        gather_kv_reference,
        paged_attention,
        paged_attention_reference,
        write_kv,
        write_kv_reference,
    )

    gpu = jax.default_backend() == "gpu" and not dry
    rng = np.random.default_rng(0)
    gref = jax.jit(gather_kv_reference, static_argnums=1)
    aref = jax.jit(paged_attention_reference, static_argnums=2)

    def same(a, b) -> bool:
        return all(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)) for x, y in zip(a, b, strict=True))

    def arrays(q) -> list:
        return [np.array(jnp.copy(a)) for a in (*q.primary, *q.secondary, *q.primary_scales, *q.secondary_scales)
                if a is not None]

    impls = ("xla", "pallas") if not dry else ("xla",)
    combos = [(d, lay) for d in ("bfloat16", "float8_e4m3fn") for lay in ("block_first", "layer_first")]
    if dry:  # one combination per dtype and per layout keeps the dry run short
        combos = [("bfloat16", "block_first"), ("float8_e4m3fn", "layer_first")]
    for dtype, layout in combos:
        tag = f"{dtype[:8]} {layout}"
        with row.check(f"{tag} pools"):
            cfg = CacheConfig(tokens_per_block=16, num_layers=2, num_kv_heads=8, head_dim=128, max_seq_len=4096,
                              primary_blocks=2048 if gpu else 32, secondary_blocks=256 if gpu else 16, dtype=dtype,
                              layout=layout)
            p = allocate_pools(cfg)
            pool = cfg.pools[0]
            sm = np.arange(pool.primary_blocks * 16, dtype=np.int32)
            for layer in range(2):
                x = jax.random.normal(jax.random.key(layer), (sm.size, 8, 128), jnp.float32)
                p = write_kv(p, layer, x, -x, sm, impl="xla")
            b, m = (32, 64) if gpu else (2, 8)
            table = jnp.asarray(rng.permutation(pool.primary_blocks)[: b * m].reshape(b, m).astype(np.int32))
            lens = jnp.asarray(rng.integers(1, m * 16, b).astype(np.int32))
        if row.failed and row.failed[-1] == f"{tag} pools":
            continue
        for impl in impls:
            with row.check(f"{tag} {impl} gather"):
                k, v = gather_kv(p, 1, table, lens, impl=impl)
                row.expect(f"{tag} {impl} gather exact", same((k, v), gref(p, 1, table, lens)), "vs reference")
            for ql, hq in ((1, 32), (4, 16)) if not dry else ((4, 16),):  # a dry run: the script's path once
                if impl == "pallas" and dtype != "bfloat16":
                    continue  # FP8 attention has no Mosaic kernel: it runs the XLA path
                with row.check(f"{tag} {impl} attention q_len={ql}"):
                    q = jax.random.normal(jax.random.key(ql), (b, ql, hq, 128), jnp.bfloat16)
                    o = paged_attention(q, p, 1, table, lens, impl=impl)
                    err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - aref(q, p, 1, table, lens).astype(jnp.float32))))
                    row.expect(f"{tag} {impl} attention q_len={ql} close", err < 3e-2, f"max|err|={err:.3e}")
            if impl == "xla" and dtype != "bfloat16" and (dry or layout == "block_first"):  # FP8's GPU path
                with row.check(f"{tag} xla attention step budget"):  # 64 MiB: one step at the GPU shapes
                    xla_step_budget_sweep(row, tag, p, table, lens, (1 << 10, 1 << 20) if dry else
                                          (4 << 20, 16 << 20, 64 << 20))
            with row.check(f"{tag} {impl} write"):
                n = 64 if gpu else 8
                w = jnp.asarray(rng.choice(pool.primary_blocks * 16, n, replace=False).astype(np.int32))
                kn = jax.random.normal(jax.random.key(2), (n, 8, 128), jnp.bfloat16) * 4
                want = arrays(write_kv_reference(p, 0, kn, kn, w))
                p = write_kv(p, 0, kn, kn, w, impl=impl)
                row.expect(f"{tag} {impl} write exact", all(np.array_equal(a, c) for a, c in zip(arrays(p), want,
                                                                                                 strict=True)), "vs reference")
            kind = TransferKind
            plan = TransferPlan.from_ops([(kind.OFFLOAD, 0, 3, 1, 16), (kind.COPY, 0, 5, 3, 7), (kind.ONBOARD, 0, 1, 9, 16),
                                          (kind.COPY, 0, 9, 10, 16)])
            for strategy in ("blockwise", "bulk") + (("sequential",) if impl == "xla" else ()):
                with row.check(f"{tag} {impl} transfers {strategy}"):
                    want = arrays(apply_transfers_reference(p, plan))  # from the current state: plans are not idempotent
                    p = apply_transfers(p, plan, impl=impl, strategy=strategy)
                    row.expect(f"{tag} {impl} transfers {strategy} exact",
                               all(np.array_equal(a, c) for a, c in zip(arrays(p), want, strict=True)), "vs reference")


def xla_step_budget_sweep(row: Row, tag: str, pools, table, lens, budgets: tuple[int, ...]) -> None:
    """Decode attention on the XLA path (what FP8 pools run on a GPU) timed per step budget
    (`attention.CHUNK_BYTES[_ACCELERATOR]`, bytes of one field's pages per loop step): the
    figures that should set `CHUNK_BYTES_ACCELERATOR`, a guess until a GPU run measures it."""
    import jax
    import jax.numpy as jnp

    from kvjax.device import attention, paged_attention

    q = jax.random.normal(jax.random.key(5), (table.shape[0], 1, 32, 128), jnp.bfloat16)
    saved = attention.CHUNK_BYTES, attention.CHUNK_BYTES_ACCELERATOR
    times = {}
    try:
        for budget in budgets:
            attention.CHUNK_BYTES = attention.CHUNK_BYTES_ACCELERATOR = budget
            times[budget] = _timed(lambda: paged_attention(q, pools, 1, table, lens, impl="xla").block_until_ready(), 5)
    finally:
        attention.CHUNK_BYTES, attention.CHUNK_BYTES_ACCELERATOR = saved
    row.figures[f"{tag} xla attention s by step budget"] = times
    print(f"  {tag} xla decode attention by step budget: "
          + ", ".join(f"{b >> 10} KiB {t * 1e3:.2f} ms" for b, t in times.items())
          + f" (now {saved[0] >> 10} KiB on CPU, {saved[1] >> 10} KiB on accelerators)", flush=True)


def row_scan(row: Row, dry: bool) -> None:
    """A decode step through 4 layers scanned over a traced layer index vs unrolled (impl auto)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax import CacheConfig
    from kvjax.device import allocate_pools, paged_attention, write_kv

    gpu = jax.default_backend() == "gpu" and not dry
    rng = np.random.default_rng(0)
    with row.check("scanned vs unrolled decode step"):
        cfg = CacheConfig(tokens_per_block=16, num_layers=4, num_kv_heads=8, head_dim=128, max_seq_len=4096,
                          primary_blocks=1024 if gpu else 32, dtype="bfloat16")
        b, m = (16, 32) if gpu else (2, 4)
        table = jnp.asarray(rng.permutation(cfg.pools[0].primary_blocks)[: b * m].reshape(b, m).astype(np.int32))
        lens = jnp.full((b,), m * 16, jnp.int32)
        slots = table[:, -1] * 16 + 15
        k = jax.random.normal(jax.random.key(3), (4, b, 8, 128), jnp.bfloat16)
        qd = jax.random.normal(jax.random.key(4), (4, b, 1, 32, 128), jnp.bfloat16)

        def layer(p, i, k_l, q_l):
            p = write_kv(p, i, k_l, k_l, slots)
            return p, paged_attention(q_l, p, i, table, lens)

        def unrolled(p):
            outs = []
            for i in range(4):
                p, o = layer(p, i, k[i], qd[i])
                outs.append(o)
            return p, jnp.stack(outs)

        def scanned(p):
            return jax.lax.scan(lambda p, xs: layer(p, *xs), p, (jnp.arange(4, dtype=jnp.int32), k, qd))

        pu, ou = jax.jit(unrolled, donate_argnums=0)(allocate_pools(cfg))
        ps, os_ = jax.jit(scanned, donate_argnums=0)(allocate_pools(cfg))
        err = float(jnp.max(jnp.abs(ou.astype(jnp.float32) - os_.astype(jnp.float32))))
        pools_equal = all(np.array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))
                          for a, c in zip(pu.primary, ps.primary, strict=True))
        row.expect("scan matches unrolled", err < 1e-2 and pools_equal, f"max|err|={err:.3e} pools equal={pools_equal}")


def _timed(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def row_copy(row: Row, dry: bool) -> None:
    """Streaming bandwidth of a donated elementwise pass, as a fraction of the rated peak."""
    import jax
    import jax.numpy as jnp

    with row.check("streaming bandwidth"):
        n = (1 << 28) if (jax.default_backend() == "gpu" and not dry) else (1 << 20)  # bf16 elements: 512 MiB / 2 MiB
        step = jax.jit(lambda x: x + 1, donate_argnums=0)
        state = {"x": jnp.zeros((n,), jnp.bfloat16)}

        def run() -> None:
            state["x"] = step(state["x"])
            state["x"].block_until_ready()

        t = _timed(run, 5)
        rate = 2 * n * 2 / t  # read + write
        peak = rated_peak(jax.devices()[0].device_kind)
        frac = None if peak is None else rate / peak
        row.figures.update(stream_bytes_per_s=rate, fraction_of_peak=frac)
        print(f"  x+1 over {n * 2 / 2**20:.0f} MiB: {rate / 1e9:.1f} GB/s"
              + ("" if frac is None else f" = {frac:.0%} of the rated {peak / 1e12:.2f} TB/s"), flush=True)


def row_throughput(row: Row, dry: bool) -> None:
    """End-to-end decode tokens/s of a random-weight model through kvjax's engine, per impl and batch."""
    import jax
    import numpy as np

    from kvjax.engine import Engine, EngineConfig, LLMEngine, SamplingParams
    from kvjax.engine.config import cache_config
    from kvjax.model_catalog import load_model_spec
    from kvjax.models import Transformer

    gpu = jax.default_backend() == "gpu" and not dry
    name, batches, prompt_len, new_tokens = (("llama-3.1-8b", (1, 64), 128, 64) if gpu else
                                             ("micro" if dry else "tiny", (2,), 16, 8))
    impls = ("xla", "auto") if gpu else ("xla",)
    peak = rated_peak(jax.devices()[0].device_kind)
    model = None
    with row.check(f"build {name}"):
        spec = load_model_spec(name)
        t0 = time.perf_counter()
        model = Transformer.from_spec(spec, seed=0)
        from flax import nnx

        params = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
        print(f"  {name}: {params / 1e9:.2f} GB of weights built in {time.perf_counter() - t0:.1f} s", flush=True)
    if model is None:
        return
    tpb = 16
    rng = np.random.default_rng(0)
    for impl in impls:
        for batch in batches:
            with row.check(f"{impl} batch={batch}"):
                blocks = batch * (-(-(prompt_len + new_tokens) // tpb) + 1) + 8
                cfg = EngineConfig.from_dict({"max_batch_size": batch}, "gpu_check")
                cc = cache_config(model.spec, {"primary_blocks": blocks, "tokens_per_block": tpb,
                                               "max_seq_len": prompt_len + new_tokens + tpb},
                                  max_num_tokens=cfg.scheduler.max_num_tokens, source="gpu_check")
                engine = Engine(model, cfg, impl=impl)
                figures = {}
                for attempt in ("compile", "timed"):
                    llm = LLMEngine(engine, cc)
                    for i in range(batch):
                        prompt = rng.integers(0, model.spec.vocab_size, prompt_len).tolist()
                        llm.add_request(f"{attempt}-{i}", prompt,
                                        SamplingParams(max_tokens=new_tokens, ignore_eos=True))
                    t0 = time.perf_counter()
                    first_all = None
                    started: set[str] = set()
                    decode_steps = 0
                    while llm.has_unfinished_requests():
                        outs = llm.step()
                        now = time.perf_counter()
                        if first_all is not None:
                            decode_steps += 1
                        for out in outs:
                            if out.outputs and out.outputs[0].token_ids:
                                started.add(out.request_id)
                        if first_all is None and len(started) == batch:
                            first_all = now
                    end = time.perf_counter()
                    llm.close()
                    figures = {"ttft_all_s": (first_all or end) - t0, "total_s": end - t0, "decode_steps": decode_steps}
                    if attempt == "compile":
                        print(f"  {impl} batch={batch}: first pass (compiles) {end - t0:.1f} s", flush=True)
                decode_s = figures["total_s"] - figures["ttft_all_s"]
                tokens = batch * (new_tokens - 1)
                tok_s = tokens / decode_s if decode_s > 0 else float("nan")
                step_s = decode_s / max(figures["decode_steps"], 1)
                kv_bytes = sum(cc.cache_size_per_token.values())  # bytes one token of context holds
                moved = params + batch * (prompt_len + new_tokens // 2) * kv_bytes  # read per decode step
                frac = None if peak is None else moved / step_s / peak
                row.figures[f"{impl}_b{batch}"] = dict(figures, decode_tokens_per_s=tok_s, step_s=step_s,
                                                       fraction_of_peak=frac)
                print(f"  {impl} batch={batch}: decode {tok_s:.1f} tok/s, {step_s * 1e3:.2f} ms/step, "
                      f"prefill of the batch {figures['ttft_all_s']:.2f} s"
                      + ("" if frac is None else f", weights+KV read at {frac:.0%} of rated peak"), flush=True)


ROWS: dict[str, Callable[[Row, bool], None]] = {
    "env": row_env, "kernels": row_kernels, "scan": row_scan, "copy": row_copy, "throughput": row_throughput,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("row", choices=sorted(ROWS))
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes and the micro model (any CPU; seconds)")
    ap.add_argument("--out", help="directory for row_<name>.json")
    args = ap.parse_args(argv)
    fail = os.environ.get("GPU_CHECK_FAIL_ROW")  # tests: make one row raise, to show the others still run
    row = Row(args.row)
    if fail == args.row:
        with row.check("injected failure"):
            raise RuntimeError("GPU_CHECK_FAIL_ROW asked this row to fail")
    ROWS[args.row](row, args.dry_run)
    return row.finish(args.out)


if __name__ == "__main__":
    sys.exit(main())
