"""`benchmarks/gpu_check.sh --dry-run`: every row runs at tiny shapes on the CPU, and a row that
fails (here forced to) is recorded while every later row still runs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["env", "tests", "kernels", "scan", "copy", "throughput", "bench_xla_bulk", "fp8"]


@pytest.mark.slow
def test_gpu_check_dry_run_isolates_rows(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PY=sys.executable, GPU_CHECK_FAIL_ROW="scan", JAX_PLATFORMS="cpu")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the forced failure, and only it
    summary = {line.split()[0]: line.split()[1] for line in (tmp_path / "summary.txt").read_text().splitlines()}
    assert list(summary) == ROWS
    assert summary.pop("scan") == "FAILED", summary
    assert set(summary.values()) == {"ok"}, summary
    assert "ROW scan: FAILED 1/2 (injected failure)" in proc.stdout  # the row went on past its failure
    assert "scan matches unrolled" in proc.stdout
    assert "decode" in (tmp_path / "throughput.txt").read_text()


def test_gpu_check_rejects_unknown_arguments():
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--gpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_rated_peak_by_device_kind():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check_rows
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert gpu_check_rows.rated_peak("NVIDIA H200") == 4.8e12
    assert gpu_check_rows.rated_peak("NVIDIA GH200 480GB") == 4.0e12  # the longer name wins over "H200"
    assert gpu_check_rows.rated_peak("cpu") is None
