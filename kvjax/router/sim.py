"""Route simulation: a workload through N replicas behind the real router logic.

Each replica is a real `EngineCore` (the engine's scheduler, ledger, admission with prefix
reuse, chunked prefill, decode, pauses, eviction, offload and onboard, step by step) whose
model is a time model: `TimeModelRunner` stands in for the `ModelRunner`, holds no pools,
answers every forward with seeded pseudo-random tokens (a function of the request's sampling
seed and the token's index) and lets the step be priced from what the core did
(`EngineCore.last_step`). After every step the replica's ledger events go through the real
wire path (`LedgerEventAdapter` -> msgpack payload -> `decode_batch`) into the router's
`PrefixIndex`, in process (no sockets); the router hashes each arriving prompt with the
ledger's own function and lets the policy choose. So the router only knows what the events
told it.

Time model (`TimeModel`): a step that prefills `p` tokens, decodes `d` requests and onboards
`b` blocks from the host tier takes `step_s + p * prefill_token_s + d * decode_row_s +
b * onboard_block_s` seconds. The ledger work of a step happens at its start; its tokens,
finished requests and events appear at its end. Independent requests arrive at
`arrival_step * tick_s`; a chat turn arrives `think_steps * tick_s` after its parent finished.

Metrics: prefix hit rate = prompt tokens reused / prompt tokens admitted, over the cluster;
TTFT from arrival at the router to the end of the step that produced the first token;
load imbalance = max / mean over replicas of the time-averaged running requests (requests in
the replica's batch), also reported for outstanding requests (queued + running).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import cast

import numpy as np

from kvjax.config import CacheConfig
from kvjax.engine.batching import StepOutput
from kvjax.engine.config import EngineConfig
from kvjax.engine.core import EngineCore
from kvjax.engine.core_types import CoreOutput
from kvjax.engine.engine import Engine
from kvjax.engine.request_state import LiveRequest
from kvjax.engine.sampling import request_seed
from kvjax.engine.scheduler import SchedulerConfig
from kvjax.engine.workloads import WorkItem
from kvjax.kv_events.adapter import LedgerEventAdapter
from kvjax.kv_events.wire import decode_batch, encode_batch
from kvjax.router.policy import RoutingPolicy
from kvjax.router.router import Router

EVENT_BUFFER = 1 << 16  # ledger events kept between two flushes (one step's worth, with room)


@dataclasses.dataclass(frozen=True)
class TimeModel:
    """Seconds per engine step (defaults: roughly an 8B model on one H100-class GPU)."""

    step_s: float = 0.008  # launch, sampling and scheduling overhead of any step
    prefill_token_s: float = 6e-5  # per prefill token (~16k tokens/s)
    decode_row_s: float = 2.5e-4  # per decoding request (reading its KV)
    onboard_block_s: float = 2e-5  # per block copied from the host tier

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TimeModel.{f.name} must be a number >= 0, got {v!r}")

    def step_seconds(self, prefill_tokens: int, decode_rows: int, onboard_blocks: int) -> float:
        return (self.step_s + prefill_tokens * self.prefill_token_s + decode_rows * self.decode_row_s
                + onboard_blocks * self.onboard_block_s)


_M64 = (1 << 64) - 1


def simulated_tokens(seeds: np.ndarray, indices: np.ndarray, vocab_size: int, avoid: Collection[int] = ()) -> np.ndarray:
    """The tokens a time-model replica 'samples': a hash of (request seed, output index) in
    [1, vocab_size), never one of `avoid` (end-of-sequence ids: a simulated answer runs to its
    max_new_tokens). The same request gets the same tokens wherever it runs."""
    x = (np.asarray(seeds, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
         + np.asarray(indices, np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(0x632BE59BD9B4E019))
    # numpy's stubs type uint64 array * uint64 scalar as float64; it stays uint64 at run time
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)  # type: ignore[operator]  # splitmix64's finaliser
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    out = (x % np.uint64(vocab_size - 1)).astype(np.int64) + 1  # [n] in [1, vocab)
    for eos in avoid:
        out = np.where(out == eos, eos % (vocab_size - 1) + 1, out)
    return out.astype(np.int32)


class SimulatedModel:
    """What an `EngineCore` asks of its model when the model is a time model: the vocabulary.
    It computes nothing, so it holds no KV geometry and any cache fits it."""

    def __init__(self, vocab_size: int) -> None:
        self.spec = dataclasses.make_dataclass("SimulatedSpec", [("vocab_size", int), ("name", str)])(vocab_size, "time-model")

    def check_cache(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"expected a CacheConfig, got {type(config).__name__}")


@dataclasses.dataclass(frozen=True)
class _Rows:
    """A time model's forward batch: only its rows (no tensors to build)."""

    num_rows: int


