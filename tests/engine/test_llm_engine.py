"""The step-wise engine (`LLMEngine`) and the offline `LLM` on the micro model: requests added
while others run, outputs per step, aborts that free and store blocks, rejection at
`add_request`, stop tokens / strings / EOS, streaming text that only grows, seeded sampling,
LPM vs FCFS end to end, and prefix-cache resets; greedy tokens equal the dense oracle's."""
import itertools

import numpy as np
import pytest
from engine_helpers import BUCKETS, MAX_SEQ_LEN, ROOMY, SECONDARY, TIGHT, TPB, cache, engine_config

from kvjax import LLM, SamplingParams, Tokenizer
from kvjax.engine import Engine, EngineBusyError, LLMEngine
from kvjax.errors import DuplicateRequestError
from kvjax.models import dense_greedy

OPTIONS = dict(tokens_per_block=TPB, max_seq_len=MAX_SEQ_LEN, primary_blocks=ROOMY, secondary_blocks=SECONDARY, max_batch_size=4,
               max_num_tokens=64, min_batch_bucket=BUCKETS.min_batch, min_chunk_bucket=BUCKETS.min_chunk,
               min_blocks_bucket=BUCKETS.min_blocks, prefill_rows=BUCKETS.prefill_rows)


@pytest.fixture(scope="module")
def tok(micro):
    return Tokenizer.builtin(micro.model.spec.vocab_size)


def make_engine(micro, tok=None, *, primary=ROOMY, cache_kw=None, **kw) -> LLMEngine:
    """An engine on the shared runner and the engine tests' pool geometries (ROOMY / TIGHT
    primary blocks, SECONDARY host blocks): no new compilations."""
    return LLMEngine(Engine(micro.model, engine_config(**kw), runner=micro.runner),
                     cache(micro.model, primary=primary, **(cache_kw or {})), tokenizer=tok)


def prompts(n, seed=0, lo=5, hi=40, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def drain(engine, steps=None):
    """Step until idle; per request, the list of outputs it got (in order)."""
    seen = {}
    n = 0
    while engine.has_unfinished_requests() and (steps is None or n < steps):
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        n += 1
    return seen


def dense(micro, ps, max_new):
    """The dense oracle, one prompt at a time (batch-1 shapes only: few compilations)."""
    max_new = [max_new] * len(ps) if isinstance(max_new, int) else max_new
    return [dense_greedy(micro.model, [p], n, forward=micro.dense_forward)[0] for p, n in zip(ps, max_new, strict=True)]


def test_requests_arrive_while_others_run(micro):
    eng = make_engine(micro)
    ps = prompts(6, seed=1)
    seen: dict = {}
    for i, p in enumerate(ps):  # one new request every other step
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=6 + i))
        for _ in range(2):
            for out in eng.step():
                seen.setdefault(out.request_id, []).append(out)
    for rid, outs in drain(eng).items():
        seen.setdefault(rid, []).extend(outs)
    want = dense(micro, ps, [6 + i for i in range(6)])
    for i in range(6):
        outs = seen[f"r{i}"]
        # one output per produced token, cumulative token ids, finished exactly once (the last)
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 7 + i))
        assert [o.finished for o in outs] == [False] * (5 + i) + [True]
        assert outs[-1].outputs[0].token_ids == want[i]
        assert outs[-1].outputs[0].finish_reason == "length" and outs[-1].prompt_token_ids == ps[i]
        assert outs[-1].prompt is None and outs[-1].outputs[0].text == ""  # no tokenizer: no text
    eng.core.verify_idle()


def test_abort_frees_and_stores_blocks(micro):
    eng = make_engine(micro, max_num_tokens=16)  # long prompts take several prefill steps
    long_prompt = prompts(1, seed=2, lo=60, hi=61)[0]
    ps = prompts(4, seed=3)
    eng.add_request("prefilling", long_prompt, SamplingParams(max_tokens=8))
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=20))
    eng.step()
    led = eng.core.ledger
    assert "prefilling" in led and eng.core.running["prefilling"].context_remaining > 0
    before = led.num_allocated_blocks()
    out = eng.abort_request("prefilling")  # mid-prefill: its computed blocks are stored
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert "prefilling" not in led and led.num_allocated_blocks() < before
    assert eng.abort_request("prefilling") is None and eng.abort_request("never-added") is None
    waiting = [r.request_id for r in eng.core.waiting]
    assert waiting, "max_batch_size 4 leaves a request waiting"
    assert eng.abort_request(waiting[0]).outputs[0].finish_reason == "abort"
    for _ in range(4):
        eng.step()
    running = next(r for r in eng.core.running.values() if r.output)
    n_out = len(running.output)
    out = eng.abort_request(running.request_id)  # mid-generation
    assert len(out.outputs[0].token_ids) == n_out and running.request_id not in led
    rest = drain(eng)
    aborted = {"prefilling", waiting[0], running.request_id}
    done = {rid for rid, outs in rest.items() if outs[-1].finished}
    assert done == {f"r{i}" for i in range(4)} - aborted
    idx = sorted(int(r[1:]) for r in done)
    want = dense(micro, [ps[i] for i in idx], 20)
    for i, w in zip(idx, want, strict=True):
        assert rest[f"r{i}"][-1].outputs[0].token_ids == w
    eng.core.verify_idle()
    assert led.stats().used_num_blocks == 0
    # the aborted prefill's stored blocks serve the same prompt later
    eng.add_request("again", long_prompt, SamplingParams(max_tokens=4))
    final = drain(eng)["again"][-1]
    assert final.num_cached_tokens >= 16 and final.outputs[0].token_ids == dense(micro, [long_prompt], 4)[0]
    eng.core.verify_idle()


