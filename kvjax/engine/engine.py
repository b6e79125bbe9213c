"""`Engine`: a model with its jitted runner and engine settings; `run` replays a request trace.

The step-wise serving loop itself is `EngineCore` (`core.py`): `add_request` / `step` /
`abort_request` over one ledger and one set of device pools. `Engine.run(items, cache_config)`
is a thin loop over a fresh core: it adds each `WorkItem` when its arrival step comes (a
follow-up turn when its parent finished, with the parent's conversation as its prompt
prefix), steps until everything finished, and returns the outputs with the run's metrics. At
the end it checks that every finished request's prefill computed + reused tokens equals its
admitted prompt tokens and that the idle ledger is empty and consistent (`verify_idle`).
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvjax.config import CacheConfig
from kvjax.engine.config import EngineConfig
from kvjax.engine.core import EngineCore
from kvjax.engine.core_types import EngineInvariantError
from kvjax.engine.hybrid_runner import HybridRunner, HybridServingError, is_hybrid
from kvjax.engine.metrics import RequestRecord, RunMetrics
from kvjax.engine.request_state import LiveRequest
from kvjax.engine.runner import ModelRunner
from kvjax.engine.sampling import request_seed
from kvjax.engine.workloads import WorkItem

__all__ = ["Engine", "EngineInvariantError", "RunResult", "identical_outputs", "max_logit_difference", "min_margin"]


@dataclasses.dataclass
class RunResult:
    outputs: dict[str, list[int]]  # request id -> generated tokens
    prompts: dict[str, list[int]]  # request id -> full prompt (follow-ups resolved)
    chosen_logits: dict[str, list[float]]  # logit of every sampled token
    margins: dict[str, list[float]]  # top-2 logit margin at every sampled token
    metrics: RunMetrics
    ledger: Any = None  # the run's KVCacheManager (empty of requests; its cache and stats remain)


class Engine:
    """Serves workloads with one model; `run` builds a fresh ledger and pools per call, and
    runs share compiled executables (pools keep only their geometry, so runs that differ in ledger
    policy alone compile nothing new). `core(cache_config)` starts a
    step-wise `EngineCore` on the same model and runner."""

    def __init__(
        self,
        model: Any,
        config: EngineConfig = EngineConfig(),
        *,
        impl: str = "auto",
        runner: ModelRunner | None = None,
        mesh=None,
    ) -> None:
        """`mesh`: tensor parallelism over its devices (weights and KV pools sharded over kv
        heads; a mesh spanning processes makes every process a rank, see `kvjax.engine.ranks`)."""
        if runner is not None and runner.model is not model:
            raise ValueError("runner serves a different model")
        if runner is not None and mesh is not None and getattr(runner, "mesh", None) is not mesh:
            raise ValueError("runner runs on a different mesh")
        self.model = model
        self.config = config
        if runner is None and is_hybrid(model):  # LFM2, Granite-4.0-H, Qwen3.5: KV + state pools
            if config.async_scheduling:
                raise HybridServingError(f"{type(model).__name__}: hybrid models are not served with async_scheduling")
            runner = HybridRunner(model, impl=impl, mesh=mesh)
        self.runner = ModelRunner(model, impl=impl, mesh=mesh) if runner is None else runner  # engines may share one

    @property
    def mesh(self):
        return getattr(self.runner, "mesh", None)

    def core(self, cache_config: CacheConfig, **kwargs) -> EngineCore:
        """A fresh step-wise core (its own ledger and pools) serving this engine's model."""
        return EngineCore(self, cache_config, **kwargs)

    def run(
        self,
        items: Sequence[WorkItem],
        cache_config: CacheConfig,
        *,
        label: str = "run",
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> RunResult:
        """Serve `items` to completion. `progress(n)` is called with the number of requests
        finished in each step (e.g. `tqdm.update`)."""
        return _Replay(self, items, cache_config, label, seed, progress).run()


class _Replay:
    """One `run`: the trace's arrival schedule and follow-ups on top of an `EngineCore`."""

    def __init__(
        self, engine: Engine, items: Sequence[WorkItem], cache_config: CacheConfig, label: str, seed: int, progress
    ) -> None:
        self.engine = engine
        self.label = label
        self.seed = seed
        self.progress = progress
        self.items = {it.request_id: it for it in items}
        if len(self.items) != len(items):
            raise ValueError("work item ids must be unique")
        self.children: dict[str, list[WorkItem]] = {}
        self.future: list[tuple[int, int, str, list[int]]] = []  # heap of (arrival step, seq, id, prompt)
        for n, it in enumerate(items):
            if it.parent is None:
                heapq.heappush(self.future, (it.arrival_step, n, it.request_id, list(it.tokens)))
            elif it.parent not in self.items:
                raise ValueError(f"work item {it.request_id!r}: unknown parent {it.parent!r}")
            else:
                self.children.setdefault(it.parent, []).append(it)
        self._seq = len(items)
        self.done: list[LiveRequest] = []
        self.traces0 = engine.runner.num_traces
        self.core = engine.core(cache_config, record_steps=True)

    def run(self) -> RunResult:
        core = self.core
        max_steps = self.engine.config.max_steps
        while self.future or core.has_unfinished_requests():
            if core.step_index >= max_steps:
                raise RuntimeError(f"run {self.label!r} did not finish within max_steps={max_steps}")
            if not core.has_unfinished_requests():  # idle: jump to the next arrival
                core.step_index = max(core.step_index, self.future[0][0])
            self._release()
            finished = 0
            for out in core.step():
                if out.finished:
                    finished += 1
                    self._done(out.request)
            if self.progress is not None and finished:
                self.progress(finished)
        wall = core.clock.now()
        self._final_checks()
        assert core.steps is not None  # a run's core always records its steps
        metrics = RunMetrics(
            label=self.label,
            requests=[_record(r) for r in sorted(self.done, key=lambda r: r.request_id)],
            steps=core.steps,
            ledger=dataclasses.asdict(core.ledger.stats()),
            wall_s=wall,
            compile_s=core.clock.compile_s,
            compilations=self.engine.runner.num_traces - self.traces0,
            accounting_misses=core.accounting_misses,
            deferred=core.deferred,
        )
        by_id = {r.request_id: r for r in self.done}
        return RunResult(
            outputs={k: list(r.output) for k, r in by_id.items()},
            prompts={k: list(r.prompt) for k, r in by_id.items()},
            chosen_logits={k: list(r.chosen_logits) for k, r in by_id.items()},
            margins={k: list(r.margins) for k, r in by_id.items()},
            metrics=metrics,
            ledger=core.ledger,
        )

    def _release(self) -> None:
        """Add the requests whose arrival step has come, in arrival order."""
        core = self.core
        while self.future and self.future[0][0] <= core.step_index:
            _, _, rid, prompt = heapq.heappop(self.future)
            item = self.items[rid]
            base = 0 if item.sampling.seed is None else item.sampling.seed
            core.add_request(item, prompt, seed=request_seed(base ^ self.seed, rid))

    def _done(self, r: LiveRequest) -> None:
        """A request finished in the step just run: its follow-ups arrive after their think time."""
        self.done.append(r)
        for child in self.children.pop(r.request_id, ()):
            prompt = r.prompt + r.output + list(child.tokens)
            heapq.heappush(self.future, (self.core.step_index + child.arrival_step, self._seq, child.request_id, prompt))
            self._seq += 1

    def _final_checks(self) -> None:
        admitted = sum(a.prompt_len for r in self.done for a in r.admissions)
        reused = sum(a.reused for r in self.done for a in r.admissions)
        computed = sum(a.computed for r in self.done for a in r.admissions)
        if computed + reused != admitted:
            raise EngineInvariantError(f"prefill computed {computed} + reused {reused} != admitted prompt tokens {admitted}")
        if reused != self.core.counters.reused_prompt_tokens:
            raise EngineInvariantError("reused tokens differ from the ledger's per-request prepopulated counts")
        self.core.verify_idle()


def _record(r: LiveRequest) -> RequestRecord:
    ttft = None if r.first_token_time is None else r.first_token_time - r.arrival_time
    tpot = None
    if r.first_token_time is not None and r.finish_time is not None and len(r.output) > 1:
        tpot = (r.finish_time - r.first_token_time) / (len(r.output) - 1)
    return RequestRecord(
        request_id=r.request_id,
        prompt_tokens=len(r.prompt),
        admitted_tokens=sum(a.prompt_len for a in r.admissions),
        reused_tokens=sum(a.reused for a in r.admissions),
        computed_tokens=sum(a.computed for a in r.admissions),
        output_tokens=len(r.output),
        pauses=r.pauses,
        arrival_step=r.arrival_step,
        first_token_step=r.first_token_step,
        finish_step=r.finish_step,
        ttft_s=ttft,
        tpot_s=tpot,
        latency_s=None if r.finish_time is None else r.finish_time - r.arrival_time,
    )


def identical_outputs(a: RunResult, b: RunResult) -> bool:
    """Same request ids, same generated tokens."""
    return a.outputs == b.outputs


def max_logit_difference(a: RunResult, b: RunResult) -> float:
    """Largest |difference| between the chosen-token logits of two runs (same ids and tokens)."""
    worst = 0.0
    for k, la in a.chosen_logits.items():
        lb = b.chosen_logits.get(k, [])
        for x, y in zip(la, lb, strict=True):
            worst = max(worst, abs(x - y))
    return worst


def min_margin(results: Iterable[RunResult]) -> float:
    """Smallest top-2 logit margin of any sampled token (how close greedy came to a tie)."""
    return min((m for res in results for ms in res.margins.values() for m in ms), default=float("inf"))
