"""Workloads: deterministic request traces whose prefixes overlap the way real traffic does.

A workload file (`configs/workloads/NAME.toml`) has a `[workload]` table (the trace: `kind`
plus its parameters, below), optional `[cache]` / `[engine]` tables (the run's cache and
engine settings; see `kvjax.engine.config`) and an optional top-level `model` (name or path).
`Workload.build(vocab_size)` turns the trace into `WorkItem`s: the same seed gives the same
tokens, arrivals and options every time.

Kinds:
  chat                  users hold multi-turn conversations: turn k's prompt is the whole
                        conversation so far (previous prompt + generated answer) plus a new
                        user message, so it is only known when turn k-1 finishes (`parent`).
  shared-system-prompt  many one-shot requests behind a few long system prompts drawn with
                        Zipf popularity.
  few-shot              per task an instruction and an ordered list of examples; a request
                        takes the first k examples (k varies) and a query, so prefixes nest.
  long-doc-qa           a few long documents, many questions about each.

Common keys: `name`, `seed`, `max_new_tokens` (int or [lo, hi]), `arrival_interval` (engine
steps between arrivals of independent requests; 0 = all at once), `temperature`, `top_p`,
`eos_id`, `tenants` (number of cache salts; requests of different tenants never share KV),
`lora_ids` (LoRA adapter ids assigned round-robin; the demo model has no adapters, so an id
only isolates cache keys), `priority` (retention priority of the shared part: system prompt,
examples, document) and `decode_priority` (of generated blocks).
"""
from __future__ import annotations

import abc
import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvjax.config import MAX_PRIORITY, MIN_PRIORITY
from kvjax.engine.sampling import SamplingParams
from kvjax.package_data import configs_dir
from kvjax.request import RetentionConfig, TokenRangeRetention

