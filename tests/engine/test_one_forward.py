"""One forward per step: a seeded random serving run (arrivals while others decode, so
steps mix decode rows and prefill chunks) runs exactly one forward per step that has work,
gives the dense oracle's greedy tokens, and compiles only shapes of `forward_shapes`, once
each; a padding batch of a shape runs the same program (a warmup); the LM head runs on the
sampled positions only."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import assert_same_tokens, cache, engine_config

from kvjax.engine import Engine, ModelRunner, WorkItem, forward_shapes, padding_step
from kvjax.engine.batching import StepExtras
from kvjax.models import dense_greedy


@pytest.fixture(scope="module")
def served_run(micro):
    """Drive a core step by step: arrivals at random steps, random prompt and output lengths."""
    rng = np.random.default_rng(11)
    runner = ModelRunner(micro.model)  # its own: the shared runner's counts include other files' programs
    # two prefill rows: the group's cap decides (`prefill_fits`: step 1's chunks of 37 and 26 tokens would make a
    # [2, 64] group, over the 64-token budget, a shape outside forward_shapes; the second waits)
    config = engine_config()
    engine = Engine(micro.model, dataclasses.replace(config, buckets=dataclasses.replace(config.buckets, prefill_rows=2)),
                    runner=runner)
    cc = cache(micro.model)
    core = engine.core(cc)
    vocab = micro.model.spec.vocab_size
    arrivals = sorted(int(a) for a in rng.integers(0, 12, 9))
    items = [WorkItem(f"r{i}", tuple(rng.integers(1, vocab, int(rng.integers(3, 70))).tolist()),
                      int(rng.integers(2, 9)), arrival_step=a) for i, a in enumerate(arrivals)]
    shapes0, traces0 = set(runner.shapes), runner.num_traces
    pending = list(items)
    live = {}
    steps = []  # (decode rows, prefill tokens, forwards this step)
    while pending or core.has_unfinished_requests():
        while pending and pending[0].arrival_step <= core.step_index:
            it = pending.pop(0)
            live[it.request_id] = core.add_request(it, seed=0)
        before = runner.num_forwards
        core.step()
        last = core.last_step
        steps.append((last.decode_rows, last.prefill_tokens, runner.num_forwards - before))
    core.verify_idle()
    outputs = {rid: list(r.output) for rid, r in live.items()}
    return engine, cc, core, items, steps, outputs, shapes0, traces0


def test_exactly_one_forward_per_step_with_work(served_run):
    _, _, core, _, steps, _, _, _ = served_run
    c = core.counters
    assert c.computed_prompt_tokens + c.reused_prompt_tokens == c.admitted_prompt_tokens
    assert all(f == (1 if d or p else 0) for d, p, f in steps), steps
    assert any(d and p for d, p, _ in steps)  # steps that mix decode rows and prefill chunks ran
    assert any(d and not p for d, p, _ in steps) and any(p and not d for d, p, _ in steps)


def test_greedy_tokens_equal_the_dense_oracle(served_run, micro):
    _, _, _, items, _, outputs, _, _ = served_run
    want = dense_greedy(micro.model, [list(it.tokens) for it in items], [it.max_new_tokens for it in items],
                        forward=micro.dense_forward)
    assert_same_tokens(outputs, {it.request_id: w for it, w in zip(items, want, strict=True)})


def test_compiles_stay_within_the_documented_shapes(served_run, micro):
    engine, cc, core, _, _, _, shapes0, traces0 = served_run
    runner = engine.runner
    allowed = set(forward_shapes(engine.config, cc))
    assert core.forward_shapes == sorted(allowed)
    assert runner.shapes <= allowed
    assert runner.num_traces - traces0 == len(runner.shapes - shapes0)  # each new shape traced once


def test_a_padding_step_runs_the_same_program(served_run, micro):
    """Warmup: a padding batch of a shape a real step compiled compiles nothing new and
    writes nothing; a padding batch of a new shape compiles it once."""
    engine, cc, _, _, _, _, _, _ = served_run
    runner = engine.runner
    pools = runner.allocate_pools(cc)
    seen = sorted(runner.shapes)[0]
    traces = runner.num_traces
    before = [np.asarray(jnp.copy(a)) for a in pools.primary]
    z = np.zeros(0, np.int32)
    out, pools = runner.run(pools, padding_step(seen, cc), z.astype(np.float32), z.astype(np.float32), z, z)
    assert runner.num_traces == traces and out.tokens.shape == (0,)
    for a, b in zip(before, pools.primary, strict=True):
        np.testing.assert_array_equal(a, np.asarray(jnp.copy(b)))
    fresh = ModelRunner(micro.model)  # every shape is new to it
    new = forward_shapes(engine.config, cc)[-1]
    for _ in range(2):
        _, pools = fresh.run(pools, padding_step(new, cc), z.astype(np.float32), z.astype(np.float32), z, z)
    assert fresh.num_traces == 1 and fresh.shapes == {new}


def test_lm_head_runs_on_the_sampled_positions_only(served_run, micro):
    """The step's program multiplies by the LM head only the rows' last positions; a prefill
    row that scores its prompt needs every position's logits (the check can fail)."""
    engine, cc, _, _, _, _, _, _ = served_run
    runner = engine.runner
    pools = runner.allocate_pools(cc)
    v = micro.model.spec.vocab_size
    shape = next(s for s in forward_shapes(engine.config, cc) if s.decode_rows and s.prefill_rows and s.chunk >= 32)
    text = runner.lower(pools, padding_step(shape, cc)).as_text()
    assert f"tensor<{shape.rows}x{v}xf32>" in text
    assert f"tensor<{shape.tokens}x{v}xf32>" not in text and f"x{shape.chunk}x{v}xf32>" not in text
    scoring = StepExtras(prompt_targets=np.zeros((0, shape.chunk), np.int32))
    text = runner.lower(pools, padding_step(shape, cc), scoring).as_text()
    assert f"tensor<{shape.tokens}x{v}xf32>" in text


