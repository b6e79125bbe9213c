#!/usr/bin/env bash
# One prepared device check for a session lent a GPU (H200): under 8 minutes.
#   1. environment, 2. the device test suite on the GPU (impl="pallas" runs the Mosaic GPU
#   kernels natively there; the interpreter and cross-lowering tests run too),
#   3. native Mosaic GPU kernels vs their references at serving-sized shapes,
#   4. benchmarks/device_bench.py: gather/write/copy/swap bandwidth as ratios to the measured
#      device copy and host<->device link, and paged vs dense decode attention, for
#      impl=xla and impl=pallas and the apply_transfers strategies.
# On a CPU-only machine it runs end to end too (small shapes, interpreters): `bash benchmarks/gpu_check.sh`.
# Writes everything under ${OUT:-results/gpu_check}/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUTDIR=${OUT:-results/gpu_check}
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  export JAX_PLATFORMS=cuda GPU=1
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
  QUICK=""
else
  export JAX_PLATFORMS=cpu GPU=0
  QUICK="--quick"
fi
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

step "environment"
$PY - <<'PY' 2>&1 | tee "$OUTDIR/env.txt"
import jax, sys
d = jax.devices()[0]
print("python", sys.version.split()[0], "| jax", jax.__version__, "| backend", jax.default_backend(), "|", d.device_kind)
print("memories:", [m.kind for m in d.addressable_memories()])
PY
[ "$GPU" = 1 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUTDIR/env.txt"

step "device tests"
# test_sharding needs 8 devices (CPU only); hypothesis may be missing on a bare GPU image.
# On CPU (where CI runs the whole suite anyway) only the kernel-path tests run here.
if [ "$GPU" = 1 ]; then SELECT=(--ignore=tests/device/test_sharding.py); T_TESTS=180; else SELECT=(-k "pallas or mgpu"); T_TESTS=600; fi
$PY -c "import hypothesis" 2>/dev/null || SELECT+=(--ignore=tests/device/test_transfers.py --ignore=tests/device/test_write_gather.py)
timeout $T_TESTS $PY -m pytest -q -p no:cacheprovider tests/device "${SELECT[@]}" 2>&1 | tee "$OUTDIR/tests.txt" | tail -25 || status=1

step "native kernels vs references at serving shapes"
timeout $([ "$GPU" = 1 ] && echo 60 || echo 600) $PY - <<'PY' 2>&1 | tee "$OUTDIR/kernels.txt" || status=1
import functools, time, numpy as np, jax, jax.numpy as jnp
from kvjax import CacheConfig, TransferKind, TransferPlan
from kvjax.device import (allocate_pools, apply_transfers, apply_transfers_reference, gather_kv, gather_kv_reference,
                          paged_attention, paged_attention_reference, write_kv, write_kv_reference)
gpu = jax.default_backend() == "gpu"
rng = np.random.default_rng(0)
for layout in ("block_first", "layer_first"):
    cfg = CacheConfig(tokens_per_block=16, num_layers=2, num_kv_heads=8, head_dim=128, max_seq_len=4096,
                      primary_blocks=2048 if gpu else 64, secondary_blocks=256 if gpu else 16, dtype="bfloat16", layout=layout)
    p = allocate_pools(cfg)
    key = jax.random.key(1)
    p = p.replace(primary=tuple(jax.random.normal(key, a.shape, a.dtype).at[(-1,) if layout == "block_first" else (slice(None), -1)].set(0) for a in p.primary))
    pool = cfg.pools[0]
    B, M = (32, 64) if gpu else (2, 8)
    table = jnp.asarray(rng.permutation(pool.primary_blocks)[: B * M].reshape(B, M).astype(np.int32))
    lens = jnp.asarray(rng.integers(1, M * 16, B).astype(np.int32))
    for impl in ("xla", "pallas"):
        k, v = gather_kv(p, 1, table, lens, impl=impl)
        kr, vr = jax.jit(gather_kv_reference, static_argnums=1)(p, 1, table, lens)
        print(f"{layout:11s} {impl:6s} gather  exact={bool(jnp.array_equal(k, kr) & jnp.array_equal(v, vr))}")
        for ql, hq in ((1, 32), (4, 16)):
            q = jax.random.normal(jax.random.key(ql), (B, ql, hq, 128), jnp.bfloat16)
            o = paged_attention(q, p, 1, table, lens, impl=impl)
            r = jax.jit(paged_attention_reference, static_argnums=2)(q, p, 1, table, lens)
            err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32))))
            print(f"{layout:11s} {impl:6s} attention q_len={ql} heads={hq}: max|err|={err:.3e} ok={err < 3e-2}")
        n = 64 if gpu else 8
        sm = jnp.asarray(rng.choice(pool.primary_blocks * 16, n, replace=False).astype(np.int32))
        kn = jax.random.normal(key, (n, 8, 128), jnp.bfloat16)
        want = np.asarray(jax.jit(write_kv_reference, static_argnums=1)(p, 0, kn, kn, sm).primary[0])
        p = write_kv(p, 0, kn, kn, sm, impl=impl)
        print(f"{layout:11s} {impl:6s} write   exact={np.array_equal(np.asarray(p.primary[0]), want)}")
        K = TransferKind
        plan = TransferPlan.from_ops([(K.OFFLOAD, 0, 3, 1, 16), (K.COPY, 0, 5, 3, 7), (K.ONBOARD, 0, 1, 9, 16), (K.COPY, 0, 9, 10, 16)])
        for strategy in ("blockwise", "bulk") + (("sequential",) if impl == "xla" else ()):
            want = apply_transfers_reference(p, plan)  # from the current state: plans are not idempotent
            want = [np.array(jnp.copy(a)) for a in (*want.primary, *want.secondary)]
            try:
                p = apply_transfers(p, plan, impl=impl, strategy=strategy)
                got = [np.array(jnp.copy(a)) for a in (*p.primary, *p.secondary)]
                print(f"{layout:11s} {impl:6s} transfers {strategy:10s} exact={all(np.array_equal(a, b) for a, b in zip(got, want))}")
            except Exception as e:  # report and continue: another strategy may work
                print(f"{layout:11s} {impl:6s} transfers {strategy:10s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
PY

step "bandwidth and attention benchmarks"
# GPU: both impls and the transfer strategies. CPU: the Pallas interpreter is a test vehicle, so
# only one (small) pallas run, to show the script works end to end.
if [ "$GPU" = 1 ]; then RUNS="xla:blockwise xla:bulk xla:sequential pallas:blockwise"; T_BENCH=55; else RUNS="xla:sequential xla:bulk pallas:blockwise"; T_BENCH=600; fi
for run in $RUNS; do
  impl=${run%%:*}; strategy=${run##*:}
  timeout $T_BENCH $PY benchmarks/device_bench.py $QUICK --impl $impl --strategy $strategy --out "$OUTDIR/bench_${impl}_${strategy}.json" 2>&1 \
    | tee "$OUTDIR/bench_${impl}_${strategy}.txt" || status=1
done
echo; echo "gpu_check finished with status $status; results in $OUTDIR"
exit $status
