"""A short run of benchmarks/engine_overhead.py: the real engine over a sleeping time-model device."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine_overhead  # noqa: E402


def test_engine_overhead_measures_idle_time():
    r = engine_overhead.measure(batch=4, device_s=0.002, prompt_len=32, new_tokens=6, tpb=8, seed=0)
    assert r["steps"] >= 6 and r["decode_steps"] >= 3
    assert abs(r["device_s"] - 0.002 * r["forwards"]) < 1e-9  # each forward paid it once
    assert 0.0 <= r["idle_fraction"] < 1.0 and r["wall_s"] >= r["device_s"]
    assert r["decode_host_ms_per_step"] > 0
