"""Run settings: the engine's knobs (`EngineConfig`) and the cache a run uses (`cache_config`).

Both can come from a workload file's `[engine]` / `[cache]` tables, overridden by the CLI;
unknown keys and wrong types raise `ValueError` naming the table and key.

[cache]  tokens_per_block, primary_blocks, secondary_blocks (per window), max_seq_len,
         enable_block_reuse, enable_partial_reuse, copy_on_partial_reuse, onboard_blocks,
         secondary_offload_min_priority, event_buffer_max_size (the ledger's KV-event queue;
         0 = events off unless the engine publishes them, which sizes it itself), event_hash
         (the events' block hashes: "sha256" or TensorRT-LLM's "trtllm64"), kv_cache_dtype
         ("auto": the model's dtype; "float32", "bfloat16", "float16", or "float8_e4m3fn" /
         "fp8" for FP8 pools with per-block scales, "float8_e5m2"), snapshot_interval (hybrid
         models only: tokens between recurrent-state snapshots, a multiple of tokens_per_block;
         default `default_snapshot_interval`, the step's token budget)
[engine] policy, max_batch_size, max_num_tokens, defer_shared_prefix, queue_policy ("fcfs" or
         "lpm"), max_wait_steps, min_batch_bucket, min_chunk_bucket, min_blocks_bucket,
         prefill_rows, max_steps, rank_check_interval (steps between two comparisons of the
         ranks' ledger digests when a mesh spans processes; see `kvjax.engine.ranks`),
         async_scheduling (true: step n+1 is scheduled and dispatched while step n runs on
         the device; see `kvjax.engine.overlap`)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvjax.config import CacheConfig
from kvjax.engine.batching import Buckets
from kvjax.engine.scheduler import QueuePolicy, SchedulerConfig, SchedulerPolicy

CACHE_DEFAULTS: dict[str, Any] = {
    "tokens_per_block": 16,
    "primary_blocks": 256,
    "secondary_blocks": 0,
    "max_seq_len": None,  # the model's
    "enable_block_reuse": True,
    "enable_partial_reuse": True,
    "copy_on_partial_reuse": True,
    "onboard_blocks": True,
    "secondary_offload_min_priority": 30,
    "event_buffer_max_size": 0,
    "event_hash": "sha256",
    "kv_cache_dtype": "auto",
    "snapshot_interval": None,  # hybrids: tokens between recurrent-state snapshots (default: the step's token budget)
}
_STR_KEYS = {"policy", "queue_policy", "event_hash", "kv_cache_dtype"}
#: `kv_cache_dtype` values: "auto" keeps the model's dtype; "fp8" names e4m3 (as vLLM's flag does).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "float32": "float32", "bfloat16": "bfloat16",
                   "float16": "float16", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
_BOOL_KEYS = {"enable_block_reuse", "enable_partial_reuse", "copy_on_partial_reuse", "onboard_blocks", "defer_shared_prefix",
              "async_scheduling"}


def _check_keys(table: str, values: Mapping[str, Any], known, source: str) -> None:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{source}: [{table}] unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    for k, v in values.items():
        if k in _BOOL_KEYS:
            if not isinstance(v, bool):
                raise ValueError(f"{source}: [{table}] {k} must be true or false, got {v!r}")
        elif k not in _STR_KEYS and v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{source}: [{table}] {k} must be an int, got {v!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Scheduler policy and budgets, shape buckets, a safety cap on steps, and how often ranks
    spanning processes compare their ledgers."""

    scheduler: SchedulerConfig = SchedulerConfig()
    buckets: Buckets = Buckets()
    max_steps: int = 1_000_000
    rank_check_interval: int = 1
    async_scheduling: bool = False  # overlap step n+1's host work with step n's device work (kvjax.engine.overlap)

    KEYS = ("policy", "max_batch_size", "max_num_tokens", "defer_shared_prefix", "queue_policy", "max_wait_steps",
            "min_batch_bucket", "min_chunk_bucket", "min_blocks_bucket", "prefill_rows", "max_steps",
            "rank_check_interval", "async_scheduling")

    def __post_init__(self) -> None:
        v = self.rank_check_interval
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"rank_check_interval must be a positive int, got {v!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true or false, got {self.async_scheduling!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "<engine>") -> EngineConfig:
        _check_keys("engine", values, cls.KEYS, source)
        v = dict(values)
        try:
            sched = SchedulerConfig(
                policy=SchedulerPolicy.parse(v.get("policy", SchedulerPolicy.GUARANTEED_NO_EVICT)),
                max_batch_size=v.get("max_batch_size", SchedulerConfig.max_batch_size),
                max_num_tokens=v.get("max_num_tokens", SchedulerConfig.max_num_tokens),
                defer_shared_prefix=v.get("defer_shared_prefix", True),
                queue_policy=QueuePolicy.parse(v.get("queue_policy", QueuePolicy.FCFS)),
                max_wait_steps=v.get("max_wait_steps", SchedulerConfig.max_wait_steps),
            )
            buckets = Buckets(
                min_batch=v.get("min_batch_bucket", Buckets.min_batch),
                min_chunk=v.get("min_chunk_bucket", Buckets.min_chunk),
                min_blocks=v.get("min_blocks_bucket", Buckets.min_blocks),
                prefill_rows=v.get("prefill_rows", Buckets.prefill_rows),
            )
            max_steps = v.get("max_steps", cls.max_steps)
            if max_steps < 1:
                raise ValueError(f"max_steps must be >= 1, got {max_steps}")
            return cls(sched, buckets, max_steps, v.get("rank_check_interval", cls.rank_check_interval),
                       v.get("async_scheduling", cls.async_scheduling))
        except ValueError as e:
            raise ValueError(f"{source}: [engine] {e}") from None


