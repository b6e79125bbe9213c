"""`LLMEngine`: the step-wise engine with text in and out (vLLM's `LLMEngine` interface).

    engine = LLMEngine.from_options("tiny", primary_blocks=128)
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step():          # RequestOutput of every request that moved
            print(out.request_id, out.outputs[0].text, out.finished)

It wraps an `EngineCore` (scheduling, ledger, device) and a `Tokenizer`: prompts may be text
(encoded with the tokenizer's special tokens, e.g. a BOS) or token ids; outputs carry the
detokenised text. End-of-sequence ids come from the tokenizer (its EOS and
generation_config.json's) unless `ignore_eos`; stop strings are matched on the text, and a
request that hits one is taken out of the core at once (its blocks stored for reuse).

Options (`from_options`, also `kvjax.LLM` and `kvjax serve`): the `[cache]` keys of a workload
file (`tokens_per_block`, `primary_blocks`, `secondary_blocks`, `max_seq_len`,
`enable_block_reuse`, ...) and its `[engine]` keys (`policy`, `max_batch_size`,
`max_num_tokens`, `queue_policy`, `max_wait_steps`, buckets, ...), see `kvjax.engine.config`.
With `kv_events=KVEventsConfig(...)` the engine publishes its cache's KV events (vLLM's wire
format on ZeroMQ, docs/kv_events.md) after every step; `close()` stops the publisher.
With `kv_store=` (a store URL such as `file:///var/cache/kvjax`, `redis://HOST:PORT`,
`memory://`, or a store object) and the other `kv_store_*` options, host blocks are kept in a
third tier (`kvjax.engine.store_tier_driver`, docs/kv_store.md); `close()` finishes its puts.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvjax.config import CacheConfig
from kvjax.engine.config import CACHE_DEFAULTS, EngineConfig, cache_config
from kvjax.engine.core import EngineCore
from kvjax.engine.core_types import CoreOutput
from kvjax.engine.engine import Engine
from kvjax.engine.event_publishing import KVEventsConfig
from kvjax.engine.outputs import CompletionOutput, Logprob, OutputText, PositionLogprobs, RequestMetrics, RequestOutput
from kvjax.engine.request_state import LiveRequest, Phase, TokenLogprobs
from kvjax.engine.sampling import SamplingParams, key_seed
from kvjax.engine.store_tier_driver import KVStoreConfig, model_identity, pop_store_options
from kvjax.engine.workloads import WorkItem
from kvjax.errors import DuplicateRequestError

log = logging.getLogger("kvjax.engine")


def split_options(options: Mapping[str, Any], source: str = "options") -> tuple[dict, dict]:
    """Split keyword options into `[cache]` and `[engine]` values; unknown keys raise ValueError."""
    cache, engine = {}, {}
    for k, v in options.items():
        if k in CACHE_DEFAULTS:
            cache[k] = v
        elif k in EngineConfig.KEYS:
            engine[k] = v
        else:
            known = sorted(set(CACHE_DEFAULTS) | set(EngineConfig.KEYS))
            raise ValueError(f"{source}: unknown option {k!r} (known: {', '.join(known)})")
    return cache, engine


class LLMEngine:
    """Add requests at any time, step, abort; see the module docstring. One thread drives it."""

    def __init__(self, engine: Engine, cache_config: CacheConfig, *, tokenizer=None, seed: int = 0, clock=None,
                 kv_events: KVEventsConfig | None = None, kv_transfer=None, kv_store: KVStoreConfig | None = None) -> None:
        """`kv_events`: publish the cache's KV events on ZeroMQ in vLLM's format (docs/kv_events.md).
        `kv_transfer`: a `kvjax.disagg.KVTransferConfig`: this engine is a prefill producer and/or
        a decode consumer of remote KV (docs/disaggregation.md). `kv_store`: a third KV tier under
        the host tier (docs/kv_store.md)."""
        if tokenizer is not None and tokenizer.vocab_size > engine.model.spec.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is {engine.model.spec.vocab_size}"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self.seed = seed
        self.core: EngineCore = engine.core(cache_config, clock=clock, kv_events=kv_events, kv_transfer=kv_transfer,
                                            kv_store=kv_store)
        self._groups: dict[str, _Group] = {}  # live requests only, by the caller's id
        self._child: dict[str, tuple[_Group, int]] = {}  # core request id -> (group, completion index)

    @classmethod
    def from_options(cls, model, *, tokenizer=None, seed: int = 0, runner=None, clock=None,
                     kv_events: KVEventsConfig | None = None, mesh=None, kv_transfer=None, **options) -> LLMEngine:
        """An engine for `model` (an NNX model with `.spec`, or anything `kvjax.models.loading.load_model`
        takes: a built-in model name or a checkpoint directory) with `options` (see above);
        `mesh` shards the model and the KV pools over its devices (tensor parallelism)."""
        options = dict(options)
        named = str(model) if isinstance(model, str) or hasattr(model, "__fspath__") else None
        kv_store = pop_store_options(options, None if named is None else model_identity(named, "seed0"))
        if named is not None:
            from kvjax.models.loading import load_model

            model, loaded_tokenizer = load_model(model, mesh=mesh)
            tokenizer = tokenizer or loaded_tokenizer
        cache_values, engine_values = split_options(options)
        config = EngineConfig.from_dict(engine_values, "options")
        engine = Engine(model, config, runner=runner, mesh=mesh)  # first: sharding may replicate KV heads (model.spec)
        cc = cache_config(model.spec, cache_values, max_num_tokens=config.scheduler.max_num_tokens, source="options")
        return cls(engine, cc, tokenizer=tokenizer, seed=seed, clock=clock, kv_events=kv_events, kv_transfer=kv_transfer,
                   kv_store=kv_store)

    def close(self) -> None:
        """Stop publishing KV events (idempotent); the engine must not step afterwards."""
        self.core.close()

    def kv_events_info(self) -> dict | None:
        """Where this engine publishes its KV events (None if it does not)."""
        return None if self.core.events is None else self.core.events.info()

    # ------------------------------------------------------------------ limits
    @property
    def max_seq_len(self) -> int:
        return self.core.cache_config.max_seq_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset() if self.tokenizer is None else self.tokenizer.eos_token_ids

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: text is encoded with special tokens; ids are checked to be ints."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def _work_item(self, request_id, prompt_ids, params: SamplingParams, lora_task_id, cache_salt, retention) -> WorkItem:
        return WorkItem(str(request_id), tuple(prompt_ids), params.max_tokens, lora_task_id=lora_task_id,
                        cache_salt=cache_salt, retention=retention, sampling=params)

    def check_request(self, request_id, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError unless the request can ever be served (length, vocabulary, blocks,
        stop token ids, stop strings need a tokenizer). Reads configuration only, so a server's
        HTTP threads may call it."""
        vocab = self.engine.model.spec.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad[0]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.core.validate(self._work_item(request_id, prompt_ids, params, None, None, None), list(prompt_ids))

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        lora_task_id: int | None = None,
        cache_salt: str | None = None,
        retention=None,
        kv_transfer_params=None,
    ) -> None:
        """Queue a request (admitted by a later `step`). `prompt` is text or token ids; pass
        `prompt_token_ids` too when the text is already tokenised (the text is then only
        reported back). Rejected at once (ValueError, nothing queued) if it can never fit.

        With `n > 1` the engine runs n child requests (ids `f"{i}_{request_id}"`, as vLLM):
        the first computes the prompt, the others wait until its blocks are cached and reuse
        them (without prefix caching each computes its own prompt); each has its own key
        stream (with a seed, child i uses seed + i).

        `kv_transfer_params` (vLLM's, docs/disaggregation.md): `{"do_remote_decode": true}` on a
        producer engine offers the prompt's KV when the request finishes (the final output's
        `kv_transfer_params` say where); a producer's params on a consumer engine pull that KV
        instead of computing it. Only with n = 1."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = self.tokenize(prompt) if prompt_token_ids is None else self.tokenize(list(prompt_token_ids))
        self.check_request(request_id, ids, params)
        if kv_transfer_params is not None and params.n != 1:
            raise ValueError(f"kv_transfer_params need n = 1, got n = {params.n}")
        rid = str(request_id)
        if rid in self._groups:
            raise DuplicateRequestError(f"request id {rid!r} is already queued or running")
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        group = _Group(rid, prompt if isinstance(prompt, str) else None, params)
        added: list[str] = []
        try:
            for i in range(params.n):
                cid, child = (rid, params) if params.n == 1 else (f"{i}_{rid}", _child_params(params, i))
                item = self._work_item(cid, ids, child, lora_task_id, cache_salt, retention)
                r = self.core.add_request(item, ids, seed=key_seed(child, self.seed, cid),
                                          stop_token_ids=frozenset(child.stop_token_ids), eos_token_ids=eos,
                                          after=group.children[0] if group.children else None,
                                          kv_transfer_params=kv_transfer_params)
                added.append(cid)
                detok = None if self.tokenizer is None else self.tokenizer.detokenizer(ids, params.skip_special_tokens)
                group.children.append(r)
                group.texts.append(OutputText(detok, params.stop))
                group.logprobs.append([] if params.logprobs is not None else None)
                group.cumulative.append(0.0)
        except BaseException:
            for cid in added:  # all or nothing
                self.core.abort_request(cid)
            raise
        self._groups[rid] = group
        for i, r in enumerate(group.children):
            self._child[r.request_id] = (group, i)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Take a request out (all its completions; blocks stored for reuse and freed).
        Returns its final output (finish reason "abort"), or None if it is not queued or running."""
        group = self._groups.get(str(request_id))
        if group is None:
            return None
        for r in group.children:
            self.core.abort_request(r.request_id)
        return self._output(group, finishing=True)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.core.num_running + self.core.num_waiting

    def reset_prefix_cache(self) -> int:
        """Drop the cached blocks (refused with `EngineBusyError` while requests run)."""
        return self.core.reset_prefix_cache()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One engine iteration; a `RequestOutput` for every request that produced tokens or
        finished in it."""
        moved: dict[str, _Group] = {}
        for out in self.core.step():
            r = out.request
            group, i = self._child[r.request_id]
            try:
                self._advance_text(out, group, i)
            except Exception as e:  # this completion's text failed: it alone ends, with "error"
                self._fail(r, e)
            moved[group.request_id] = group
        results = []
        for group in moved.values():
            try:
                results.append(self._output(group, finishing=all(r.finish_reason is not None for r in group.children)))
            except Exception as e:  # the group's output could not be made: its completions end with "error"
                results.append(self._failed_group(group, e))
        return results

    def _advance_text(self, out: CoreOutput, group: _Group, i: int) -> None:
        """Detokenise a completion's new tokens; a stop string found ends it (out of the core)."""
        r = out.request
        if r.finish_reason == "error":
            return
        text = group.texts[i]
        stop_token = out.finished and r.finish_reason == "stop" and bool(out.new_token_ids)
        hit = text.add(out.new_token_ids, ends_with_stop_token=stop_token, finished=out.finished,
                       check_stop=len(r.output) > group.params.min_tokens)
        if hit is not None:
            if out.finished:  # stopped by length in the same step: the stop string says why
                r.finish_reason, r.stop_reason = "stop", hit
            else:
                stopped = self.core.abort_request(r.request_id, reason="stop", stop_reason=hit)
                assert stopped is not None  # the request was running this step

    def _fail(self, r: LiveRequest, error: Exception) -> None:
        """End one completion whose output could not be made (e.g. its detokenisation raised): out
        of the core (blocks stored and freed, as an abort) if it still runs, finish reason
        "error", no text; the other requests of the step are untouched."""
        log.error("request %s failed: %s: %s", r.request_id, type(error).__name__, error, exc_info=error)
        self.core.abort_request(r.request_id, reason="error")  # None if it had finished already
        r.finish_reason, r.stop_reason = "error", None

    def _failed_group(self, group: _Group, error: Exception) -> RequestOutput:
        """Every completion of `group` ends with "error" (its output could not be built)."""
        for r in group.children:
            if r.finish_reason != "error":
                self._fail(r, error)
        self._groups.pop(group.request_id, None)
        for r in group.children:
            self._child.pop(r.request_id, None)
        first = group.children[0]
        metrics = RequestMetrics(first.arrival_time, first.admit_time, first.first_token_time, first.finish_time)
        cached = first.admissions[0].reused if first.admissions else 0
        completions = [CompletionOutput(i, "", list(r.output), "error", None) for i, r in enumerate(group.children)]
        return RequestOutput(group.request_id, group.prompt, first.prompt, completions, True, cached, metrics)

    def _decode_token(self, token: int) -> str | None:
        """A token's text on its own (special tokens included), as vLLM shows it in logprobs."""
        return None if self.tokenizer is None else self.tokenizer.decode([token], skip_special_tokens=False)

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        """vLLM's form of one position: the token first, then the most likely tokens."""
        d = {lp.token: Logprob(lp.logprob, lp.rank, self._decode_token(lp.token))}
        for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
            if t not in d:
                d[t] = Logprob(v, rank, self._decode_token(t))
        return d

    def _output(self, group: _Group, finishing: bool) -> RequestOutput:
        completions = []
        for i, r in enumerate(group.children):
            if r.finish_reason == "error":
                completions.append(CompletionOutput(i, "", list(r.output), "error", r.kv_error))  # why, if a KV pull failed
                continue
            text = group.texts[i]
            done = r.finish_reason is not None
            if done and not text.done:
                text.add((), ends_with_stop_token=False, finished=True)
            logprobs = cum = None
            seen = group.logprobs[i]
            if seen is not None:
                assert r.logprobs is not None  # the request asked for them
                new = r.logprobs[len(seen):]  # converted and summed once
                seen.extend(self._position(lp) for lp in new)
                group.cumulative[i] += sum(lp.logprob for lp in new)
                logprobs, cum = list(seen), float(group.cumulative[i])
            completions.append(CompletionOutput(i, text.visible(), list(r.output), r.finish_reason if done else None,
                                                r.stop_reason if done else None, logprobs, cum))
        first = group.children[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None and first.phase is not Phase.WAITING and first.context_pos >= len(first.prompt):
            if group.prompt_logprobs is None:
                group.prompt_logprobs = [None if lp is None else self._position(lp) for lp in first.prompt_logprobs]
            prompt_logprobs = group.prompt_logprobs
        if finishing:
            del self._groups[group.request_id]
            for r in group.children:
                del self._child[r.request_id]
        metrics = RequestMetrics(first.arrival_time, first.admit_time, first.first_token_time,
                                 first.finish_time if finishing else None)
        cached = first.admissions[0].reused if first.admissions else 0
        return RequestOutput(group.request_id, group.prompt, first.prompt, completions, finishing, cached, metrics,
                             prompt_logprobs, first.kv_transfer_params if finishing else None)  # prompt ids: read-only


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of an n > 1 request: n = 1, seed + index (vLLM's child requests);
    only the first scores the prompt."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


@dataclasses.dataclass(eq=False)
class _Group:
    """One request of the API: its n completions (core requests) and their text and logprobs."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    children: list[LiveRequest] = dataclasses.field(default_factory=list)
    texts: list[OutputText] = dataclasses.field(default_factory=list)
    logprobs: list[list[PositionLogprobs] | None] = dataclasses.field(default_factory=list)
    cumulative: list[float] = dataclasses.field(default_factory=list)  # each completion's summed logprob so far
    prompt_logprobs: list[PositionLogprobs | None] | None = None