WORKLOADS_DIR = configs_dir() / "workloads"


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One request of a trace.

    `tokens` is the whole prompt of an independent request, or, with `parent`, the tokens
    appended to the parent's finished conversation (its prompt + its generated tokens).
    `arrival_step` is the engine step at which an independent request arrives, or the steps
    a follow-up waits after its parent finished (a user's think time).
    """

    request_id: str
    tokens: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int = 0
    parent: str | None = None
    lora_task_id: int | None = None
    cache_salt: str | None = None
    retention: RetentionConfig | None = None
    sampling: SamplingParams = SamplingParams()
    eos_id: int | None = None

    def __post_init__(self) -> None:
        if not self.tokens and self.parent is None:
            raise ValueError(f"work item {self.request_id!r} has an empty prompt")
        if self.max_new_tokens < 0 or self.arrival_step < 0:
            raise ValueError(f"work item {self.request_id!r}: max_new_tokens and arrival_step must be >= 0")


# ---------------------------------------------------------------------- field parsing
def _int(src: str, key: str, v: Any, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{src}: {key} must be an int >= {lo}, got {v!r}")
    return v


def _range(src: str, key: str, v: Any, lo: int = 0) -> tuple[int, int]:
    """An int n (= [n, n]) or an inclusive [lo, hi] pair."""
    if isinstance(v, (list, tuple)):
        if len(v) != 2:
            raise ValueError(f"{src}: {key} must be an int or a [lo, hi] pair, got {v!r}")
        a, b = (_int(src, key, x, lo) for x in v)
        if a > b:
            raise ValueError(f"{src}: {key} = {list(v)} has lo > hi")
        return a, b
    n = _int(src, key, v, lo)
    return n, n


def _priority(src: str, key: str, v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not MIN_PRIORITY <= v <= MAX_PRIORITY:
        raise ValueError(f"{src}: {key} must be an int in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {v!r}")
    return v


# ---------------------------------------------------------------------- base
@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload(abc.ABC):
    """Parameters shared by every kind; subclasses add theirs and implement `_items`."""

    kind: ClassVar[str] = ""
    name: str = ""
    seed: int = 0
    max_new_tokens: tuple[int, int] = (16, 32)
    arrival_interval: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    eos_id: int | None = None
    tenants: int = 0
    lora_ids: tuple[int, ...] = ()
    priority: int | None = None
    decode_priority: int | None = None

    _RANGES: ClassVar[tuple[str, ...]] = ("max_new_tokens",)
    _POSITIVE: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        src = f"workload {self.name or self.kind!r}"
        _int(src, "seed", self.seed)
        _int(src, "arrival_interval", self.arrival_interval)
        _int(src, "tenants", self.tenants)
        for key in self._RANGES:
            object.__setattr__(self, key, _range(src, key, getattr(self, key)))
        for key in self._POSITIVE:
            _int(src, key, getattr(self, key), 1)
        if self.eos_id is not None:
            _int(src, "eos_id", self.eos_id)
        if not isinstance(self.lora_ids, (list, tuple)):
            raise ValueError(f"{src}: lora_ids must be a list of ints, got {self.lora_ids!r}")
        object.__setattr__(self, "lora_ids", tuple(_int(src, "lora_ids", x) for x in self.lora_ids))
        _priority(src, "priority", self.priority)
        _priority(src, "decode_priority", self.decode_priority)
        try:
            SamplingParams(self.temperature, self.top_p, self.seed)
        except ValueError as e:
            raise ValueError(f"{src}: {e}") from None
        if not self.name:
            object.__setattr__(self, "name", self.kind)

    # -------------------------------------------------------------- helpers for subclasses
    def _tokens(self, rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
        """n random token ids in [1, vocab) avoiding eos_id (0 is left unused)."""
        out = rng.integers(1, vocab_size, n)
        if self.eos_id is not None:  # remap eos to its neighbour (never eos itself: vocab >= 3)
            out = np.where(out == self.eos_id, self.eos_id % (vocab_size - 1) + 1, out)
        return tuple(int(t) for t in out)

    def _draw(self, rng: np.random.Generator, bounds: tuple[int, int]) -> int:
        lo, hi = bounds
        return int(rng.integers(lo, hi + 1))

    def _retention(self, shared_len: int) -> RetentionConfig | None:
        """High priority for the first `shared_len` tokens (the shared part), decode priority after."""
        if self.priority is None and self.decode_priority is None:
            return None
        ranges = (TokenRangeRetention(0, shared_len, self.priority),) if self.priority is not None and shared_len else ()
        return RetentionConfig(ranges, decode_priority=35 if self.decode_priority is None else self.decode_priority)

    def _options(self, index: int) -> dict[str, Any]:
        """Tenant (cache salt) and LoRA id of the index-th user / stream, round-robin."""
        return dict(
            cache_salt=f"tenant{index % self.tenants}" if self.tenants else None,
            lora_task_id=self.lora_ids[index % len(self.lora_ids)] if self.lora_ids else None,
            sampling=SamplingParams(self.temperature, self.top_p, self.seed),
            eos_id=self.eos_id,
        )

    def build(self, vocab_size: int) -> list[WorkItem]:
        """The trace for a model with `vocab_size` tokens (deterministic in `seed`)."""
        if vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3, got {vocab_size}")
        if self.eos_id is not None and self.eos_id >= vocab_size:
            raise ValueError(f"workload {self.name!r}: eos_id={self.eos_id} is outside the vocabulary ({vocab_size})")
        return self._items(np.random.default_rng(self.seed), vocab_size)

    @abc.abstractmethod
    def _items(self, rng: np.random.Generator, vocab_size: int) -> list[WorkItem]:
        """The kind's request trace."""

    def _prefix_items(
        self, rng, vocab_size, zipf: float, prefixes, prefix_tokens, count, suffix_tokens, id_format
    ) -> list[WorkItem]:
        """`count` one-shot requests, each one of `prefixes` shared prefixes (picked with
        Zipf exponent `zipf`; retained at this workload's priority) followed by a fresh suffix."""
        shared = [self._tokens(rng, self._draw(rng, prefix_tokens), vocab_size) for _ in range(prefixes)]
        picks = _zipf(rng, prefixes, zipf, count)
        items = []
        for i, p in enumerate(picks):
            prefix = shared[p]
            suffix = self._tokens(rng, max(1, self._draw(rng, suffix_tokens)), vocab_size)
            items.append(
                WorkItem(
                    id_format.format(i=i, p=p),
                    prefix + suffix,
                    self._draw(rng, self.max_new_tokens),
                    arrival_step=i * self.arrival_interval,
                    retention=self._retention(len(prefix)),
                    **self._options(int(p)),
                )
            )
        return items

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}