def test_prompt_logprobs_of_a_chunk_that_shares_its_forward_with_decode_rows(micro):
    """A request that scores its prompt, admitted while another decodes: its chunks run in the
    same forward as the decode row (the prompt-logprobs program of a mixed shape), and its
    prompt logprobs and greedy tokens still equal the dense forward's."""
    from test_llm_engine import drain
    from test_openai_params import dense_logits, log_softmax, make_engine

    from kvjax import SamplingParams

    eng = make_engine(micro)
    rng = np.random.default_rng(5)
    vocab = micro.model.spec.vocab_size
    background, prompt = rng.integers(1, vocab, 20).tolist(), rng.integers(1, vocab, 80).tolist()
    eng.add_request("bg", background, SamplingParams(max_tokens=12))
    drain(eng, steps=2)  # "bg" decodes from now on
    eng.add_request("lp", prompt, SamplingParams(max_tokens=3, prompt_logprobs=1))
    mixed, outs = 0, {}
    while eng.has_unfinished_requests():
        forwards = micro.runner.num_forwards
        for out in eng.step():
            outs.setdefault(out.request_id, []).append(out)
        last = eng.core.last_step
        assert micro.runner.num_forwards - forwards == 1
        mixed += bool(last.decode_rows and last.prefill_tokens)
    assert mixed == 2  # both chunks of the 80-token prompt (63 + 17 tokens) ran with "bg"'s decode row
    res = outs["lp"][-1]
    assert res.finished and res.num_cached_tokens == 0
    lsm = log_softmax(dense_logits(micro, prompt))
    pl = res.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    for p in range(1, len(prompt)):
        np.testing.assert_allclose(pl[p][prompt[p]].logprob, lsm[p - 1][prompt[p]], atol=1e-4)
    want = dense_greedy(micro.model, [prompt], 3, forward=micro.dense_forward)[0]
    assert list(res.outputs[0].token_ids) == want
