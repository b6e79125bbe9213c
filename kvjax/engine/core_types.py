"""The engine core's value types and errors: what a step returns per request (`CoreOutput`),
what the last step did (`StepCounts`), the cumulative totals (`CoreCounters`) and the core's
two errors. Their own module so readers of outputs (LLMEngine, the router's simulation, the
server) need not import the step loop."""
from __future__ import annotations

import dataclasses

from kvjax.engine.request_state import LiveRequest
from kvjax.errors import KVCacheError


class EngineInvariantError(KVCacheError, AssertionError):
    """The engine's own bookkeeping disagrees with the ledger (a bug, never a user error)."""


class EngineBusyError(KVCacheError, RuntimeError):
    """The operation needs an engine with no running request (e.g. resetting the prefix cache)."""


@dataclasses.dataclass(frozen=True)
class CoreOutput:
    """What one step (or an abort) did to one request: the tokens it produced and whether it
    finished (then `request.finish_reason` says why)."""

    request: LiveRequest
    new_token_ids: tuple[int, ...]
    finished: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclasses.dataclass(frozen=True)
class StepCounts:
    """What the last step did (`EngineCore.last_step`): requests in the ledger once admissions
    are done (`running`; 0 means the step ran nothing), decode rows, prefill tokens computed,
    admissions, pauses and blocks onboarded from the host tier. A time model prices a step
    from these (`kvjax.router.sim`)."""

    running: int = 0
    decode_rows: int = 0
    prefill_tokens: int = 0
    admitted: int = 0
    paused: int = 0
    onboarded: int = 0


@dataclasses.dataclass
class CoreCounters:
    """Cumulative totals since the core started (the server's Prometheus counters read them)."""

    admitted_prompt_tokens: int = 0  # prompt tokens of every admission (resumes included)
    reused_prompt_tokens: int = 0  # of which the cache supplied (prepopulated)
    computed_prompt_tokens: int = 0  # prefill tokens run through the model
    generated_tokens: int = 0
    wasted_rows: int = 0  # overlap: rows dispatched for requests that had finished (one at most each)
    overlapped_steps: int = 0  # steps dispatched before the previous step's tokens were read
    prefix_queries: int = 0  # admissions that looked up the cache
    reused_blocks: int = 0  # per-admission ledger stats, summed (checked against the ledger)
    missed_blocks: int = 0
    finished: dict[str, int] = dataclasses.field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
