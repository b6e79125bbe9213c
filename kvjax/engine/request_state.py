"""`LiveRequest`: one request's life in the engine (phase, tokens, pending token, timings).

Phases: WAITING (not in the ledger: new, or paused) -> CONTEXT (admitted; prefill chunks run
until the admitted prompt is materialised) -> GENERATION (one token per step) -> FINISHED.
A paused request goes back to WAITING; it is re-admitted with prompt = original prompt +
tokens generated so far, so the ledger's prefix reuse recovers what it had computed.

The token sampled at the end of a step is *pending*: it enters the ledger (`add_token`) at
the start of the next step that schedules the request, which is when its KV gets written.

With overlap (`EngineConfig.async_scheduling`) a token is *in flight* between the step that
samples it and the next step's end, when the host reads it: its position is reserved in the
ledger (`add_pending_tokens`) and the next decode row takes it from the device.

A request ends with a finish reason: "stop" (an end-of-sequence token: the work item's
`eos_id` or one of `eos_ids`; a stop token of `stop_ids`; or a stop string found by
`LLMEngine`), "length" (`max_new_tokens` reached) or "abort" (taken out by `abort_request` or a shutdown).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from kvjax.engine.workloads import WorkItem
from kvjax.request import Request


class Phase(enum.Enum):
    WAITING = "waiting"
    CONTEXT = "context"
    GENERATION = "generation"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class Admission:
    """One `add_sequence` of a request: prompt length, tokens reused (prepopulated), whether
    it resumed a paused request, and the prefill tokens it computed."""

    prompt_len: int
    reused: int
    resumed: bool
    computed: int = 0
    transferred: int = 0  # prompt tokens whose KV a producer engine sent (kvjax.engine.remote_kv)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One position's logprobs (raw model distribution): the token's own logprob and rank
    (1 = most likely), and the most likely tokens with theirs (as many as asked)."""

    token: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclasses.dataclass(eq=False)
class LiveRequest:
    item: WorkItem
    prompt: list[int]  # resolved full prompt (a follow-up's includes its parent's conversation)
    arrival_step: int
    arrival_time: float
    seed: int  # sampling key stream of this request
    order: int  # admission order (oldest first among running requests)
    phase: Phase = Phase.WAITING
    output: list[int] = dataclasses.field(default_factory=list)
    pending: int | None = None  # sampled, not yet in the ledger
    in_flight: int = 0  # tokens a dispatched, not yet fetched step is sampling (overlap: kvjax.engine.overlap)
    wasted_rows: int = 0  # rows dispatched for it after it had finished (overlap: at most one)
    context: list[int] = dataclasses.field(default_factory=list)  # prompt of the current admission
    context_pos: int = 0  # tokens of `context` whose KV is materialised
    admissions: list[Admission] = dataclasses.field(default_factory=list)
    admission_stats: Any = None  # the ledger's RequestStats of the latest admission
    pauses: int = 0
    admit_time: float | None = None
    first_token_time: float | None = None
    first_token_step: int | None = None
    finish_time: float | None = None
    finish_step: int | None = None
    chosen_logits: list[float] = dataclasses.field(default_factory=list)
    margins: list[float] = dataclasses.field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # token ids that end the request (stop_reason: the id)
    eos_ids: frozenset[int] = frozenset()  # end-of-sequence ids besides item.eos_id (stop_reason: None)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id (from stop_ids) or stop string
    after: LiveRequest | None = None  # held back until this request's prompt is cached (n > 1)
    store_checked: bool = False  # the KV store was consulted for it (kvjax.engine.store_tier_driver)
    logprobs: list[TokenLogprobs] | None = None  # per output token, when sampling.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token, when sampling.prompt_logprobs is set
    # disaggregated prefill/decode (kvjax.engine.remote_kv)
    remote_decode: bool = False  # producer: offer the prompt's blocks when the request finishes
    remote_prefill: Any = None  # consumer: the producer's RemotePrefillParams, until the pull starts
    awaiting_kv: bool = False  # consumer: admitted, its pull in flight (no prefill chunk is cut)
    kv_transfer_params: dict | None = None  # producer: the offer's params, for the response
    kv_error: str | None = None  # consumer: why the pull failed (kv_load_failure_policy=fail)
    _prompt_mask: Any = None  # bool [V] of the prompt's tokens, for the repetition penalty

    def __post_init__(self) -> None:
        sp = self.item.sampling
        if sp.logprobs is not None:
            self.logprobs = []
        if sp.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt)

    @property
    def request_id(self) -> str:
        return self.item.request_id

    @property
    def remaining_new_tokens(self) -> int:
        return self.item.max_new_tokens - len(self.output)

    @property
    def context_remaining(self) -> int:
        return len(self.context) - self.context_pos

    def ledger_request(self) -> Request:
        """The `kvjax.Request` of the next admission: prompt + tokens generated so far. A
        request that wants prompt logprobs salts its blocks with its own id, so that it
        computes (and scores) its whole prompt: nothing it could reuse is in the cache."""
        item = self.item
        salt = item.cache_salt
        if self.prompt_logprobs is not None:
            salt = f"{salt or ''}\x00prompt_logprobs:{item.request_id}"
        return Request(
            request_id=item.request_id,
            prompt=self.prompt + self.output,
            max_new_tokens=self.remaining_new_tokens,
            lora_task_id=item.lora_task_id,
            cache_salt=salt,
            retention=item.retention,
        )

    def scores_prompt(self) -> bool:
        """Does the next prefill chunk still need the logprobs of prompt tokens? (First
        admission only: a resumed request scored its prompt already.)"""
        return self.prompt_logprobs is not None and len(self.admissions) == 1 and self.context_pos < len(self.prompt)

    def banned_ids(self) -> frozenset[int]:
        """Tokens masked before sampling: the end-of-sequence and stop tokens while fewer than
        `min_tokens` tokens are generated (vLLM's min_tokens)."""
        if len(self.output) >= self.item.sampling.min_tokens:
            return frozenset()
        eos = self.item.eos_id
        return self.stop_ids | self.eos_ids | (frozenset() if eos is None else frozenset((eos,)))

    def prompt_mask(self, vocab: int):
        """bool [vocab]: the tokens of the original prompt (cached: prompts are long)."""
        if self._prompt_mask is None:
            import numpy as np

            mask = np.zeros(vocab, bool)
            mask[self.prompt] = True
            self._prompt_mask = mask
        return self._prompt_mask

    def finished_by(self, token: int) -> bool:
        """Does sampling `token` (already appended to `output`) end the request?"""
        return self.finish_reason_after(token) is not None

    def finish_reason_after(self, token: int) -> str | None:
        """"stop" if `token` (already appended to `output`) is a stop token, else "length" if
        the request has all its tokens, else None."""
        eos = self.item.eos_id
        if (eos is not None and token == eos) or token in self.eos_ids or token in self.stop_ids:
            return "stop"
        if len(self.output) >= self.item.max_new_tokens:
            return "length"
        return None