def test_bad_requests_are_rejected_at_add_request(micro):
    eng = make_engine(micro, primary=TIGHT)
    snap = eng.core.ledger.snapshot()
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        eng.add_request("long", list(range(1, 250)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="needs 27 blocks in window 256 but the cache has 24"):
        eng.add_request("wide", list(range(1, 200)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        eng.add_request("vocab", [1, 2, 600], SamplingParams())
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        eng.add_request("text", "hello", SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.add_request("stop", [1, 2], SamplingParams(stop="x"))
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.add_request("stopid", [1, 2], SamplingParams(stop_token_ids=[512]))
    with pytest.raises(TypeError):
        eng.add_request("bad", [1, 2.5], SamplingParams())
    assert not eng.has_unfinished_requests() and eng.core.ledger.snapshot() == snap
    eng.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        eng.add_request("ok", [4, 5], SamplingParams())
    drain(eng)
    eng.core.verify_idle()


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-1), dict(top_k=-2), dict(stop=[""]),
                                 dict(stop=[1]), dict(stop_token_ids=[-1]), dict(seed="1"), dict(ignore_eos=1)])
def test_sampling_params_errors(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_stop_tokens_strings_and_eos(micro, tok):
    eng = make_engine(micro, tok)
    p = prompts(1, seed=4)[0]
    eng.add_request("free", p, SamplingParams(max_tokens=24))
    free = drain(eng)["free"][-1].outputs[0]
    ids = free.token_ids
    assert free.text == tok.decode(ids) and len(set(ids)) > 4
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # first occurrence at k
    # a stop token id: kept in token_ids, its text left out
    eng.add_request("tok", p, SamplingParams(max_tokens=24, stop_token_ids=[ids[k]]))
    out = drain(eng)["tok"][-1].outputs[0]
    assert out.token_ids == ids[: k + 1] and out.text == tok.decode(ids[:k])
    assert (out.finish_reason, out.stop_reason) == ("stop", ids[k])
    # EOS from the tokenizer (here: a token the model generates), and ignore_eos
    eos_tok = Tokenizer(tok.backend, special_tokens=tok.special_tokens, eos_token_ids=[ids[k]])
    eng2 = make_engine(micro, eos_tok)
    eng2.add_request("eos", p, SamplingParams(max_tokens=24))
    eng2.add_request("ignore", p, SamplingParams(max_tokens=24, ignore_eos=True))
    res = drain(eng2)
    eos, ign = res["eos"][-1].outputs[0], res["ignore"][-1].outputs[0]
    assert eos.token_ids == ids[: k + 1] and (eos.finish_reason, eos.stop_reason) == ("stop", None)
    assert ign.token_ids == ids and ign.finish_reason == "length"
    # a stop string: the text ends before it, the request leaves the engine at once
    text = free.text
    j = next(j for j in range(2, len(text) - 3) if text[j] != "\ufffd" and text.find(text[j : j + 2]) == j)
    stop = text[j : j + 2]
    eng.add_request("str", p, SamplingParams(max_tokens=24, stop=["\x00never", stop]))
    outs = drain(eng)["str"]
    final = outs[-1].outputs[0]
    assert final.text == text[:j] and (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert len(final.token_ids) < len(ids) and ids[: len(final.token_ids)] == final.token_ids
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # streamed text only grows
    assert all(stop not in t for t in texts)
    eng.core.verify_idle()
    eng2.core.verify_idle()


def test_streamed_text_is_stable_and_whole(micro, tok):
    """Byte tokens of multi-byte characters arrive one per step: no piece of streamed text
    ever holds half a character, and the pieces add up to the final text."""
    eng = make_engine(micro, tok)
    eng.add_request("a", "héllo wörld ✓", SamplingParams(max_tokens=40, temperature=1.0, seed=5))
    outs = drain(eng)["a"]
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    final = outs[-1].outputs[0]
    assert final.text == tok.decode(final.token_ids)
    assert outs[-1].prompt == "héllo wörld ✓" and outs[-1].prompt_token_ids == tok.encode("héllo wörld ✓")
    assert any("\ufffd" in tok.decode(final.token_ids[:i]) for i in range(1, len(final.token_ids)))  # splits happened
    assert all("\ufffd" not in t[-1:] for t in texts[:-1])
    eng.core.verify_idle()


def test_seeded_sampling_and_top_k(micro):
    eng = make_engine(micro)
    p = prompts(1, seed=6)[0]
    eng.add_request("a", p, SamplingParams(max_tokens=12, temperature=1.0, seed=7))
    eng.add_request("filler", prompts(1, seed=9)[0], SamplingParams(max_tokens=12, temperature=1.0))
    eng.add_request("b", p, SamplingParams(max_tokens=12, temperature=1.0, seed=7))  # same seed, other batch row
    eng.add_request("c", p, SamplingParams(max_tokens=12, temperature=1.0, seed=8))
    eng.add_request("k1", p, SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3))
    eng.add_request("greedy", p, SamplingParams(max_tokens=12))
    res = {rid: outs[-1].outputs[0].token_ids for rid, outs in drain(eng).items()}
    assert res["a"] == res["b"] != res["c"]
    assert res["k1"] == res["greedy"] == dense(micro, [p], 12)[0]
    eng.core.verify_idle()


def test_lpm_end_to_end(micro):
    """A queue of requests behind two system prompts, admitted one at a time into a cache that
    holds about one of them: LPM serves the cached prompt's requests first and reuses more than
    FCFS, which alternates and evicts; tokens equal the dense oracle's."""
    rng = np.random.default_rng(11)
    systems = [rng.integers(1, 512, 96).tolist() for _ in range(2)]  # 12 blocks each; the cache has 24
    ps = [systems[i % 2] + rng.integers(1, 512, 6).tolist() for i in range(8)]
    reused = {}
    for policy in ("fcfs", "lpm"):
        eng = make_engine(micro, primary=TIGHT, max_batch_size=1, queue_policy=policy,
                          cache_kw=dict(secondary_offload_min_priority=101))  # evict, never offload
        for i, p in enumerate(ps):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=3))
        res = drain(eng)
        order = sorted(res, key=lambda rid: res[rid][-1].metrics.finished_time)
        want = dense(micro, ps, 3)
        for i in range(8):
            assert res[f"r{i}"][-1].outputs[0].token_ids == want[i]
        reused[policy] = eng.core.counters.reused_prompt_tokens
        if policy == "lpm":
            assert order[:4] == ["r0", "r2", "r4", "r6"]  # system 0 stays cached: its requests first
        else:
            assert order == [f"r{i}" for i in range(8)]
        eng.core.verify_idle()
    assert reused["lpm"] > reused["fcfs"]


