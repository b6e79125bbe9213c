"""`kvjax serve` replicas as subprocesses on 127.0.0.1 for the router tests: the micro model with
small buckets, KV events on their own ports, a shared persistent compilation cache (the first
replica compiles, the others and restarts load the executables), killed at the end."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MICRO_FLAGS = ["micro", "--tokens-per-block", "8", "--max-seq-len", "256", "--primary-blocks", "64",
               "--max-batch-size", "4", "--max-num-tokens", "64", "--option", "min_batch_bucket=4",
               "--option", "min_chunk_bucket=64", "--option", "min_blocks_bucket=32", "--option", "prefill_rows=1",
               "--log-level", "warning", "--shutdown-timeout", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """One `kvjax serve` subprocess; the same ports across restarts."""

    def __init__(self, workdir: Path, name: str, *, events: bool = True) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pub = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.events = events
        self.log = workdir / f"{name}.log"
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(workdir / "jax-cache"),
                    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvjax.cli", "serve", *MICRO_FLAGS, "--host", "127.0.0.1", "--port", str(self.port)]
        if self.events:
            cmd += ["--kv-events-endpoint", self.pub, "--kv-events-replay-endpoint", self.replay, "--kv-events-topic",
                    self.name, "--data-parallel-rank", "0"]
        return cmd

    def start(self) -> "ServeProcess":
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not healthy after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye (a crashed replica)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (graceful), SIGKILL if it does not stop in time. Returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


def metric_value(text: str, name: str, **labels) -> float:
    """One sample of a Prometheus text page (labels given must match; others are ignored)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + s.value
    if total is None:
        raise KeyError(f"no sample {name} {labels}")
    return total


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
