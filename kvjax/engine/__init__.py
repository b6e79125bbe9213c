"""The serving engine: a continuous-batching loop around the kvjax ledger and device pools.

`EngineCore` (`core.py`) is the step-wise loop: `add_request` / `step` / `abort_request` over
one ledger and one set of pools, with a `CapacityScheduler` (`scheduler.py`: guaranteed-no-evict
or max-utilisation with pausing; FCFS or longest-cached-prefix-first queue order), chunked
prefill of only the non-reused prompt tokens, bucketed jitted forwards (`batching.py`,
`runner.py`) and seeded sampling (`sampling.py`). `Engine(model, EngineConfig(...)).run(items,
cache_config)` replays a list of `WorkItem`s (see `workloads.py`) on a fresh core and returns
per-run metrics (`metrics.py`). `LLMEngine` (`llm_engine.py`) adds text: tokenised prompts,
detokenised `RequestOutput`s (`outputs.py`), stop strings and EOS ids from the tokenizer.
"""
from kvjax.engine.batching import Buckets, ForwardBatch, Row, build_batch
from kvjax.engine.config import CACHE_DEFAULTS, EngineConfig, cache_config, device_config
from kvjax.engine.core import CoreOutput, EngineBusyError, EngineCore, EngineInvariantError
from kvjax.engine.engine import Engine, RunResult, identical_outputs, max_logit_difference, min_margin
from kvjax.engine.llm_engine import LLMEngine
from kvjax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvjax.engine.metrics import RequestRecord, RunMetrics, StepRecord, format_table, plot_runs, write_json
from kvjax.engine.request_state import LiveRequest, Phase
from kvjax.engine.runner import ModelRunner
from kvjax.engine.sampling import SamplingParams, key_seed, request_seed, sample
from kvjax.engine.scheduler import CapacityScheduler, QueuePolicy, Schedule, SchedulerConfig, SchedulerPolicy
from kvjax.engine.workloads import (
    KINDS,
    ChatWorkload,
    FewShotWorkload,
    LongDocQAWorkload,
    SharedSystemPromptWorkload,
    WorkItem,
    Workload,
    WorkloadFile,
    load_workload,
    workload_from_dict,
)

__all__ = [
    "Buckets",
    "CACHE_DEFAULTS",
    "CapacityScheduler",
    "ChatWorkload",
    "CompletionOutput",
    "CoreOutput",
    "Engine",
    "EngineBusyError",
    "EngineCore",
    "EngineConfig",
    "EngineInvariantError",
    "FewShotWorkload",
    "ForwardBatch",
    "KINDS",
    "LLMEngine",
    "LiveRequest",
    "LongDocQAWorkload",
    "ModelRunner",
    "Phase",
    "QueuePolicy",
    "RequestMetrics",
    "RequestOutput",
    "RequestRecord",
    "Row",
    "RunMetrics",
    "RunResult",
    "SamplingParams",
    "Schedule",
    "SchedulerConfig",
    "SchedulerPolicy",
    "SharedSystemPromptWorkload",
    "StepRecord",
    "WorkItem",
    "Workload",
    "WorkloadFile",
    "build_batch",
    "cache_config",
    "device_config",
    "format_table",
    "identical_outputs",
    "key_seed",
    "load_workload",
    "max_logit_difference",
    "min_margin",
    "plot_runs",
    "request_seed",
    "sample",
    "workload_from_dict",
    "write_json",
]