def _check_zipf(workload: Workload, z: object) -> None:
    if isinstance(z, bool) or not isinstance(z, (int, float)) or z < 0:
        raise ValueError(f"workload {workload.name!r}: zipf must be a number >= 0, got {z!r}")


def _zipf(rng: np.random.Generator, n: int, exponent: float, size: int) -> np.ndarray:
    """`size` draws from {0..n-1} with P(i) proportional to (i + 1) ** -exponent."""
    p = (np.arange(1, n + 1, dtype=np.float64)) ** -float(exponent)
    return rng.choice(n, size=size, p=p / p.sum())


# ---------------------------------------------------------------------- kinds
@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatWorkload(Workload):
    """Users, each with a system prompt (a few shared ones) and several turns."""

    kind: ClassVar[str] = "chat"
    users: int = 8
    turns: int = 3
    system_prompts: int = 2
    system_prompt_tokens: tuple[int, int] = (128, 128)
    user_tokens: tuple[int, int] = (16, 48)
    think_steps: int = 0

    _RANGES = Workload._RANGES + ("system_prompt_tokens", "user_tokens")
    _POSITIVE = ("users", "turns", "system_prompts")

    def __post_init__(self) -> None:
        super().__post_init__()
        _int(f"workload {self.name!r}", "think_steps", self.think_steps)

    def _items(self, rng, vocab_size):
        systems = [self._tokens(rng, self._draw(rng, self.system_prompt_tokens), vocab_size) for _ in range(self.system_prompts)]
        which = rng.integers(0, self.system_prompts, self.users)
        items = []
        for u in range(self.users):
            system = systems[which[u]]
            opts = self._options(u)
            retention = self._retention(len(system))
            parent = None
            for t in range(self.turns):
                message = self._tokens(rng, max(1, self._draw(rng, self.user_tokens)), vocab_size)
                rid = f"u{u}-t{t}"
                items.append(
                    WorkItem(
                        rid,
                        (system + message) if parent is None else message,
                        self._draw(rng, self.max_new_tokens),
                        arrival_step=u * self.arrival_interval if parent is None else self.think_steps,
                        parent=parent,
                        retention=retention,
                        **opts,
                    )
                )
                parent = rid
        return items


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedSystemPromptWorkload(Workload):
    """One-shot requests: a system prompt drawn with Zipf popularity + a user query."""

    kind: ClassVar[str] = "shared-system-prompt"
    requests: int = 32
    system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (256, 256)
    user_tokens: tuple[int, int] = (16, 64)
    zipf: float = 1.1

    _RANGES = Workload._RANGES + ("system_prompt_tokens", "user_tokens")
    _POSITIVE = ("requests", "system_prompts")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_zipf(self, self.zipf)

    def _items(self, rng, vocab_size):
        return self._prefix_items(
            rng,
            vocab_size,
            self.zipf,
            self.system_prompts,
            self.system_prompt_tokens,
            self.requests,
            self.user_tokens,
            "r{i}-sys{p}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class FewShotWorkload(Workload):
    """Per task: instruction + an ordered example list; a request uses the first k examples."""

    kind: ClassVar[str] = "few-shot"
    requests: int = 24
    tasks: int = 3
    instruction_tokens: tuple[int, int] = (32, 32)
    example_tokens: tuple[int, int] = (24, 40)
    shots: tuple[int, int] = (2, 6)
    query_tokens: tuple[int, int] = (8, 24)

    _RANGES = Workload._RANGES + ("instruction_tokens", "example_tokens", "shots", "query_tokens")
    _POSITIVE = ("requests", "tasks")

    def _items(self, rng, vocab_size):
        max_shots = self.shots[1]
        tasks = []
        for _ in range(self.tasks):
            instruction = self._tokens(rng, self._draw(rng, self.instruction_tokens), vocab_size)
            examples = [self._tokens(rng, self._draw(rng, self.example_tokens), vocab_size) for _ in range(max_shots)]
            tasks.append((instruction, examples))
        items = []
        for i in range(self.requests):
            t = int(rng.integers(0, self.tasks))
            instruction, examples = tasks[t]
            k = self._draw(rng, self.shots)
            prefix = instruction + sum(examples[:k], ())
            query = self._tokens(rng, max(1, self._draw(rng, self.query_tokens)), vocab_size)
            items.append(
                WorkItem(
                    f"r{i}-task{t}-k{k}",
                    prefix + query,
                    self._draw(rng, self.max_new_tokens),
                    arrival_step=i * self.arrival_interval,
                    retention=self._retention(len(prefix)),
                    **self._options(t),
                )
            )
        return items


@dataclasses.dataclass(frozen=True, kw_only=True)
class LongDocQAWorkload(Workload):
    """A few long documents; questions about them arrive interleaved (Zipf over documents)."""

    kind: ClassVar[str] = "long-doc-qa"
    documents: int = 3
    document_tokens: tuple[int, int] = (512, 512)
    questions: int = 12
    question_tokens: tuple[int, int] = (8, 24)
    zipf: float = 0.0

    _RANGES = Workload._RANGES + ("document_tokens", "question_tokens")
    _POSITIVE = ("documents", "questions")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_zipf(self, self.zipf)

    def _items(self, rng, vocab_size):
        return self._prefix_items(
            rng, vocab_size, self.zipf, self.documents, self.document_tokens, self.questions, self.question_tokens, "q{i}-doc{p}"
        )


KINDS: dict[str, type[Workload]] = {
    cls.kind: cls for cls in (ChatWorkload, SharedSystemPromptWorkload, FewShotWorkload, LongDocQAWorkload)
}


def workload_from_dict(data: Mapping[str, Any], source: str = "<workload>") -> Workload:
    """Build a workload from a `[workload]` table; errors name `source` and the key."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: [workload] must be a table")
    data = dict(data)
    kind = data.pop("kind", None)
    if kind not in KINDS:
        raise ValueError(f"{source}: [workload] kind must be one of {sorted(KINDS)}, got {kind!r}")
    cls = KINDS[kind]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(
            f"{source}: [workload] unknown key {unknown[0]!r} for kind {kind!r} (known: {', '.join(sorted(fields))})"
        )
    for key in ("lora_ids",):
        if isinstance(data.get(key), list):
            data[key] = tuple(data[key])
    try:
        return cls(**data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


@dataclasses.dataclass(frozen=True)
class WorkloadFile:
    """A parsed workload file: the trace plus the run settings it asks for."""

    path: str
    workload: Workload
    cache: dict[str, Any]
    engine: dict[str, Any]
    model: str | None = None  # model name / TOML path the workload is meant for


def load_workload(name_or_path: str | Path) -> WorkloadFile:
    """A workload by name (`configs/workloads/NAME.toml`) or by path."""
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith(".toml") or path.parent != Path(".") or path.is_file()):
        candidate = WORKLOADS_DIR / f"{text}.toml"
        if not candidate.is_file():
            known = ", ".join(sorted(p.stem for p in WORKLOADS_DIR.glob("*.toml"))) or "none"
            raise ValueError(f"unknown workload {text!r}; known workloads: {known}")
        path = candidate
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read workload file ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from None
    unknown = sorted(set(raw) - {"model", "workload", "cache", "engine"})
    if unknown:
        raise ValueError(f"{path}: unknown key or table {unknown[0]!r} (known: model, [workload], [cache], [engine])")
    if "workload" not in raw:
        raise ValueError(f"{path}: missing the [workload] table")
    for table in ("workload", "cache", "engine"):
        if not isinstance(raw.get(table, {}), dict):
            raise ValueError(f"{path}: [{table}] must be a table")
    model = raw.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"{path}: model must be a model name or a path to a model TOML, got {model!r}")
    return WorkloadFile(
        str(path),
        workload_from_dict(raw["workload"], str(path)),
        dict(raw.get("cache", {})),
        dict(raw.get("engine", {})),
        model,
    )