class TimeModelRunner:
    """A `ModelRunner` for a time model: no pools, no transfers to carry out, no tensors, and
    every forward answered with `simulated_tokens` (the chosen logits and margins are zeros)."""

    mesh = None

    def __init__(self, vocab_size: int, avoid: Collection[int] = ()) -> None:
        if vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3, got {vocab_size}")
        self.model = SimulatedModel(vocab_size)
        self.vocab_size = vocab_size
        self.avoid = tuple(sorted(avoid))
        self.num_traces = 0
        self.forwards = 0

    def batch(self, ledger, decode, prefill, buckets) -> _Rows:
        return _Rows(len(decode) + len(prefill))

    def allocate_pools(self, config: CacheConfig) -> None:
        return None

    def apply_transfers(self, pools, plan):
        return pools

    @property
    def num_forwards(self) -> int:
        return self.forwards

    def run(self, pools, batch, temperature, top_p, seed, index, top_k=None, extras=None):
        """One step's forward (`ModelRunner.run`'s interface): (`StepOutput`, pools)."""
        pending, pools = self.dispatch(pools, batch, temperature, top_p, seed, index, top_k, extras)
        return pending.fetch(), pools

    def dispatch(self, pools, batch, temperature, top_p, seed, index, top_k=None, extras=None, feed=None):
        """`ModelRunner.dispatch`'s interface: the simulated tokens depend on (seed, index) only,
        so a `feed` changes nothing; `fetch()` returns them at once."""
        self.forwards += 1
        n = batch.num_rows
        toks = simulated_tokens(seed, index, self.vocab_size, self.avoid)
        zeros = np.zeros(n, np.float32)
        return SimulatedStep(toks, StepOutput(toks, zeros, zeros)), pools


class SimulatedStep:
    """A `PendingStep` of the time model: its `tokens` (one per real row: `real_rows` is the
    identity), what a later step's feed would read, and `fetch()`."""

    def __init__(self, tokens: np.ndarray, result: StepOutput) -> None:
        self.tokens = tokens
        self.real_rows = np.arange(len(tokens))
        self.result = result

    def fetch(self) -> StepOutput:
        return self.result


class VirtualClock:
    """The simulation's time, as an `EngineCore` reads it (`now`); nothing is ever compiled."""

    compile_s = 0.0

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    @contextlib.contextmanager
    def measuring(self):
        yield


@dataclasses.dataclass
class _Step:
    first_tokens: list[LiveRequest]
    finished: list[LiveRequest]
    duration: float


class SimReplica:
    """One replica: a real `EngineCore` over a time model, and the adapter of its events."""

    def __init__(self, rid: int, cache_config: CacheConfig, scheduler: SchedulerConfig, time_model: TimeModel,
                 vocab_size: int, clock: VirtualClock, avoid: Collection[int] = ()) -> None:
        self.rid = rid
        self.config = dataclasses.replace(cache_config, event_buffer_max_size=EVENT_BUFFER)
        runner = TimeModelRunner(vocab_size, avoid)
        # duck-typed stand-ins: the time model answers ModelRunner's calls, the virtual clock ServingClock's
        engine = Engine(runner.model, EngineConfig(scheduler), runner=runner)  # type: ignore[arg-type]
        self.core = EngineCore(engine, self.config, clock=clock)  # type: ignore[arg-type]
        self.adapter = LedgerEventAdapter(self.config, data_parallel_rank=rid)
        self.time_model = time_model
        self.busy = False
        self.running_area = 0.0  # integral of running requests over time
        self.busy_s = 0.0
        self.steps = 0
        self.wire_batches = 0
        self.wire_bytes = 0

    @property
    def ledger(self):
        return self.core.ledger

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def add(self, item: WorkItem, prompt: list[int]) -> None:
        self.core.add_request(item, prompt, seed=request_seed(0, item.request_id))

    def step(self) -> _Step:
        """One engine step, priced by the time model (0 s if it ran nothing)."""
        outputs: list[CoreOutput] = self.core.step()
        counts = self.core.last_step
        if not counts.running:
            return _Step([], [], 0.0)
        first = [o.request for o in outputs if o.new_token_ids and len(o.request.output) == 1]
        finished = [o.request for o in outputs if o.finished]
        duration = self.time_model.step_seconds(counts.prefill_tokens, counts.decode_rows, counts.onboarded)
        self.running_area += counts.running * duration
        self.busy_s += duration
        self.steps += 1
        return _Step(first, finished, duration)

    # ------------------------------------------------------------------ events on the wire
    def publish(self) -> bytes | None:
        """This step's ledger events as one wire payload (None if nothing changed)."""
        self.ledger.flush_iteration_events()
        batch = self.adapter.convert(self.ledger.get_latest_events())
        if batch is None:
            return None
        payload = encode_batch(batch)
        self.wire_batches += 1
        self.wire_bytes += len(payload)
        return payload


