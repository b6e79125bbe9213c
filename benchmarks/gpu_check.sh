#!/usr/bin/env bash
# One prepared device check for a session lent a GPU (an H200): at most 565 s of row timeouts, so
# it ends inside one 10-minute device command, every row in its
# own process under its own timeout, so a failure or a hang ends that row only and the next runs.
#
#   bash benchmarks/gpu_check.sh            # on the GPU host (or any CPU: small shapes, interpreters)
#   bash benchmarks/gpu_check.sh --dry-run  # any CPU, tiny shapes, ~1-3 minutes: checks the script itself (CI runs it)
#
# Runs on the host's own Python and JAX (python3; .venv/bin/python where it exists, or $PY) with
# kvjax on PYTHONPATH: no venv and no package index needed. Rows (docs/benchmarks.md says what
# each figure should reach):
#   env         JAX, the device, its rated bandwidth, the kernel choice, missing optional modules
#   tests       the device test suite's kernel paths (native Mosaic GPU kernels on the GPU)
#   kernels     native kernels vs their references at serving shapes, 16-bit and FP8 pools
#   scan        a decode step scanned over a traced layer index vs the same step unrolled
#   copy        streaming bandwidth as a fraction of the device's rated peak
#   throughput  decode tokens/s of a Llama-3.1-8B-shaped random-weight model through the engine,
#               batch 1 and 64, XLA attention vs auto (the Mosaic kernel on Hopper), and the
#               weight + KV bytes a decode step reads as a fraction of the rated peak
#   bench_*     benchmarks/device_bench.py: gather/write/copy/swap bandwidth ratios, paged vs dense
#   fp8         benchmarks/fp8_accuracy.py (small): FP8 vs bf16 attention error, greedy agreement
# Writes everything under ${OUT:-results/gpu_check}/, ending with summary.txt (row, status, seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
  esac
done
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUTDIR=${OUT:-results/gpu_check}
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$DRY" = 0 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  export JAX_PLATFORMS=cuda GPU=1
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
  QUICK=""
else
  export JAX_PLATFORMS=cpu GPU=0
  QUICK="--quick"
fi
# A dry run checks the script, not speed: XLA compiles without most optimisations (most of a
# dry run's CPU time is compiling), the figures it prints mean nothing.
TINY=""
[ "$DRY" = 1 ] && export JAX_DISABLE_MOST_OPTIMIZATIONS=1 && TINY="--tiny"
ROWARGS=()
[ "$DRY" = 1 ] && ROWARGS=(--dry-run)
SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"
status=0

# row NAME GPU_TIMEOUT CPU_TIMEOUT DRY_TIMEOUT -- command...: run it, record ok / FAILED rc / TIMEOUT and seconds.
# GPU timeouts sum to 565 s (one device command may run 10 minutes); the CPU and dry-run ones
# were sized from runs on a loaded 2-core CPU, with 2-4x margin (dry: 980 s in all, inside
# tests/test_gpu_check.py's 1200 s; rows took 2-39 s at load ~8, each check printing its seconds).
row() {
  local name=$1 t_gpu=$2 t_cpu=$3 t_dry=$4; shift 5
  local t=$t_cpu
  [ "$GPU" = 1 ] && t=$t_gpu
  [ "$DRY" = 1 ] && t=$t_dry
  echo; echo "=== $name (timeout ${t}s, $(date +%T))"
  local start=$SECONDS rc
  timeout "$t" "$@" 2>&1 | tee "$OUTDIR/$name.txt"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start)) verdict=ok
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then verdict=TIMEOUT; elif [ "$rc" != 0 ]; then verdict="FAILED rc=$rc"; fi
  [ "$verdict" = ok ] || status=1
  printf '%-24s %-14s %5ss\n' "$name" "$verdict" "$took" | tee -a "$SUMMARY"
}

ROWS_PY=(benchmarks/gpu_check_rows.py)

row env 45 300 60 -- $PY "${ROWS_PY[@]}" env "${ROWARGS[@]}" --out "$OUTDIR"
[ "$GPU" = 1 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUTDIR/env.txt"

# On the GPU: the kernel paths (native Mosaic GPU), FP8 and scanned layers (compiling the whole
# suite for the GPU would not fit the budget); test_sharding needs 8 CPU devices. On a CPU the
# kernel-path tests; in a dry run one quick test, to show the row works.
# (collecting only that file: collecting all of tests/device costs a dry run more than the test).
if [ "$GPU" = 1 ]; then SELECT=(tests/device --ignore=tests/device/test_sharding.py -k "pallas or mgpu or scan or selection or fp8_roundtrip")
elif [ "$DRY" = 1 ]; then SELECT=(tests/device/test_kernels.py -k "tuning_configs")
else SELECT=(tests/device -k "pallas or mgpu or fp8"); fi
[ "$DRY" = 1 ] || $PY -c "import hypothesis" 2>/dev/null || SELECT+=(--ignore=tests/device/test_transfers.py --ignore=tests/device/test_write_gather.py)
row tests 100 900 120 -- $PY -m pytest -q -p no:cacheprovider "${SELECT[@]}"

row kernels 90 900 180 -- $PY "${ROWS_PY[@]}" kernels "${ROWARGS[@]}" --out "$OUTDIR"
row scan 40 300 90 -- $PY "${ROWS_PY[@]}" scan "${ROWARGS[@]}" --out "$OUTDIR"
row copy 20 120 60 -- $PY "${ROWS_PY[@]}" copy "${ROWARGS[@]}" --out "$OUTDIR"
row throughput 150 600 120 -- $PY "${ROWS_PY[@]}" throughput "${ROWARGS[@]}" --out "$OUTDIR"

# GPU: both impls and the transfer strategies. CPU: the Pallas interpreter is a test vehicle, so
# only one (small) pallas run, to show the script works end to end; a dry run does one XLA run.
if [ "$GPU" = 1 ]; then RUNS="xla:bulk pallas:blockwise"
elif [ "$DRY" = 1 ]; then RUNS="xla:bulk"
else RUNS="xla:sequential xla:bulk pallas:blockwise"; fi
for run in $RUNS; do
  impl=${run%%:*}; strategy=${run##*:}
  row "bench_${impl}_${strategy}" 45 600 150 -- $PY benchmarks/device_bench.py $QUICK $TINY --impl "$impl" --strategy "$strategy" \
    --out "$OUTDIR/bench_${impl}_${strategy}.json"
done
if [ "$DRY" = 1 ]; then FP8ARGS=(--prompts 2 --new-tokens 2 --model micro); else FP8ARGS=(--prompts 16 --new-tokens 16); fi
row fp8 30 900 200 -- $PY benchmarks/fp8_accuracy.py "${FP8ARGS[@]}" --out "$OUTDIR/fp8_accuracy.json"

echo; echo "=== summary"; cat "$SUMMARY"
echo "gpu_check finished with status $status; results in $OUTDIR"
exit $status
