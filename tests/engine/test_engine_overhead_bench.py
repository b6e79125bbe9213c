"""A short run of benchmarks/engine_overhead.py: the real engine over a sleeping time-model
device, serial and overlapped."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine_overhead  # noqa: E402


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_overhead_measures_idle_time(overlap):
    r = engine_overhead.measure(batch=4, device_s=0.002, prompt_len=32, new_tokens=6, tpb=8, seed=0, overlap=overlap)
    assert r["steps"] >= 6 and r["decode_steps"] >= 3
    assert abs(r["device_s"] - 0.002 * r["forwards"]) < 1e-9  # each forward paid it once
    assert 0.0 <= r["idle_fraction"] < 1.0 and r["wall_s"] >= r["device_s"]
    assert r["decode_host_ms_per_step"] > 0
    assert (r["overlapped_steps"] > 0) is overlap and r["wasted_rows"] == 0


def test_overlap_hides_host_time_behind_a_long_device_step():
    """With a device step far longer than the host's work, an overlapped decode step leaves the
    device (almost) never idle, while a serial one idles for all of the host's time."""
    kw = dict(batch=4, device_s=0.02, prompt_len=32, new_tokens=8, tpb=8, seed=0)
    serial = engine_overhead.measure(**kw)
    overlapped = engine_overhead.measure(**kw, overlap=True)
    assert overlapped["decode_idle_fraction"] < serial["decode_idle_fraction"]
    assert overlapped["decode_idle_fraction"] < 0.05
