"""Helpers of the engine tests: micro models (untied: greedy output depends on the
context, so a cache bug changes tokens) and one jitted runner per model, shared by every
engine of a worker so each bucketed shape compiles once.

Geometry used throughout: 8 tokens per block, max_seq_len 256 (32 blocks: one table width),
two pool sizes (ROOMY / TIGHT primary blocks, SECONDARY host blocks), decode batches of 4
rows, prefill chunks of 16 / 32 / 64 tokens one row at a time: a handful of executables.
"""
from kvjax.engine import Engine, EngineConfig, ModelRunner, SchedulerConfig, SchedulerPolicy, cache_config
from kvjax.engine.batching import Buckets
from kvjax.model_spec import ModelSpec
from kvjax.models import Transformer, dense_greedy, jit_dense_forward

TPB = 8
MAX_SEQ_LEN = 256
BUCKETS = Buckets(min_batch=4, min_chunk=16, min_blocks=MAX_SEQ_LEN // TPB, prefill_rows=1)
ROOMY, TIGHT = 96, 24  # primary blocks of the two pool geometries (both with SECONDARY host blocks)
SECONDARY = 32


def engine_config(policy=SchedulerPolicy.GUARANTEED_NO_EVICT, **kw) -> EngineConfig:
    kw = {"max_batch_size": 4, "max_num_tokens": 64, **kw}
    return EngineConfig(SchedulerConfig(policy=policy, **kw), BUCKETS)


def cache(model, *, primary=ROOMY, secondary=SECONDARY, reuse=True, **kw):
    values = {"tokens_per_block": TPB, "max_seq_len": MAX_SEQ_LEN, "primary_blocks": primary,
              "secondary_blocks": secondary, "enable_block_reuse": reuse, **kw}
    return cache_config(model.spec, values, max_num_tokens=64)


class Served:
    """A model with its shared runner; `engine(policy)` builds engines on that runner."""

    def __init__(self, name: str | ModelSpec):
        self.model = Transformer.from_spec(name, seed=0)
        self.runner = ModelRunner(self.model)
        self.dense_forward = jit_dense_forward(self.model)
        self._dense: dict = {}

    def engine(self, policy=SchedulerPolicy.GUARANTEED_NO_EVICT, **kw) -> Engine:
        return Engine(self.model, engine_config(policy, **kw), runner=self.runner)

    def dense(self, result, eos_id=None) -> dict[str, list[int]]:
        """The dense oracle's greedy continuation of every prompt of `result` (same lengths)."""
        ids = sorted(result.outputs)
        key = (tuple(tuple(result.prompts[i]) for i in ids), tuple(len(result.outputs[i]) for i in ids), eos_id)
        if key not in self._dense:
            max_new = [len(result.outputs[i]) for i in ids]
            out = dense_greedy(self.model, [result.prompts[i] for i in ids], max_new, eos_id=eos_id, forward=self.dense_forward)
            self._dense[key] = dict(zip(ids, out, strict=True))
        return self._dense[key]


def check_accounting(result):
    """Prefill computed + reused == admitted prompt tokens; reused == what the ledger reported;
    the ledger is empty and consistent after the run."""
    s = result.metrics.summary()
    assert s["prefill_computed_tokens"] + s["prefill_reused_tokens"] == s["admitted_prompt_tokens"]
    for r in result.metrics.requests:
        assert r.computed_tokens + r.reused_tokens == r.admitted_tokens
    stats = result.ledger.stats()
    assert s["block_hit_rate"] == stats.cache_hit_rate
    assert len(result.ledger) == 0
    assert stats.used_num_blocks == 0
    result.ledger.verify_integrity()
    assert s["accounting_misses"] == 0


def assert_same_tokens(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert list(a[k]) == list(b[k]), f"{k}: {a[k]} != {b[k]}"