def test_reset_prefix_cache_refused_while_running(micro):
    eng = make_engine(micro)
    p = prompts(1, seed=12, lo=30, hi=31)[0]
    eng.add_request("a", p, SamplingParams(max_tokens=8))
    eng.step()
    with pytest.raises(EngineBusyError):
        eng.reset_prefix_cache()
    drain(eng)
    assert eng.reset_prefix_cache() > 0
    eng.add_request("b", p, SamplingParams(max_tokens=2))
    assert drain(eng)["b"][-1].num_cached_tokens == 0
    eng.core.verify_idle()


def test_llm_generate(micro, tok):
    llm = LLM(micro.model, tokenizer=tok, runner=micro.runner, **OPTIONS)
    ps = prompts(5, seed=13)
    outs = llm.generate(ps, SamplingParams(max_tokens=7), use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1", "2", "3", "4"]
    want = dense(micro, ps, 7)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.num_cached_tokens == 0 for o in outs)
    # the ledger persists: the same prompts again reuse their cached blocks
    again = llm.generate([{"prompt_token_ids": p} for p in ps], [SamplingParams(max_tokens=7)] * 5, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in again] == want
    assert sum(o.num_cached_tokens for o in again) >= sum(len(p) - 1 for p in ps) - 5 * TPB
    assert llm.reset_prefix_cache() is True
    third = llm.generate(ps[:1], SamplingParams(max_tokens=7), use_tqdm=False)
    assert third[0].num_cached_tokens == 0 and third[0].outputs[0].token_ids == want[0]
    # text prompts and chat go through the tokenizer
    text = llm.generate("Hello, kvjax", SamplingParams(max_tokens=5), use_tqdm=False)[0]
    assert text.prompt == "Hello, kvjax" and text.prompt_token_ids == tok.encode("Hello, kvjax")
    assert text.outputs[0].token_ids == dense(micro, [tok.encode("Hello, kvjax")], 5)[0]
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5), use_tqdm=False)[0]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert chat.prompt_token_ids == ids and chat.outputs[0].token_ids == dense(micro, [ids], 5)[0]
    # one bad prompt: nothing is queued
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        llm.generate([ps[0], list(range(1, 300))], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(ps[:2], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="unknown option"):
        LLM(micro.model, primary_block=3)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.core.verify_idle()
