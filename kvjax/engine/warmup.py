"""Warmup: compile a serving run's step programs before its first request (`--warmup`).

jit compiles one program per step shape (`kvjax.engine.batching.forward_shapes`); without a
warmup, the first request of each new shape waits for its compilation (seconds to minutes).
A warmup runs an all-padding step of each chosen shape (`padding_step`: no real row, nothing is
written, every output ignored), which compiles, or with JAX's persistent compilation cache
(`kvjax.compilation_cache`) loads, the same program a real step of that shape runs. Levels:

  none    nothing: every shape compiles on first use.
  common  the shapes of a steady stream of requests: decode-only steps at every batch bucket and
          prefill-only steps of one chunk at every chunk bucket (the block table has one width
          per engine). Steps mixing decodes and chunks, and steps of several chunks, compile on
          first use.
  all     every shape the settings allow (`forward_shapes`; their number is logged at start-up:
          64 at the defaults, ~100-130 at batch 64 or 256, docs/serving.md).

Programs a step compiles only when a request asks for them (penalties, logprobs, prompt
logprobs: separate executables) are not warmed up.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvjax.engine.batching import StepShape, padding_step

WARMUP_LEVELS = ("none", "common", "all")


def check_level(level: str) -> str:
    """`level` if it is one of `WARMUP_LEVELS`, else ValueError naming them."""
    if level not in WARMUP_LEVELS:
        raise ValueError(f"warmup must be one of {', '.join(WARMUP_LEVELS)}, got {level!r}")
    return level


def warmup_shapes(shapes: Sequence[StepShape], level: str) -> list[StepShape]:
    """The step shapes a warmup at `level` runs, from a run's `forward_shapes` (module docstring)."""
    check_level(level)
    if level == "none":
        return []
    if level == "all":
        return list(shapes)
    return [s for s in shapes if s.prefill_rows == 0 or (s.decode_rows == 0 and s.prefill_rows == 1)]


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    """What a warmup did: the shapes it ran, how many programs it traced (each compiled, or
    read from the persistent compilation cache) and its wall time."""

    level: str
    shapes: int
    traced: int
    seconds: float


Progress = Callable[[int, int, StepShape, float], None]  # (done, total, shape, seconds so far)


def run_warmup(runner, pools, cache_config, shapes: Sequence[StepShape], level: str,
               progress: Progress | None = None) -> tuple[WarmupReport, object]:
    """Run one padding step of each of `warmup_shapes(shapes, level)` on `runner`; returns the
    report and the pools (donated to each step and handed back unchanged in content)."""
    chosen = warmup_shapes(shapes, level)
    start = time.perf_counter()
    traced0 = runner.num_traces
    none_f, none_i = np.zeros(0, np.float32), np.zeros(0, np.int32)  # no real rows: no sampling inputs
    for i, shape in enumerate(chosen):
        _, pools = runner.run(pools, padding_step(shape, cache_config), none_f, none_f, none_i, none_i, none_i)
        if progress is not None:
            progress(i + 1, len(chosen), shape, time.perf_counter() - start)
    report = WarmupReport(level, len(chosen), runner.num_traces - traced0, time.perf_counter() - start)
    return report, pools
