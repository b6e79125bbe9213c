"""The serving engine: a continuous-batching loop around the kvjax ledger and device pools.

`Engine(model, EngineConfig(...)).run(items, cache_config)` serves a list of `WorkItem`s
(see `workloads.py`) with a `CapacityScheduler` (`scheduler.py`: guaranteed-no-evict or
max-utilisation with pausing), chunked prefill of only the non-reused prompt tokens, bucketed
jitted forwards (`batching.py`, `runner.py`), seeded sampling (`sampling.py`) and per-run
metrics (`metrics.py`).
"""
from kvjax.engine.batching import Buckets, ForwardBatch, Row, build_batch
from kvjax.engine.config import CACHE_DEFAULTS, EngineConfig, cache_config, device_config
from kvjax.engine.engine import Engine, EngineInvariantError, RunResult, identical_outputs, max_logit_difference, min_margin
from kvjax.engine.metrics import RequestRecord, RunMetrics, StepRecord, format_table, plot_runs, write_json
from kvjax.engine.request_state import LiveRequest, Phase
from kvjax.engine.runner import ModelRunner
from kvjax.engine.sampling import SamplingParams, request_seed, sample
from kvjax.engine.scheduler import CapacityScheduler, Schedule, SchedulerConfig, SchedulerPolicy
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
    "Engine",
    "EngineConfig",
    "EngineInvariantError",
    "FewShotWorkload",
    "ForwardBatch",
    "KINDS",
    "LiveRequest",
    "LongDocQAWorkload",
    "ModelRunner",
    "Phase",
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
    "load_workload",
    "max_logit_difference",
    "min_margin",
    "plot_runs",
    "request_seed",
    "sample",
    "workload_from_dict",
    "write_json",
]
