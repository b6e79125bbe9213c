#!/usr/bin/env bash
# One prepared device check for a session lent a GPU (H200): under 8 minutes (every step has
# its own timeout; they sum to 445 s on a GPU).
#   1. environment and the kernel choice for this card (compute capability),
#   2. the device test suite on the GPU (impl="pallas" runs the Mosaic GPU kernels natively
#      there; the interpreter and cross-lowering tests run too),
#   3. native Mosaic GPU kernels vs their references at serving-sized shapes, 16-bit and FP8
#      pools (FP8: the byte-moving kernels + dequantising epilogue; attention on XLA), and a
#      decode step scanned over layers (traced layer index) vs the same step unrolled,
#   4. benchmarks/device_bench.py: gather/write/copy/swap bandwidth as ratios to the measured
#      device copy and host<->device link, paged vs dense decode attention, the same rows on
#      FP8 pools (speed against bf16) and scanned vs unrolled layers, for impl=xla and
#      impl=pallas and the batched apply_transfers strategies,
#   5. benchmarks/fp8_accuracy.py (small): FP8 vs bf16 attention error and greedy agreement.
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
from kvjax.device import backend
import jax.numpy as jnp
print("compute capability:", backend.compute_capability())
for dt in ("bfloat16", "float8_e4m3fn", "float32"):
    print(f"  auto paged_attention, {dt}, head_dim 128, 16-token pages ->",
          backend.resolve("auto", "paged_attention", dtype=jnp.dtype(dt), head_dim=128, tokens_per_block=16))
PY
[ "$GPU" = 1 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUTDIR/env.txt"

step "device tests"
# test_sharding needs 8 devices (CPU only); hypothesis may be missing on a bare GPU image.
# On CPU (where CI runs the whole suite anyway) only the kernel-path tests run here.
# On the GPU: the kernel paths (native Mosaic GPU), FP8 and scanned layers (compiling the whole
# suite for the GPU would not fit the budget).
if [ "$GPU" = 1 ]; then SELECT=(--ignore=tests/device/test_sharding.py -k "pallas or mgpu or scan or selection or fp8_roundtrip"); T_TESTS=120
else SELECT=(-k "pallas or mgpu or fp8"); T_TESTS=900; fi
$PY -c "import hypothesis" 2>/dev/null || SELECT+=(--ignore=tests/device/test_transfers.py --ignore=tests/device/test_write_gather.py)
timeout $T_TESTS $PY -m pytest -q -p no:cacheprovider tests/device "${SELECT[@]}" 2>&1 | tee "$OUTDIR/tests.txt" | tail -25 || status=1

step "native kernels vs references at serving shapes (16-bit, FP8, scanned layers)"
timeout $([ "$GPU" = 1 ] && echo 90 || echo 900) $PY - <<'PY' 2>&1 | tee "$OUTDIR/kernels.txt" || status=1
import functools, time, numpy as np, jax, jax.numpy as jnp
from kvjax import CacheConfig, TransferKind, TransferPlan
from kvjax.device import (allocate_pools, apply_transfers, apply_transfers_reference, gather_kv, gather_kv_reference,
                          paged_attention, paged_attention_reference, write_kv, write_kv_reference)
gpu = jax.default_backend() == "gpu"
rng = np.random.default_rng(0)
gref = jax.jit(gather_kv_reference, static_argnums=1)
aref = jax.jit(paged_attention_reference, static_argnums=2)

def same(a, b):
    return all(np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)) for x, y in zip(a, b))