# ---------------------------------------------------------------------- results
def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if len(values) else float("nan")


def _imbalance(values: Sequence[float]) -> float:
    mean = float(np.mean(values))
    return float(np.max(values)) / mean if mean > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class SimResult:
    label: str
    replicas: int
    requests: int
    prompt_tokens: int  # over all admissions
    reused_tokens: int
    ttft_s: tuple[float, ...]  # per request, in request-id order
    makespan_s: float
    routed: tuple[int, ...]  # requests per replica
    mean_running: tuple[float, ...]  # time-averaged running requests per replica
    mean_outstanding: tuple[float, ...]  # time-averaged queued + running requests per replica
    predicted_tokens: int  # cached prefix the router's index promised at routing time
    wire_batches: int
    wire_bytes: int
    evicted_blocks: int
    offloaded_blocks: int
    onboarded_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_p50_s(self) -> float:
        return _pct(self.ttft_s, 50)

    @property
    def ttft_p99_s(self) -> float:
        return _pct(self.ttft_s, 99)

    @property
    def imbalance(self) -> float:
        return _imbalance(self.mean_running)

    @property
    def imbalance_outstanding(self) -> float:
        return _imbalance(self.mean_outstanding)

    def summary(self) -> dict:
        return {
            "label": self.label, "replicas": self.replicas, "requests": self.requests,
            "hit_rate": self.hit_rate, "ttft_p50_s": self.ttft_p50_s, "ttft_p99_s": self.ttft_p99_s,
            "imbalance_running": self.imbalance, "imbalance_outstanding": self.imbalance_outstanding,
            "makespan_s": self.makespan_s, "routed": list(self.routed), "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens, "predicted_tokens": self.predicted_tokens,
            "wire_batches": self.wire_batches, "wire_bytes": self.wire_bytes, "evicted_blocks": self.evicted_blocks,
            "offloaded_blocks": self.offloaded_blocks, "onboarded_blocks": self.onboarded_blocks,
        }


