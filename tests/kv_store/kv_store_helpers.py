"""Helpers of the kv_store tests: a private redis-server per test session, and a user store
class loaded by module path."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import pytest

from kvjax.kv_store import MemoryStore


class RedisServer:
    """A `redis-server` on a free 127.0.0.1 port, no persistence, stopped by pid."""

    def __init__(self, binary: str) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        last = ""
        for _ in range(3):  # a free port can be taken between the probe and the bind
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            proc = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--protected-mode", "yes", "--daemonize", "no", "--loglevel", "warning"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )
            if self._wait_ready(port, proc):
                self.proc, self.port = proc, port
                return
            proc.kill()
            out, _ = proc.communicate(timeout=5)
            last = out.decode(errors="replace")[-500:]
        raise RuntimeError(f"redis-server did not start: {last}")

    @staticmethod
    def _wait_ready(port: int, proc: subprocess.Popen[bytes]) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


def start_redis() -> RedisServer:
    """Start a private redis-server. Without one installed the Redis tests fail (`make test`
    installs it where it can), unless the person running them opted out on purpose with
    KVJAX_SKIP_REDIS_TESTS=1; CI never may."""
    binary = shutil.which("redis-server")
    if binary is None:
        msg = "redis-server is not installed (apt-get install redis-server); the Redis store tests need it"
        ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
        if os.environ.get("KVJAX_SKIP_REDIS_TESTS") == "1" and not ci:
            pytest.skip(msg + " (skipped on request: KVJAX_SKIP_REDIS_TESTS=1)")
        pytest.fail(msg + (" and CI must run them" if ci else " (or set KVJAX_SKIP_REDIS_TESTS=1 to skip them)"))
    return RedisServer(binary)


class ExampleUserStore:
    """A user-defined store loaded as `kv_store_helpers:ExampleUserStore?capacity=...`: URL
    parameters arrive as strings, the class parses them itself."""

    def __init__(self, capacity: str, label: str = "") -> None:
        self.capacity = int(capacity)
        self.label = label
        self._inner = MemoryStore(self.capacity)

    def batch_exists(self, keys: Sequence[str]) -> int:
        return self._inner.batch_exists(keys)

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        return self._inner.batch_put(keys, buffers)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        return self._inner.batch_get_into(keys, buffers)

    def remove(self, keys: Sequence[str]) -> int:
        return self._inner.remove(keys)

    def close(self) -> None:
        self._inner.close()


class NotAStore:
    def __init__(self) -> None:
        pass
