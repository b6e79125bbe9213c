"""Hybrid models (LFM2, Granite-4.0-H, Qwen3.5) through the serving engine: KV pools for their
attention layers, state pools for their recurrent layers, prefix caching of state snapshots.

Greedy tokens equal transformers' (the fixtures' `expected.json`) with reuse on and off; a
request sharing a long prefix reuses up to the last snapshot and decodes the same tokens as
without the cache; prompts are prefilled in chunks cut by the token budget and by the snapshot
points; pools small enough to pause requests (max utilisation) or to offload state blocks to
the host tier and onboard them again keep every token. Every engine compiles its three step
shapes once per module (tight buckets keep the suite's compile time small).
"""
import dataclasses
import json
import pathlib

import pytest

from kvjax.engine import Engine, EngineConfig, SchedulerConfig, SchedulerPolicy, WorkItem
from kvjax.engine.batching import Buckets
from kvjax.engine.hybrid_runner import HybridServingError
from kvjax.errors import InvalidArgumentError
from kvjax.models import from_pretrained
from kvjax.models.hybrid.paged import hybrid_cache_config

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf_hybrid"
TPB, MAX_SEQ_LEN = 8, 128
BUCKETS = Buckets(min_batch=4, min_chunk=16, min_blocks=MAX_SEQ_LEN // TPB, prefill_rows=1)


def config(policy=SchedulerPolicy.GUARANTEED_NO_EVICT) -> EngineConfig:
    return EngineConfig(SchedulerConfig(policy=policy, max_batch_size=4, max_num_tokens=16), BUCKETS)


def expected(family: str) -> dict:
    return json.loads((FIXTURES / family / "expected.json").read_text())


@pytest.fixture(scope="module")
def lfm2():
    model = from_pretrained(FIXTURES / "lfm2", dtype="float32")
    return model, Engine(model, config())


def cache(model, *, reuse=True, interval=None):
    """16 KV blocks (a request holds up to 7: two or three fit), 16 state blocks, host tiers of
    24 each: one geometry for every LFM2 run (`kvjax.LLM` and `kvjax serve` below build the same
    from their options), so they share compiled programs."""
    return hybrid_cache_config(model, tokens_per_block=TPB, max_seq_len=MAX_SEQ_LEN, primary_blocks=16, state_blocks=16,
                               secondary_blocks=24, secondary_state_blocks=24, enable_block_reuse=reuse,
                               snapshot_interval=interval)


def fixture_items(exp: dict, arrivals=None) -> list[WorkItem]:
    arrivals = arrivals or [0] * len(exp["prompts"])
    return [WorkItem(f"p{i}", tuple(p), len(g), arrival_step=a)
            for i, (p, g, a) in enumerate(zip(exp["prompts"], exp["greedy"], arrivals, strict=True))]


def assert_transformers_tokens(result, exp: dict, label: str) -> None:
    for i, want in enumerate(exp["greedy"]):
        assert result.outputs[f"p{i}"] == want, f"{label} p{i}: {result.outputs[f'p{i}']} != transformers {want}"


def run_checked(engine: Engine, items, cc, label: str):
    result = engine.run(items, cc, label=label)  # Engine.run ends with verify_idle (integrity included)
    result.ledger.verify_integrity()
    return result


@pytest.mark.parametrize("family", ["granite-rope", "qwen3_5-tied"])
def test_greedy_tokens_match_transformers(family):
    """Mamba2 + attention (RoPE, biases) and gated DeltaNet + gated attention, prompts of 26-75
    tokens prefilled in 16-token chunks cut at snapshot points, one request at a time (two step
    programs: the mixed decode + prefill program is LFM2's to test, it costs compile time)."""
    model = from_pretrained(FIXTURES / family, dtype="float32")
    exp = expected(family)
    cc = hybrid_cache_config(model, tokens_per_block=TPB, max_seq_len=MAX_SEQ_LEN, primary_blocks=64, state_blocks=32)
    one = EngineConfig(SchedulerConfig(max_batch_size=1, max_num_tokens=16), dataclasses.replace(BUCKETS, min_batch=1))
    result = run_checked(Engine(model, one), fixture_items(exp), cc, family)
    assert_transformers_tokens(result, exp, family)
    assert result.metrics.compilations == 2


def test_lfm2_reuse_on_and_off_match_transformers_and_a_shared_prefix_is_reused(lfm2):
    """Reuse on and off give transformers' tokens; a later request extending p0's prompt reuses
    up to p0's last snapshot before they diverge; prompts served again after their blocks were
    evicted to the host tier onboard them (KV and state blocks) and decode the same tokens."""
    model, engine = lfm2
    exp = expected("lfm2")
    p0 = list(exp["prompts"][0])  # 31 tokens: snapshots at 16 (the interval) and 24 (its last block boundary)
    follow = WorkItem("q", tuple(p0 + [7, 9, 11, 13, 15]), 10, arrival_step=40)  # after p0 finished
    again = [WorkItem(f"again{i}", tuple(p), len(g), arrival_step=70 + 3 * i)
             for i, (p, g) in enumerate(zip(exp["prompts"], exp["greedy"], strict=True))]
    items = [*fixture_items(exp, [0, 2, 3, 5]), follow, *again]
    on = run_checked(engine, items, cache(model, interval=16), "reuse on")
    off = run_checked(engine, items, cache(model, reuse=False), "reuse off")
    for result, label in ((on, "reuse on"), (off, "reuse off")):
        assert_transformers_tokens(result, exp, label)
        for i, want in enumerate(exp["greedy"]):
            assert result.outputs[f"again{i}"] == want, f"{label} again{i}"
    assert on.outputs == off.outputs
    reused = {r.request_id: r.reused_tokens for r in on.metrics.requests}
    assert reused["q"] == 24  # p0's last snapshot before the prompts diverge (at 31)
    assert sum(reused[f"again{i}"] for i in range(4)) > 0
    assert all(r.reused_tokens == 0 for r in off.metrics.requests)
    s = on.metrics.summary()
    assert s["blocks_offloaded"] > 0 and s["blocks_onboarded"] > 0
    assert on.metrics.compilations + off.metrics.compilations <= 3


def test_lfm2_max_utilization_pauses_keep_the_tokens(lfm2):
    """Max utilisation on a pool too small for four requests pauses generating requests and
    resumes them from their stored snapshots, tokens unchanged."""
    model, engine = lfm2
    exp = expected("lfm2")
    paused = Engine(model, config(SchedulerPolicy.MAX_UTILIZATION), runner=engine.runner)
    result = run_checked(paused, fixture_items(exp), cache(model), "max utilization")
    assert_transformers_tokens(result, exp, "max utilization")
    assert result.metrics.summary()["pauses"] > 0
    assert result.metrics.compilations == 0  # the same shapes and pools as the other LFM2 runs


def test_lfm2_two_prefill_rows_beside_decode_rows_match_transformers(lfm2):
    """prefill_rows=2 (a 32-token budget: two 16-token rows): p2 and p3 prefill in one group
    (chunks of 8 and 5 tokens at positions 16 / 24 and 0 / 8, each cut at its snapshot points)
    while p0 decodes; every request's tokens are transformers' with reuse off and on. Short
    outputs for p1, p2 let three requests fit the 16 KV blocks (no eviction)."""
    from kvjax.engine.batching import StepShape

    model, engine = lfm2
    exp = expected("lfm2")
    two = Engine(model, EngineConfig(SchedulerConfig(max_batch_size=4, max_num_tokens=32),
                                     dataclasses.replace(BUCKETS, prefill_rows=2)), runner=engine.runner)
    gen = [12, 3, 3, 12]
    items = [WorkItem(f"p{i}", tuple(p), g, arrival_step=a)
             for i, (p, g, a) in enumerate(zip(exp["prompts"], gen, [0, 4, 4, 9], strict=True))]
    mixed = StepShape(4, 2, 16, MAX_SEQ_LEN // TPB)  # decode rows + a prefill group of two rows
    before = set(engine.runner.shapes)
    off = run_checked(two, items, cache(model, reuse=False), "two rows, reuse off")
    assert mixed in engine.runner.shapes and mixed not in before
    on = run_checked(two, items, cache(model), "two rows, reuse on")
    for result in (off, on):
        for i, g in enumerate(gen):
            assert result.outputs[f"p{i}"] == exp["greedy"][i][:g], f"{result.metrics.label} p{i}"
    assert sum(r.reused_tokens for r in on.metrics.requests) > 0
    # max utilisation admits all four (full outputs): the state pool runs out, a decode pauses; a
    # decode's begun step commits between scheduling and the next begin (regression: the
    # scheduler counted no write block for it and begin_recurrent_step ran out of blocks)
    util = Engine(model, dataclasses.replace(two.config, scheduler=dataclasses.replace(
        two.config.scheduler, policy=SchedulerPolicy.MAX_UTILIZATION)), runner=engine.runner)
    paused = run_checked(util, fixture_items(exp, [0, 4, 4, 9]), cache(model), "two rows, max utilization")
    assert_transformers_tokens(paused, exp, "two rows, max utilization")
    assert paused.metrics.summary()["pauses"] > 0


def test_kvjax_run_serves_a_hybrid_checkpoint_with_reuse_on_and_off(lfm2, tmp_path, monkeypatch, capsys):
    """`kvjax run --compare` on the LFM2 checkpoint: the family's spec (no ModelSpec) builds the
    workload and cache, its loader and `HybridRunner` serve it, outputs with reuse on and off
    agree (exit 0) and the later turns reuse the conversation. The run reuses this module's
    runner (same pools and step shapes as the tests above); `_model_and_runner` itself is
    checked to give the checkpoint's model with a `HybridRunner`."""
    import kvjax.cli as cli
    from kvjax.engine.hybrid_runner import HybridRunner
    from kvjax.hybrid_capacity import hybrid_spec

    model, engine = lfm2
    spec = hybrid_spec(FIXTURES / "lfm2")
    loaded, runner = cli._model_and_runner.__wrapped__(spec, 0, str(FIXTURES / "lfm2"))
    assert type(loaded) is type(model) and isinstance(runner, HybridRunner) and runner.model is loaded
    monkeypatch.setattr(cli, "_model_and_runner", lambda spec, seed, checkpoint: (model, engine.runner))
    workload = tmp_path / "chat.toml"
    workload.write_text(
        '[workload]\nkind = "chat"\nseed = 1\nusers = 2\nturns = 2\nsystem_prompts = 1\nsystem_prompt_tokens = 16\n'
        'user_tokens = [4, 8]\nmax_new_tokens = [3, 5]\narrival_interval = 2\nthink_steps = 1\n'
        f"[cache]\ntokens_per_block = {TPB}\nprimary_blocks = 16\nsecondary_blocks = 24\nmax_seq_len = {MAX_SEQ_LEN}\n"
        "[engine]\nmax_batch_size = 4\nmax_num_tokens = 16\nmin_batch_bucket = 4\nmin_chunk_bucket = 16\n"
        "min_blocks_bucket = 16\nprefill_rows = 1\n")
    argv = ["run", "--workload", str(workload), "--model", str(FIXTURES / "lfm2"), "--compare", "--no-progress",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "run-chat.json").read_text())
    assert report["identical_outputs"] and report["model"] == "lfm2"
    on, off = (r["summary"] for r in report["runs"])
    assert on["prefill_computed_tokens"] < off["prefill_computed_tokens"]
    assert "generated tokens identical" in capsys.readouterr().out


def test_hybrid_refusals_are_typed(lfm2):
    model, engine = lfm2
    with pytest.raises(HybridServingError, match="async_scheduling"):
        Engine(model, EngineConfig(async_scheduling=True))
    wrong = cache(model)
    with pytest.raises(InvalidArgumentError, match="recurrent_state_bytes"):
        engine.core(dataclasses.replace(wrong, recurrent_state_bytes=wrong.recurrent_state_bytes + 4))


OPTIONS = dict(dtype="float32", tokens_per_block=TPB, primary_blocks=16, secondary_blocks=24, max_seq_len=MAX_SEQ_LEN,
               max_batch_size=4, max_num_tokens=16, min_batch_bucket=4, min_chunk_bucket=16, min_blocks_bucket=16,
               prefill_rows=1)


def test_llm_reports_num_cached_tokens_from_the_snapshot():
    """`kvjax.LLM` on the checkpoint directory: transformers' tokens; a prompt extending an
    earlier one reports the earlier one's last snapshot as cached and decodes the same tokens
    as with prefix caching off."""
    from kvjax import LLM
    from kvjax.engine import SamplingParams

    exp = expected("lfm2")
    p0 = list(exp["prompts"][0])
    greedy = SamplingParams(max_tokens=12, temperature=0)
    llm = LLM(str(FIXTURES / "lfm2"), **OPTIONS)
    first = llm.generate([p0], greedy)[0]
    longer = llm.generate([p0 + [7, 9, 11]], greedy)[0]
    assert first.outputs[0].token_ids == exp["greedy"][0] and first.num_cached_tokens == 0
    assert longer.num_cached_tokens == 24  # S(24): p0's last block boundary, its last snapshot
    off = LLM(str(FIXTURES / "lfm2"), enable_block_reuse=False, **OPTIONS).generate([p0 + [7, 9, 11]], greedy)[0]
    assert off.num_cached_tokens == 0 and off.outputs[0].token_ids == longer.outputs[0].token_ids


def test_kvjax_serve_answers_an_openai_completion(monkeypatch):
    """`kvjax serve` on the LFM2 checkpoint (no tokenizer: token-id prompts; the default warmup
    compiles its decode and prefill programs), the engine it builds behind the OpenAI server on
    127.0.0.1: a completion of 12 tokens, and the same prompt again reports its cached tokens."""
    import httpx

    import kvjax.server
    from kvjax.cli import main
    from kvjax.server import ServerThread

    seen = {}
    monkeypatch.setattr(kvjax.server, "serve", lambda engine, config, **kw: seen.update(engine=engine, config=config))
    argv = ["serve", str(FIXTURES / "lfm2"), "--dtype", "float32", "--max-batch-size", "4", "--max-num-tokens", "16",
            "--primary-blocks", "16", "--secondary-blocks", "24", "--tokens-per-block", "8", "--max-seq-len", "128",
            "--option", "min_batch_bucket=4", "--option", "min_chunk_bucket=16",
            "--option", "min_blocks_bucket=16", "--option", "prefill_rows=1"]
    assert main(argv) == 0
    runner = seen["engine"].engine.runner
    assert runner.shapes == {(4, 0, 0, 16), (0, 1, 16, 16)}  # the default warmup ("common") ran both programs
    exp = expected("lfm2")
    with ServerThread(seen["engine"], seen["config"]) as srv, httpx.Client(timeout=120) as http:
        body = {"model": seen["config"].model_name, "prompt": exp["prompts"][0], "max_tokens": 12, "temperature": 0}
        first = http.post(srv.url + "/v1/completions", json=body).json()
        again = http.post(srv.url + "/v1/completions", json=body).json()
    for answer in (first, again):
        assert answer["choices"][0]["finish_reason"] == "length"
        assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (31, 12)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 24  # the prompt's last snapshot