# ---------------------------------------------------------------------- the simulation
def simulate(
    items: Sequence[WorkItem],
    *,
    replicas: int,
    policy: RoutingPolicy,
    cache_config: CacheConfig,
    scheduler: SchedulerConfig,
    time_model: TimeModel = TimeModel(),
    tick_s: float = 0.05,
    vocab_size: int,
    label: str | None = None,
    check_integrity: bool = True,
    inspect=None,
) -> SimResult:
    """Serve `items` on `replicas` simulated replicas behind a `Router` using `policy`.
    `inspect(replicas, router)`, if given, is called once the run is over (tests look inside)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    if not tick_s > 0:
        raise ValueError(f"tick_s must be > 0, got {tick_s!r}")
    sim = _Simulation(items, replicas, policy, cache_config, scheduler, time_model, tick_s, vocab_size)
    sim.run()
    sim.final_checks(check_integrity)
    if inspect is not None:
        inspect(sim.reps, sim.router)
    return sim.result(label or policy.name)


class _Simulation:
    """One `simulate` run: an event heap of arrivals and step ends over the replicas and the router."""

    def __init__(self, items: Sequence[WorkItem], replicas: int, policy: RoutingPolicy, cache_config: CacheConfig,
                 scheduler: SchedulerConfig, time_model: TimeModel, tick_s: float, vocab_size: int) -> None:
        by_id = {it.request_id: it for it in items}
        if len(by_id) != len(items):
            raise ValueError("work item ids must be unique")
        self.items = items
        self.cache_config = cache_config
        self.tick_s = tick_s
        self.clock = VirtualClock()
        avoid = {it.eos_id for it in items if it.eos_id is not None}
        self.reps = [SimReplica(i, cache_config, scheduler, time_model, vocab_size, self.clock, avoid)
                     for i in range(replicas)]
        self.router = Router(list(range(replicas)), policy, tokens_per_block=cache_config.tokens_per_block,
                             hash_kind=cache_config.event_hash)
        self.children: dict[str, list[WorkItem]] = collections.defaultdict(list)
        self.heap: list[tuple] = []
        self.seq = 0
        for it in items:
            if it.parent is None:
                self._push(it.arrival_step * tick_s, 1, "arrive", (it, list(it.tokens)))
            elif it.parent not in by_id:
                raise ValueError(f"work item {it.request_id!r}: unknown parent {it.parent!r}")
            else:
                self.children[it.parent].append(it)
        self.ttft: dict[str, float] = {}
        self.arrival: dict[str, float] = {}
        self.where: dict[str, int] = {}
        self.outstanding_area = [0.0] * replicas
        self.predicted = 0
        self.last_t = 0.0

    def _push(self, t: float, order: int, kind: str, payload: tuple) -> None:
        heapq.heappush(self.heap, (t, order, self.seq, kind, payload))
        self.seq += 1

    def _start(self, rep: SimReplica, t: float) -> None:
        st = rep.step()
        for _ in range(8):  # a step that only paused requests: the next one admits them again
            if st.duration or not rep.has_work():
                break
            st = rep.step()
        if st.duration == 0.0:
            return
        rep.busy = True
        self._push(t + st.duration, 0, "step_end", (rep, st))

    def _arrive(self, t: float, item: WorkItem, prompt: list[int]) -> None:
        max_seq_len = self.cache_config.max_seq_len
        if len(prompt) + item.max_new_tokens > max_seq_len:
            raise ValueError(f"request {item.request_id!r}: {len(prompt)} prompt tokens + max_new_tokens="
                             f"{item.max_new_tokens} exceed max_seq_len={max_seq_len}")
        decision = self.router.route(prompt, lora_task_id=item.lora_task_id, cache_salt=item.cache_salt)
        self.predicted += decision.match.blocks * self.cache_config.tokens_per_block
        rep = self.reps[cast(int, decision.replica)]  # the simulated replicas are numbered
        self.arrival[item.request_id] = t
        self.where[item.request_id] = rep.rid
        rep.add(item, prompt)
        if not rep.busy:
            self._start(rep, t)

    def _step_end(self, t: float, rep: SimReplica, st: _Step) -> None:
        rep.busy = False
        wire = rep.publish()
        if wire is not None:
            self.router.index.apply(rep.rid, decode_batch(wire))
        for r in st.first_tokens:
            self.ttft[r.request_id] = t - self.arrival[r.request_id]
        for r in st.finished:
            self.router.finished(rep.rid)
            self.ttft.setdefault(r.request_id, t - self.arrival[r.request_id])  # max_new_tokens == 0
            for child in self.children.pop(r.request_id, ()):
                prompt = r.prompt + r.output + list(child.tokens)
                self._push(t + child.arrival_step * self.tick_s, 1, "arrive", (child, prompt))
        if rep.has_work():
            self._start(rep, t)

    def run(self) -> None:
        while self.heap:
            t, _, _, kind, payload = heapq.heappop(self.heap)
            for i in range(len(self.reps)):
                self.outstanding_area[i] += self.router.loads[i] * (t - self.last_t)
            self.last_t = self.clock.t = t
            if kind == "arrive":
                self._arrive(t, *payload)
            else:
                self._step_end(t, *payload)

    def final_checks(self, check_integrity: bool) -> None:
        if len(self.ttft) != len(self.items):
            raise RuntimeError(f"simulation ended with {len(self.items) - len(self.ttft)} requests unserved")
        for rep in self.reps:
            if rep.has_work():
                raise RuntimeError(f"replica {rep.rid} still holds requests at the end")
            if check_integrity:
                rep.core.verify_idle()

    def result(self, label: str) -> SimResult:
        reps, makespan = self.reps, self.last_t
        stats = [rep.ledger.stats() for rep in reps]
        return SimResult(
            label=label,
            replicas=len(reps),
            requests=len(self.items),
            prompt_tokens=sum(rep.core.counters.admitted_prompt_tokens for rep in reps),
            reused_tokens=sum(rep.core.counters.reused_prompt_tokens for rep in reps),
            ttft_s=tuple(self.ttft[k] for k in sorted(self.ttft)),
            makespan_s=makespan,
            routed=tuple(sum(1 for v in self.where.values() if v == i) for i in range(len(reps))),
            mean_running=tuple(rep.running_area / makespan if makespan else 0.0 for rep in reps),
            mean_outstanding=tuple(a / makespan if makespan else 0.0 for a in self.outstanding_area),
            predicted_tokens=self.predicted,
            wire_batches=sum(rep.wire_batches for rep in reps),
            wire_bytes=sum(rep.wire_bytes for rep in reps),
            evicted_blocks=sum(s.evicted_blocks for s in stats),
            offloaded_blocks=sum(s.offloaded_blocks for s in stats),
            onboarded_blocks=sum(s.onboarded_blocks for s in stats),
        )


def scaled(cache_config: CacheConfig, scheduler: SchedulerConfig, time_model: TimeModel,
           factor: int) -> tuple[CacheConfig, SchedulerConfig, TimeModel]:
    """One replica as large as `factor` of them: `factor` x the blocks, batch and token budget,
    and `factor` x the compute (per-token and per-row costs divided by `factor`)."""

    def times(v):
        return {w: n * factor for w, n in v.items()} if isinstance(v, dict) else v * factor

    cfg = dataclasses.replace(
        cache_config,
        primary_blocks=times(cache_config.primary_blocks),
        secondary_blocks=times(cache_config.secondary_blocks),
        max_num_tokens=None if cache_config.max_num_tokens is None else cache_config.max_num_tokens * factor,
    )
    sched = dataclasses.replace(scheduler, max_batch_size=scheduler.max_batch_size * factor,
                                max_num_tokens=scheduler.max_num_tokens * factor)
    tm = dataclasses.replace(time_model, prefill_token_s=time_model.prefill_token_s / factor,
                             decode_row_s=time_model.decode_row_s / factor,
                             onboard_block_s=time_model.onboard_block_s / factor)
    return cfg, sched, tm


# ---------------------------------------------------------------------- reporting
def format_table(results: Sequence[SimResult], reference: SimResult | None = None) -> str:
    header = ("policy", "replicas", "hit rate", "vs single", "TTFT p50 ms", "TTFT p99 ms", "imbalance",
              "imb. queued", "makespan s", "routed per replica")
    rows = []
    for r in list(results) + ([reference] if reference is not None else []):
        rel = f"{r.hit_rate / reference.hit_rate:.1%}" if reference is not None and reference.hit_rate else "-"
        rows.append((r.label, str(r.replicas), f"{r.hit_rate:.1%}", rel, f"{r.ttft_p50_s * 1e3:.0f}",
                     f"{r.ttft_p99_s * 1e3:.0f}", f"{r.imbalance:.2f}", f"{r.imbalance_outstanding:.2f}",
                     f"{r.makespan_s:.1f}", " ".join(map(str, r.routed))))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True)))]
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines)


def plot_results(path: str | Path, results: Sequence[SimResult], reference: SimResult | None = None,
                 title: str = "") -> Path:
    """PNG: hit rate (with the single-replica reference), TTFT p50 / p99 and load imbalance per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    labels = [r.label for r in results]
    x = np.arange(len(results))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    ax.bar(x, [r.hit_rate for r in results], color="tab:blue")
    if reference is not None:
        ax.axhline(reference.hit_rate, color="k", linestyle="--", label=f"{reference.label} ({reference.hit_rate:.1%})")
        ax.axhline(0.9 * reference.hit_rate, color="tab:red", linestyle=":", label="90% of single replica")
        ax.legend(fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_ylim(0, 1)
    ax.set_title("cluster prefix hit rate (tokens)")
    ax = axes[1]
    ax.bar(x - 0.2, [r.ttft_p50_s * 1e3 for r in results], 0.4, label="p50")
    ax.bar(x + 0.2, [r.ttft_p99_s * 1e3 for r in results], 0.4, label="p99")
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title("time to first token")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(x - 0.2, [r.imbalance for r in results], 0.4, label="running")
    ax.bar(x + 0.2, [r.imbalance_outstanding for r in results], 0.4, label="queued + running")
    ax.axhline(1.3, color="tab:red", linestyle=":", label="target 1.3")
    ax.set_xticks(x, labels)
    ax.set_ylim(bottom=1.0)
    ax.set_title("load imbalance (max / mean)")
    ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- driver (CLI and benchmark)
@dataclasses.dataclass(frozen=True)
class RouteSimRun:
    workload: str
    results: tuple[SimResult, ...]
    reference: SimResult | None
    settings: dict


def run_route_sim(
    workload: str | Path,
    *,
    replicas: int,
    policies: Sequence[str] = ("kv-aware", "round-robin", "least-loaded"),
    tick_s: float = 0.02,
    overrides: dict | None = None,
    cache_overrides: dict | None = None,
    kv_aware: dict | None = None,
    time_model: TimeModel = TimeModel(),
    reference: bool = True,
    progress=None,
) -> RouteSimRun:
    """Load a workload file, serve it once per policy on `replicas` replicas (each sized by the
    file's [cache] / [engine] tables) and, with `reference`, once on a single replica holding
    all of their cache."""
    from kvjax.engine.config import EngineConfig, cache_config
    from kvjax.engine.workloads import load_workload, workload_from_dict
    from kvjax.model_catalog import load_model_spec
    from kvjax.router.policy import make_policy

    wf = load_workload(workload)
    wl = wf.workload
    if overrides:
        fields = {f.name: getattr(wl, f.name) for f in dataclasses.fields(wl)}
        wl = workload_from_dict({"kind": wl.kind, **fields, **overrides}, wf.path)
    spec = load_model_spec(wf.model or "tiny")
    engine = EngineConfig.from_dict(wf.engine, wf.path)
    cfg = cache_config(spec, {**wf.cache, **(cache_overrides or {})}, max_num_tokens=engine.scheduler.max_num_tokens,
                       source=wf.path)
    items = wl.build(spec.vocab_size)
    results = []
    for name in policies:
        policy = make_policy(name, **(kv_aware or {})) if name == "kv-aware" else make_policy(name)
        results.append(simulate(items, replicas=replicas, policy=policy, cache_config=cfg, scheduler=engine.scheduler,
                                time_model=time_model, tick_s=tick_s, vocab_size=spec.vocab_size))
        if progress is not None:
            progress(results[-1])
    ref = None
    if reference:
        c1, s1, t1 = scaled(cfg, engine.scheduler, time_model, replicas)
        ref = simulate(items, replicas=1, policy=make_policy("round-robin"), cache_config=c1, scheduler=s1,
                       time_model=t1, tick_s=tick_s, vocab_size=spec.vocab_size, label=f"single x{replicas}")
        if progress is not None:
            progress(ref)
    settings = {
        "workload": wl.describe(), "model": spec.name, "replicas": replicas, "tick_s": tick_s,
        "cache_per_replica": {**wf.cache, **(cache_overrides or {})},
        "engine_per_replica": {"policy": engine.scheduler.policy.value, "max_batch_size": engine.scheduler.max_batch_size,
                               "max_num_tokens": engine.scheduler.max_num_tokens},
        "time_model": dataclasses.asdict(time_model), "kv_aware": kv_aware or {},
    }
    return RouteSimRun(wl.name, tuple(results), ref, settings)


def write_report(run: RouteSimRun, out: str | Path, stem: str) -> tuple[Path, Path]:
    """JSON (settings + every result) and PNG of a route simulation."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / f"{stem}.json"
    payload = {"settings": run.settings, "results": [r.summary() for r in run.results],
               "reference": None if run.reference is None else run.reference.summary()}
    js.write_text(json.dumps(payload, indent=2, default=str))
    png = plot_results(out / f"{stem}.png", run.results, run.reference,
                       title=f"{run.workload}: {run.settings['replicas']} replicas")
    return js, png
