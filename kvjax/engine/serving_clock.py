"""`ServingClock`: wall-clock time minus the time JAX spent compiling.

The first run of a workload pays for every executable it compiles (seconds each on a CPU),
the second run of the same shapes pays nothing, so raw wall time would make whichever run
goes first look slow. Engine timings (TTFT, TPOT, throughput) use this clock instead, and the
compile time is reported on its own.

Compile time comes from JAX's monitoring events, collected around each engine call that may
compile: lowering and XLA compilation durations are summed; tracing durations nest (an outer
jit traces the inner ones), so only the longest trace of a call is counted.
"""
from __future__ import annotations

import contextlib
import threading
import time

_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_COUNTED = ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration")

_lock = threading.Lock()
_events: list[tuple[str, float]] = []
_installed = False


def _listener(event: str, duration_secs: float, **_: str | int) -> None:
    if event == _TRACE or event in _COUNTED:
        with _lock:
            _events.append((event, duration_secs))


def _install() -> None:
    global _installed
    if not _installed:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_listener)
        _installed = True


class ServingClock:
    def __init__(self) -> None:
        _install()
        self.compile_s = 0.0
        self._t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since the clock started, compile time excluded."""
        return time.perf_counter() - self._t0 - self.compile_s

    @contextlib.contextmanager
    def measuring(self):
        """Attribute the compile events of the enclosed calls to compile time (not reentrant)."""
        with _lock:
            _events.clear()
        try:
            yield
        finally:
            with _lock:
                new = list(_events)
                _events.clear()
            self.compile_s += sum(d for e, d in new if e in _COUNTED) + max((d for e, d in new if e == _TRACE), default=0.0)