for dtype in ("bfloat16", "float8_e4m3fn"):
  for layout in ("block_first", "layer_first"):
    cfg = CacheConfig(tokens_per_block=16, num_layers=2, num_kv_heads=8, head_dim=128, max_seq_len=4096,
                      primary_blocks=2048 if gpu else 64, secondary_blocks=256 if gpu else 16, dtype=dtype, layout=layout)
    p = allocate_pools(cfg)
    pool = cfg.pools[0]
    tag = f"{dtype[:8]:8s} {layout:11s}"
    # every real slot of both layers written (FP8: quantised, scales set), the null slot left alone
    sm = np.arange(pool.primary_blocks * 16, dtype=np.int32)
    for layer in range(2):
        x = jax.random.normal(jax.random.key(layer), (sm.size, 8, 128), jnp.float32)
        p = write_kv(p, layer, x, -x, sm, impl="xla")
    B, M = (32, 64) if gpu else (2, 8)
    table = jnp.asarray(rng.permutation(pool.primary_blocks)[: B * M].reshape(B, M).astype(np.int32))
    lens = jnp.asarray(rng.integers(1, M * 16, B).astype(np.int32))
    for impl in ("xla", "pallas"):
        k, v = gather_kv(p, 1, table, lens, impl=impl)
        print(f"{tag} {impl:6s} gather  exact={same((k, v), gref(p, 1, table, lens))}")
        for ql, hq in ((1, 32), (4, 16)):
            q = jax.random.normal(jax.random.key(ql), (B, ql, hq, 128), jnp.bfloat16)
            try:
                o = paged_attention(q, p, 1, table, lens, impl=impl)
            except ValueError as e:  # FP8 attention has no Mosaic kernel: auto runs XLA
                print(f"{tag} {impl:6s} attention q_len={ql}: {str(e)[:90]}")
                continue
            err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - aref(q, p, 1, table, lens).astype(jnp.float32))))
            print(f"{tag} {impl:6s} attention q_len={ql} heads={hq}: max|err|={err:.3e} ok={err < 3e-2}")
        n = 64 if gpu else 8
        w = jnp.asarray(rng.choice(pool.primary_blocks * 16, n, replace=False).astype(np.int32))
        kn = jax.random.normal(jax.random.key(2), (n, 8, 128), jnp.bfloat16) * 4
        want = write_kv_reference(p, 0, kn, kn, w)
        want = [np.array(jnp.copy(a)) for a in (*want.primary, *[s for s in want.primary_scales if s is not None])]
        p = write_kv(p, 0, kn, kn, w, impl=impl)
        got = [np.array(jnp.copy(a)) for a in (*p.primary, *[s for s in p.primary_scales if s is not None])]
        print(f"{tag} {impl:6s} write   exact={all(np.array_equal(a, b) for a, b in zip(got, want))}")
        K = TransferKind
        plan = TransferPlan.from_ops([(K.OFFLOAD, 0, 3, 1, 16), (K.COPY, 0, 5, 3, 7), (K.ONBOARD, 0, 1, 9, 16), (K.COPY, 0, 9, 10, 16)])
        for strategy in ("blockwise", "bulk") + (("sequential",) if impl == "xla" else ()):
            want = apply_transfers_reference(p, plan)  # from the current state: plans are not idempotent
            arrays = lambda q: [np.array(jnp.copy(a)) for a in (*q.primary, *q.secondary, *q.primary_scales, *q.secondary_scales) if a is not None]  # noqa: E731
            want = arrays(want)
            try:
                p = apply_transfers(p, plan, impl=impl, strategy=strategy)
                print(f"{tag} {impl:6s} transfers {strategy:10s} exact={all(np.array_equal(a, b) for a, b in zip(arrays(p), want))}")
            except Exception as e:  # report and continue: another strategy may work
                print(f"{tag} {impl:6s} transfers {strategy:10s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")

# a decode step through 4 layers: scanned over a traced layer index vs unrolled (impl auto:
# the Mosaic attention kernel on Hopper), same pools in, same outputs and pools out
cfg = CacheConfig(tokens_per_block=16, num_layers=4, num_kv_heads=8, head_dim=128, max_seq_len=4096,
                  primary_blocks=1024 if gpu else 64, dtype="bfloat16")
B, M = (16, 32) if gpu else (2, 4)
table = jnp.asarray(rng.permutation(cfg.pools[0].primary_blocks)[: B * M].reshape(B, M).astype(np.int32))
lens = jnp.full((B,), M * 16, jnp.int32)
slots = table[:, -1] * 16 + 15
k = jax.random.normal(jax.random.key(3), (4, B, 8, 128), jnp.bfloat16)
qd = jax.random.normal(jax.random.key(4), (4, B, 1, 32, 128), jnp.bfloat16)

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
    def body(p, xs):
        return layer(p, *xs)
    return jax.lax.scan(body, p, (jnp.arange(4, dtype=jnp.int32), k, qd))

pu, ou = jax.jit(unrolled, donate_argnums=0)(allocate_pools(cfg))
ps, os_ = jax.jit(scanned, donate_argnums=0)(allocate_pools(cfg))
err = float(jnp.max(jnp.abs(ou.astype(jnp.float32) - os_.astype(jnp.float32))))
print(f"scanned vs unrolled decode step (4 layers): max|err|={err:.3e} pools equal={same(pu.primary, ps.primary)} ok={err < 1e-2}")
PY

step "bandwidth and attention benchmarks"
# GPU: both impls and the transfer strategies. CPU: the Pallas interpreter is a test vehicle, so
# only one (small) pallas run, to show the script works end to end.
if [ "$GPU" = 1 ]; then RUNS="xla:blockwise xla:bulk pallas:blockwise"; T_BENCH=65; else RUNS="xla:sequential xla:bulk pallas:blockwise"; T_BENCH=600; fi
for run in $RUNS; do
  impl=${run%%:*}; strategy=${run##*:}
  timeout $T_BENCH $PY benchmarks/device_bench.py $QUICK --impl $impl --strategy $strategy --out "$OUTDIR/bench_${impl}_${strategy}.json" 2>&1 \
    | tee "$OUTDIR/bench_${impl}_${strategy}.txt" || status=1
done
step "FP8 accuracy (small)"
timeout $([ "$GPU" = 1 ] && echo 40 || echo 900) $PY benchmarks/fp8_accuracy.py --prompts 16 --new-tokens 16 \
  --out "$OUTDIR/fp8_accuracy.json" 2>&1 | tee "$OUTDIR/fp8_accuracy.txt" || status=1

echo; echo "gpu_check finished with status $status; results in $OUTDIR"
exit $status
