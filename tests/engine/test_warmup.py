"""Warmup (`kvjax.engine.warmup`, `LLM(warmup=...)`, `kvjax serve --warmup`): the chosen step
programs compile before the first request, a request of those shapes then compiles nothing, the
padding steps leave the cache's contents alone (the tokens equal the dense oracle's), and a busy
engine or an unknown level is refused."""
import numpy as np
import pytest
from engine_helpers import BUCKETS, MAX_SEQ_LEN, ROOMY, SECONDARY, TPB

from kvjax import LLM, SamplingParams
from kvjax.engine import EngineBusyError, ModelRunner, WorkItem, forward_shapes
from kvjax.engine.batching import StepShape
from kvjax.engine.warmup import WARMUP_LEVELS, warmup_shapes
from kvjax.models import dense_greedy

OPTIONS = dict(tokens_per_block=TPB, max_seq_len=MAX_SEQ_LEN, primary_blocks=ROOMY, secondary_blocks=SECONDARY,
               max_batch_size=4, max_num_tokens=64, min_batch_bucket=BUCKETS.min_batch,
               min_chunk_bucket=BUCKETS.min_chunk, min_blocks_bucket=BUCKETS.min_blocks, prefill_rows=BUCKETS.prefill_rows)


def test_levels_choose_from_the_runs_shapes():
    shapes = [StepShape(4, 0, 0, 8), StepShape(0, 1, 16, 8), StepShape(0, 2, 16, 8), StepShape(4, 1, 16, 8),
              StepShape(8, 0, 0, 16)]
    assert warmup_shapes(shapes, "none") == []
    assert warmup_shapes(shapes, "all") == shapes
    # decode-only steps and single-chunk prefill-only steps
    assert warmup_shapes(shapes, "common") == [shapes[0], shapes[1], shapes[4]]
    assert WARMUP_LEVELS == ("none", "common", "all")
    with pytest.raises(ValueError, match="warmup must be one of none, common, all, got 'some'"):
        warmup_shapes(shapes, "some")


def test_warmed_up_shapes_never_compile_again_and_the_cache_is_untouched(micro):
    model = micro.model
    runner = ModelRunner(model)  # its own: every program counts here
    llm = LLM(model, runner=runner, warmup="common", **OPTIONS)
    core = llm.llm_engine.core
    every = forward_shapes(core.cfg, core.cache_config)
    common = warmup_shapes(every, "common")
    assert len(every) == 7 and len(common) == 4  # decode [4, 1] + one chunk of 16 / 32 / 64, one table width
    assert llm.warmup.shapes == llm.warmup.traced == len(common) == runner.num_traces
    assert runner.shapes == set(common)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, model.spec.vocab_size, n).tolist() for n in (20, 9, 40)]
    outs = [llm.generate({"prompt_token_ids": p}, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
            for p in prompts]  # one at a time: prefill-only then decode-only steps
    assert runner.num_traces == len(common)  # nothing compiled on first use
    want = dense_greedy(model, prompts, 6, forward=micro.dense_forward)
    assert [list(out.outputs[0].token_ids) for out in outs] == want
    llm.llm_engine.core.verify_idle()
    again = LLM(model, runner=runner, warmup="all", **OPTIONS)  # the rest: the mixed steps
    assert (again.warmup.shapes, again.warmup.traced) == (len(every), len(every) - len(common))


def test_refused_when_busy_or_unknown(micro):
    llm = LLM(micro.model, runner=micro.runner, **OPTIONS)
    assert llm.warmup.shapes == llm.warmup.traced == 0  # the default: none
    core = llm.llm_engine.core
    core.add_request(WorkItem("r", (1, 2, 3), 2), seed=0)
    pools = core.pools
    with pytest.raises(EngineBusyError, match="idle engine"):
        core.warm_up("all")
    assert core.pools is pools
    with pytest.raises(ValueError, match="warmup must be one of"):
        LLM(micro.model, runner=micro.runner, warmup="everything", **OPTIONS)
