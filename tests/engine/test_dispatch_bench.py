"""A short run of benchmarks/dispatch_bench.py: the former two-call path against the one-call step."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import dispatch_bench  # noqa: E402
import pytest  # noqa: E402


@pytest.mark.slow  # compiles both paths' programs and their device floors (~9 small programs)
def test_dispatch_bench_times_both_paths():
    r = dispatch_bench.measure(period=1, batch=1, repeats=3)
    assert r["weight_arrays"] == 12 and r["decode_rows"] == 1
    assert r["mixed step"]["before_forwards"] == 2 and r["mixed step"]["after_forwards"] == 1
    for case in ("decode step", "mixed step"):
        c = r[case]
        for when in ("before", "after"):
            assert c[f"{when}_dispatch_ms"] > 0 and c[f"{when}_floor_ms"] > 0
            assert abs(c[f"{when}_host_ms"] - (c[f"{when}_dispatch_ms"] + c[f"{when}_device_ms"] - c[f"{when}_floor_ms"])) < 1e-9
    assert r["build_step_ms"] > 0
