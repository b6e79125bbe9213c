"""Run metrics: per-request and per-step records, a summary, a table, JSON and a plot.

TTFT is measured from a request's arrival (the start of the step that released it) to the
end of the step that sampled its first token; TPOT is the mean time between its later
tokens. All times are on the serving clock (wall time minus JAX compile time, which is
reported on its own; see `serving_clock.py`). Token hit rate = prompt tokens reused / prompt
tokens admitted; block hit rate is the ledger's `cache_hit_rate` (reused / (reused + missed) blocks).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    request_id: str
    prompt_tokens: int  # of the first admission (a resumed request's recompute is extra)
    admitted_tokens: int  # prompt tokens over all admissions
    reused_tokens: int
    computed_tokens: int
    output_tokens: int
    pauses: int
    arrival_step: int
    first_token_step: int | None
    finish_step: int | None
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float | None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    step: int
    time_s: float  # since the run started, at the end of the step
    decode_rows: int
    prefill_tokens: int
    admitted: int
    paused: int
    blocks_in_use: int  # primary, all windows
    secondary_in_use: int
    offloaded: int
    onboarded: int
    copied: int
    evicted: int
    partial_reused: int
    token_hit_rate: float  # cumulative
    block_hit_rate: float  # cumulative (ledger)


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else float("nan")


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


@dataclasses.dataclass
class RunMetrics:
    label: str
    requests: list[RequestRecord]
    steps: list[StepRecord]
    ledger: dict[str, Any]  # final `KVCacheManager.stats()` as a dict
    wall_s: float  # compile time excluded
    compile_s: float
    compilations: int
    accounting_misses: int
    deferred: int

    def summary(self) -> dict[str, Any]:
        reqs = self.requests
        admitted = sum(r.admitted_tokens for r in reqs)
        reused = sum(r.reused_tokens for r in reqs)
        computed = sum(r.computed_tokens for r in reqs)
        out = sum(r.output_tokens for r in reqs)
        ttft = [r.ttft_s for r in reqs if r.ttft_s is not None]
        tpot = [r.tpot_s for r in reqs if r.tpot_s is not None]
        wall = max(self.wall_s, 1e-9)
        return {
            "requests": len(reqs),
            "steps": len(self.steps),
            "wall_s": self.wall_s,
            "compile_s": self.compile_s,
            "prompt_tokens": sum(r.prompt_tokens for r in reqs),
            "admitted_prompt_tokens": admitted,
            "prefill_computed_tokens": computed,
            "prefill_reused_tokens": reused,
            "output_tokens": out,
            "token_hit_rate": reused / admitted if admitted else 0.0,
            "block_hit_rate": self.ledger.get("cache_hit_rate", 0.0),
            "ttft_mean_s": _mean(ttft),
            "ttft_p50_s": _pct(ttft, 50),
            "ttft_p90_s": _pct(ttft, 90),
            "tpot_mean_s": _mean(tpot),
            "output_tok_per_s": out / wall,
            "total_tok_per_s": (computed + out) / wall,
            "blocks_offloaded": self.ledger.get("offloaded_blocks", 0),
            "blocks_onboarded": self.ledger.get("onboarded_blocks", 0),
            "blocks_copied": self.ledger.get("copied_blocks", 0),
            "blocks_reused_partially": sum(s.partial_reused for s in self.steps),
            "blocks_evicted": self.ledger.get("evicted_blocks", 0),
            "peak_blocks_in_use": max((s.blocks_in_use for s in self.steps), default=0),
            "pauses": sum(r.pauses for r in reqs),
            "deferred_admissions": self.deferred,
            "accounting_misses": self.accounting_misses,
            "compilations": self.compilations,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "summary": self.summary(),
            "ledger": self.ledger,
            "requests": [dataclasses.asdict(r) for r in self.requests],
            "steps": [dataclasses.asdict(s) for s in self.steps],
        }


# ---------------------------------------------------------------------- presentation
_ROWS = (
    ("requests", "requests", "{:d}"),
    ("steps", "engine steps", "{:d}"),
    ("prompt_tokens", "prompt tokens", "{:d}"),
    ("admitted_prompt_tokens", "prompt tokens admitted (+ resumes)", "{:d}"),
    ("prefill_computed_tokens", "prefill tokens computed", "{:d}"),
    ("prefill_reused_tokens", "prefill tokens reused", "{:d}"),
    ("output_tokens", "output tokens", "{:d}"),
    ("token_hit_rate", "hit rate (tokens)", "{:.1%}"),
    ("block_hit_rate", "hit rate (blocks)", "{:.1%}"),
    ("ttft_mean_s", "TTFT mean", "{:.3f} s"),
    ("ttft_p50_s", "TTFT p50", "{:.3f} s"),
    ("ttft_p90_s", "TTFT p90", "{:.3f} s"),
    ("tpot_mean_s", "TPOT mean", "ms"),
    ("output_tok_per_s", "throughput (output)", "{:.1f} tok/s"),
    ("total_tok_per_s", "throughput (computed+output)", "{:.1f} tok/s"),
    ("wall_s", "serving time (compile excluded)", "{:.1f} s"),
    ("compile_s", "compile time", "{:.1f} s"),
    ("blocks_offloaded", "blocks offloaded", "{:d}"),
    ("blocks_onboarded", "blocks onboarded", "{:d}"),
    ("blocks_reused_partially", "blocks reused partially", "{:d}"),
    ("blocks_copied", "blocks copied (partial reuse)", "{:d}"),
    ("blocks_evicted", "blocks evicted", "{:d}"),
    ("peak_blocks_in_use", "peak blocks in use", "{:d}"),
    ("pauses", "pauses", "{:d}"),
    ("compilations", "compilations", "{:d}"),
)


def _fmt(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == "ms":
        return f"{value * 1e3:.1f} ms"
    return fmt.format(value)


def format_table(columns: Sequence[tuple[str, dict[str, Any]]], extra_rows: Sequence[tuple[str, Sequence[str]]] = ()) -> str:
    """A plain-text table: one row per metric, one column per (label, summary)."""
    rows: list[tuple[str, Sequence[str]]] = [("", [label for label, _ in columns])]
    for key, name, fmt in _ROWS:
        rows.append((name, [_fmt(s.get(key), fmt) for _, s in columns]))
    rows.extend(extra_rows)
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(r[1][i]) for r in rows) for i in range(len(columns))]
    lines = []
    for i, (name, cells) in enumerate(rows):
        lines.append("  ".join([name.ljust(w0)] + [c.rjust(w) for c, w in zip(cells, widths, strict=True)]))
        if i == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, np.generic):
            return clean(x.item())
        return x

    path.write_text(json.dumps(clean(payload), indent=1))
    return path


def plot_runs(path: str | Path, runs: Sequence[RunMetrics], title: str = "") -> Path:
    """PNG: cumulative hit rate per step, and TTFT per request in arrival order, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        steps = [s.step for s in run.steps]
        ax1.plot(steps, [s.token_hit_rate for s in run.steps], label=f"{run.label} (tokens)")
        ax1.plot(steps, [s.block_hit_rate for s in run.steps], linestyle="--", label=f"{run.label} (blocks)")
        reqs = sorted(run.requests, key=lambda r: (r.arrival_step, r.request_id))
        ax2.plot(range(len(reqs)), [r.ttft_s if r.ttft_s is not None else np.nan for r in reqs], marker=".", label=run.label)
    ax1.set_xlabel("engine step")
    ax1.set_ylabel("cumulative hit rate")
    ax1.set_ylim(0, 1)
    ax1.set_title("prefix-cache hit rate")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("request (arrival order)")
    ax2.set_ylabel("TTFT (s)")
    ax2.set_title("time to first token")
    ax2.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
