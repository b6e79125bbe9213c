"""The serving engine: a continuous-batching loop around the kvjax ledger and device pools.

`EngineCore` (`core.py`) is the step-wise loop: `add_request` / `step` / `abort_request` over
one ledger and one set of pools, with a `CapacityScheduler` (`scheduler.py`: guaranteed-no-evict
or max-utilisation with pausing; FCFS or longest-cached-prefix-first queue order), chunked
prefill of only the non-reused prompt tokens, one bucketed jitted forward per step (`batching.py`,
`runner.py`) and seeded sampling (`sampling.py`). `Engine(model, EngineConfig(...)).run(items,
cache_config)` replays a list of `WorkItem`s (see `workloads.py`) on a fresh core and returns
per-run metrics (`metrics.py`). `LLMEngine` (`llm_engine.py`) adds text: tokenised prompts,
detokenised `RequestOutput`s (`outputs.py`), stop strings and EOS ids from the tokenizer.
An engine publishes its KV events with `KVEventsConfig` (`event_publishing.py`); on a mesh that
spans processes every process is a rank with its own identical ledger (`ranks.py`).
"""
_NAMES = {
    "Buckets": "kvjax.engine.batching",
    "CACHE_DEFAULTS": "kvjax.engine.config",
    "CapacityScheduler": "kvjax.engine.scheduler",
    "ChatWorkload": "kvjax.engine.workloads",
    "CompletionOutput": "kvjax.engine.outputs",
    "CoreOutput": "kvjax.engine.core_types",
    "Engine": "kvjax.engine.engine",
    "EngineBusyError": "kvjax.engine.core_types",
    "EngineConfig": "kvjax.engine.config",
    "EngineCore": "kvjax.engine.core",
    "EngineInvariantError": "kvjax.engine.core_types",
    "FewShotWorkload": "kvjax.engine.workloads",
    "ForwardBatch": "kvjax.engine.batching",
    "KINDS": "kvjax.engine.workloads",
    "KVEventsConfig": "kvjax.engine.event_publishing",
    "LLMEngine": "kvjax.engine.llm_engine",
    "LiveRequest": "kvjax.engine.request_state",
    "LongDocQAWorkload": "kvjax.engine.workloads",
    "ModelRunner": "kvjax.engine.runner",
    "Phase": "kvjax.engine.request_state",
    "QueuePolicy": "kvjax.engine.scheduler",
    "RankDivergenceError": "kvjax.engine.ranks",
    "RequestMetrics": "kvjax.engine.outputs",
    "RequestOutput": "kvjax.engine.outputs",
    "RequestRecord": "kvjax.engine.metrics",
    "PendingStep": "kvjax.engine.runner",
    "Row": "kvjax.engine.batching",
    "RunMetrics": "kvjax.engine.metrics",
    "RunResult": "kvjax.engine.engine",
    "SamplingParams": "kvjax.engine.sampling",
    "Schedule": "kvjax.engine.scheduler",
    "SchedulerConfig": "kvjax.engine.scheduler",
    "SchedulerPolicy": "kvjax.engine.scheduler",
    "SharedSystemPromptWorkload": "kvjax.engine.workloads",
    "StepBatch": "kvjax.engine.batching",
    "StepOutput": "kvjax.engine.batching",
    "StepRecord": "kvjax.engine.metrics",
    "StepShape": "kvjax.engine.batching",
    "WorkItem": "kvjax.engine.workloads",
    "Workload": "kvjax.engine.workloads",
    "WorkloadFile": "kvjax.engine.workloads",
    "build_batch": "kvjax.engine.batching",
    "build_step": "kvjax.engine.batching",
    "cache_config": "kvjax.engine.config",
    "format_table": "kvjax.engine.metrics",
    "forward_shapes": "kvjax.engine.batching",
    "identical_outputs": "kvjax.engine.engine",
    "key_seed": "kvjax.engine.sampling",
    "load_workload": "kvjax.engine.workloads",
    "max_logit_difference": "kvjax.engine.engine",
    "min_margin": "kvjax.engine.engine",
    "padding_step": "kvjax.engine.batching",
    "plot_runs": "kvjax.engine.metrics",
    "request_seed": "kvjax.engine.sampling",
    "sample": "kvjax.engine.sampling",
    "workload_from_dict": "kvjax.engine.workloads",
    "write_json": "kvjax.engine.metrics",
}


def __getattr__(name: str):
    """Names load on first use, so `kvjax.engine.sampling` (what a router front needs to read
    OpenAI requests) does not import JAX."""
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'kvjax.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = sorted(_NAMES)
