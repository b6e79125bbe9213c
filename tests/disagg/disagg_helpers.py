"""Shared pieces of the disaggregation tests: configs, geometry, deterministic arrays, and a
producer child process that is always bounded by a timeout and ended by its pid."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np

from kvjax.config import CacheConfig
from kvjax.disagg import KVGeometry, KVTransferConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRODUCER_MAIN = pathlib.Path(__file__).with_name("producer_main.py")


def cache_config(**kw) -> CacheConfig:
    base = dict(tokens_per_block=4, num_layers=2, num_kv_heads=2, head_dim=8, max_seq_len=64, primary_blocks=8,
                dtype="float32")
    base.update(kw)
    return CacheConfig(**base)


def geometry(**kw) -> KVGeometry:
    model = kw.pop("model", "tiny-test")
    return KVGeometry.from_cache_config(cache_config(**kw), model=model)


def transfer_config(role: str, **extra) -> KVTransferConfig:
    settings = dict(side_channel_host="127.0.0.1", side_channel_port=0, transfer_address="127.0.0.1:0",
                    side_channel_timeout=2.0, pull_timeout=5.0, kv_lease_duration=10.0, heartbeat_interval=1.0)
    settings.update(extra)
    return KVTransferConfig.parse({"kv_connector": "JaxTransferConnector", "kv_role": role,
                                   "engine_id": f"test-{role}", "kv_connector_extra_config": settings})


def host_arrays(seed: int, shapes, dtypes) -> list[np.ndarray]:
    """Deterministic arrays (random bits for float dtypes, so NaN patterns are covered too)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        dt = np.dtype(dtype)
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
        out.append(raw.view(dt).reshape(shape))
    return out


class ProducerProcess:
    """`producer_main.py` in its own interpreter; `params` is the JSON line it prints."""

    def __init__(self, *args: str, timeout: float = 60.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen(["timeout", "-s", "KILL", str(timeout), sys.executable, str(PRODUCER_MAIN), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.stop()
            raise RuntimeError(f"producer did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
        self.params = json.loads(line)

    def read_line(self, limit: float = 30.0) -> str:
        end = time.monotonic() + limit
        assert self.proc.stdout is not None
        while time.monotonic() < end:
            line = self.proc.stdout.readline()
            if line:
                return line.strip()
            if self.proc.poll() is not None:
                break
        return ""

    def kill(self) -> None:
        """SIGKILL the whole process group (the `timeout` wrapper and the interpreter)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        self.kill()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