def default_snapshot_interval(tokens_per_block: int, max_num_tokens: int | None) -> int:
    """A hybrid's default tokens between recurrent-state snapshots: the step's token budget,
    rounded down to whole blocks (at least one). Prefill chunks end at snapshot points, so a
    smaller interval caps how much of a prompt one step computes; a larger one makes prefix
    hits coarser (a hit resumes at a snapshot: a multiple of the interval, or where an earlier
    prompt ended). vLLM's `mamba_block_size` is the same trade-off."""
    budget = max_num_tokens or SchedulerConfig.max_num_tokens
    return tokens_per_block * max(1, budget // tokens_per_block)


def cache_config(
    model_spec, values: Mapping[str, Any], *, max_num_tokens: int | None = None, source: str = "<cache>"
) -> CacheConfig:
    """The run's `CacheConfig`: the model's KV geometry, `CACHE_DEFAULTS` overridden by `values`.

    `max_num_tokens` (the engine's chunk budget) sizes TensorRT-LLM's temporary attention window.
    """
    _check_keys("cache", values, CACHE_DEFAULTS, source)
    v = {**CACHE_DEFAULTS, **values}
    if v["kv_cache_dtype"] not in KV_CACHE_DTYPES:
        raise ValueError(f"{source}: [cache] kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {v['kv_cache_dtype']!r}")
    model_len = getattr(model_spec, "max_seq_len", None)
    if v["max_seq_len"] is not None and model_len is not None and v["max_seq_len"] > model_len:
        # as vLLM refuses a max_model_len above the derived one: positions past it were never trained
        raise ValueError(f"{source}: [cache] max_seq_len={v['max_seq_len']} exceeds the model's {model_len} "
                         f"(its max_position_embeddings); use max_seq_len <= {model_len} "
                         f"(--max-seq-len / --max-model-len on the command line)")
    from kvjax.models.hybrid.paged import hybrid_cache_config, is_hybrid_spec

    if not is_hybrid_spec(model_spec) and v["snapshot_interval"] is not None:
        raise ValueError(f"{source}: [cache] snapshot_interval is for hybrid models (recurrent + attention layers)")
    if is_hybrid_spec(model_spec):  # as many state blocks as KV blocks (a snapshot per block at most)
        if v["kv_cache_dtype"] != "auto":
            raise ValueError(f"{source}: [cache] kv_cache_dtype must be 'auto' for a hybrid model")
        interval = v["snapshot_interval"] or default_snapshot_interval(v["tokens_per_block"], max_num_tokens)
        return hybrid_cache_config(
            model_spec, tokens_per_block=v["tokens_per_block"], max_seq_len=v["max_seq_len"] or model_spec.max_seq_len,
            primary_blocks=v["primary_blocks"], state_blocks=v["primary_blocks"],
            secondary_blocks=v["secondary_blocks"], secondary_state_blocks=v["secondary_blocks"],
            **{k: v[k] for k in ("enable_block_reuse", "onboard_blocks", "secondary_offload_min_priority",
                                 "event_buffer_max_size", "event_hash")}, max_num_tokens=max_num_tokens,
            snapshot_interval=interval)
    try:
        return model_spec.cache_config(
            primary_blocks=v["primary_blocks"],
            secondary_blocks=v["secondary_blocks"],
            tokens_per_block=v["tokens_per_block"],
            max_seq_len=v["max_seq_len"],
            enable_block_reuse=v["enable_block_reuse"],
            enable_partial_reuse=v["enable_partial_reuse"],
            copy_on_partial_reuse=v["copy_on_partial_reuse"],
            onboard_blocks=v["onboard_blocks"],
            secondary_offload_min_priority=v["secondary_offload_min_priority"],
            event_buffer_max_size=v["event_buffer_max_size"],
            event_hash=v["event_hash"],
            dtype=KV_CACHE_DTYPES[v["kv_cache_dtype"]],
            max_num_tokens=max_num_tokens,
        )
    except ValueError as e:
        raise ValueError(f"{source}: [cache] {e}") from None
