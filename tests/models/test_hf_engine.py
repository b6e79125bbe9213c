"""Checkpoints through the serving engine: greedy tokens identical to transformers' with reuse on
and off, in pools small enough to force eviction, offload / onboard and partial reuse, and (for
Mistral and Gemma 3) prompts and generations well past their 8-token sliding windows.

Each family's prompts share long prefixes (40 tokens, and 21: a partial block); the same prompts
come back later in the run, after their blocks were evicted to the host tier.
"""
import pytest
from hf_helpers import FAMILIES, FIXTURES, SLIDING, expected

from kvjax.engine import Engine, EngineConfig, ModelRunner, SchedulerConfig, cache_config
from kvjax.engine.batching import Buckets
from kvjax.engine.workloads import WorkItem
from kvjax.models import from_pretrained

TPB = 8
MAX_SEQ_LEN = 128
PRIMARY, SECONDARY = 14, 16  # a request holds up to 9 blocks (+1 per sliding window): one or two fit
BUCKETS = Buckets(min_batch=4, min_chunk=16, min_blocks=MAX_SEQ_LEN // TPB, prefill_rows=1)
CONFIG = EngineConfig(SchedulerConfig(max_batch_size=4, max_num_tokens=32), BUCKETS)


def items(prompts: list[list[int]], new_tokens: int) -> list[WorkItem]:
    """Prompt 0 first; 1 (shares 40 tokens) and 2 (shares 21) once 0's prompt is cached; 3 unrelated;
    then all four again after the tier has cycled."""
    arrivals = [0, 6, 10, 1]
    out = [
        WorkItem(f"p{i}", tuple(p), new_tokens, arrival_step=a) for i, (p, a) in enumerate(zip(prompts, arrivals, strict=True))
    ]
    out += [WorkItem(f"again{i}", tuple(p), new_tokens, arrival_step=60 + 3 * i) for i, p in enumerate(prompts)]
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def served(request):
    model = from_pretrained(FIXTURES / request.param, dtype="float32")
    return request.param, model, ModelRunner(model)


def test_engine_greedy_tokens_match_transformers(served):
    family, model, runner = served
    exp = expected(family)
    new = len(exp["greedy"][0])
    want = {f"{k}{i}": g for i, g in enumerate(exp["greedy"]) for k in ("p", "again")}
    engine = Engine(model, CONFIG, runner=runner)
    results = {}
    for reuse in (True, False):
        cfg = cache_config(model.spec, {"tokens_per_block": TPB, "max_seq_len": MAX_SEQ_LEN, "primary_blocks": PRIMARY,
                                        "secondary_blocks": SECONDARY, "enable_block_reuse": reuse}, max_num_tokens=32)
        result = engine.run(items(exp["prompts"], new), cfg, label=f"reuse {reuse}")
        for rid, tokens in want.items():
            assert result.outputs[rid] == tokens, f"{family} reuse={reuse} {rid}: {result.outputs[rid]} != transformers {tokens}"
        result.ledger.verify_integrity()
        results[reuse] = result.metrics.summary()
    on, off = results[True], results[False]
    print(
        family,
        {
            k: on[k]
            for k in (
                "prefill_reused_tokens",
                "blocks_evicted",
                "blocks_offloaded",
                "blocks_onboarded",
                "blocks_reused_partially",
                "blocks_copied",
                "steps",
                "compilations",
            )
        },
    )
    assert off["prefill_reused_tokens"] == 0
    assert on["prefill_reused_tokens"] >= 40 + 16  # p1 and p2 reuse their shared prefix (full blocks at least)
    assert on["blocks_evicted"] > 0 and on["blocks_offloaded"] > 0 and on["blocks_onboarded"] > 0
    assert on["blocks_reused_partially"] + on["blocks_copied"] > 0
    if family in SLIDING:
        assert min(model.spec.layer_windows) == 8
        assert min(len(p) for p in exp["prompts"]) + new > 4 * 8  # prompts and outputs cross the window
