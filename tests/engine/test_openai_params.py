"""The OpenAI / vLLM request parameters at the engine level, on the micro model: penalties and
min_tokens against a dense reference, logprobs and prompt logprobs equal to the dense
forward's log-softmax, n completions sharing one prompt, stop reasons."""
import jax
import numpy as np
import pytest
from engine_helpers import ROOMY, cache, engine_config
from test_llm_engine import OPTIONS, drain, prompts

from kvjax import LLM, SamplingParams, Tokenizer
from kvjax.engine import Engine, LLMEngine


@pytest.fixture(scope="module")
def tok(micro):
    return Tokenizer.builtin(micro.model.spec.vocab_size)


def make_engine(micro, tok=None, **cache_kw) -> LLMEngine:
    return LLMEngine(Engine(micro.model, engine_config(), runner=micro.runner),
                     cache(micro.model, primary=ROOMY, **cache_kw), tokenizer=tok)


def run_one(eng, rid, prompt, params):
    eng.add_request(rid, prompt, params)
    outs = drain(eng)[rid]
    assert outs[-1].finished
    eng.core.verify_idle()
    return outs[-1]


def dense_logits(micro, tokens) -> np.ndarray:
    """float32 [len(tokens), V]: the dense forward's logits at every position (run on 128
    tokens, zero-padded at the end: causal, so the padding changes nothing, and every test
    shares one compilation)."""
    padded = np.zeros((1, 128), np.int32)
    padded[0, : len(tokens)] = tokens
    return np.asarray(micro.dense_forward(padded))[0, : len(tokens)]


def log_softmax(x):
    return np.asarray(jax.nn.log_softmax(np.asarray(x, np.float32), axis=-1))


def test_penalties_and_min_tokens_match_a_dense_reference(micro):
    """Greedy with presence / frequency / repetition penalties and min_tokens: every token is
    the argmax of vLLM's penalised logits of the dense forward (repetition over prompt +
    output, frequency / presence over the output), the stop tokens masked before min_tokens."""
    eng = make_engine(micro)
    prompt = prompts(1, seed=21, lo=20, hi=21)[0]
    plain = run_one(eng, "plain", prompt, SamplingParams(max_tokens=10)).outputs[0].token_ids
    stop = {plain[0], plain[1]}  # the tokens plain greedy starts with: masked until min_tokens
    params = SamplingParams(max_tokens=10, presence_penalty=0.7, frequency_penalty=1.5, repetition_penalty=1.6,
                            min_tokens=3, stop_token_ids=tuple(sorted(stop)), ignore_eos=True)
    out = run_one(eng, "pen", prompt, params).outputs[0]
    toks = out.token_ids
    logits = dense_logits(micro, prompt + toks)
    differs = False
    for j, t in enumerate(toks):
        x = logits[len(prompt) + j - 1].astype(np.float64)
        counts = np.bincount(toks[:j], minlength=x.size)
        seen = counts > 0
        seen_any = seen.copy()
        seen_any[prompt] = True
        x = np.where(seen_any, np.where(x > 0, x / 1.6, x * 1.6), x) - 1.5 * counts - 0.7 * seen
        if j < 3:
            x[list(stop)] = -np.inf
        assert t == int(np.argmax(x)), f"token {j}"
        differs |= t != int(np.argmax(logits[len(prompt) + j - 1]))
    assert differs  # the penalties changed the greedy choice somewhere
    assert not stop & set(toks[:3])
    if out.finish_reason == "stop":  # a stop token after min_tokens: it is the stop reason
        assert out.stop_reason == toks[-1] and toks[-1] in stop
    else:
        assert out.finish_reason == "length" and out.stop_reason is None
    # other penalty values, min_tokens and logprobs counts: the same executables
    traces = micro.runner.num_traces
    run_one(eng, "pen2", prompt, SamplingParams(max_tokens=10, presence_penalty=-0.3, frequency_penalty=0.1,
                                                repetition_penalty=0.9, min_tokens=7, stop_token_ids=(plain[2],),
                                                temperature=0.5, top_k=3))
    assert micro.runner.num_traces == traces


def test_stop_token_and_min_tokens_stop_reason(micro):
    eng = make_engine(micro)
    prompt = prompts(1, seed=22, lo=12, hi=13)[0]
    first = run_one(eng, "a", prompt, SamplingParams(max_tokens=4)).outputs[0].token_ids[0]
    out = run_one(eng, "b", prompt, SamplingParams(max_tokens=4, stop_token_ids=(first,))).outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([first], "stop", first)
    out = run_one(eng, "c", prompt, SamplingParams(max_tokens=4, stop_token_ids=(first,), min_tokens=4)).outputs[0]
    assert len(out.token_ids) == 4 and first not in out.token_ids and out.finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")), dict(repetition_penalty=0),
                dict(logprobs=21), dict(prompt_logprobs=-1), dict(n=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_logprobs_are_the_raw_log_softmax(micro, tok):
    """Sampled tokens' logprobs (at temperature 0.8: logprobs stay those of the raw
    distribution), their ranks and the top-N, and the prompt logprobs (the first None), equal
    the dense forward's log-softmax across prefill chunks; a request scoring its prompt reuses
    nothing from the cache."""
    eng = make_engine(micro, tok)
    prompt = prompts(1, seed=23, lo=90, hi=91)[0]  # two prefill chunks (64 + 26 tokens)
    run_one(eng, "warm", prompt, SamplingParams(max_tokens=2))  # the prompt is cached now
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=3, prompt_logprobs=2)
    res = run_one(eng, "lp", prompt, params)
    out = res.outputs[0]
    assert res.num_cached_tokens == 0
    lsm = log_softmax(dense_logits(micro, prompt + out.token_ids))
    assert len(out.logprobs) == len(out.token_ids)
    for j, (t, pos) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = lsm[len(prompt) + j - 1]
        ids = list(pos)
        assert ids[0] == t
        np.testing.assert_allclose(pos[t].logprob, row[t], atol=1e-4)
        assert pos[t].rank == 1 + int((row > row[t]).sum())
        top = np.argsort(-row)[:3].tolist()
        assert ids[1:] == [i for i in top if i != t]  # the token, then the top 3 (once each)
        for i in top:
            np.testing.assert_allclose(pos[i].logprob, row[i], atol=1e-4)
        assert pos[t].decoded_token == tok.decode([t], skip_special_tokens=False)
    total = sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs, strict=True))
    np.testing.assert_allclose(out.cumulative_logprob, total, rtol=1e-6)
    pl = res.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    for p in range(1, len(prompt)):
        row = lsm[p - 1]
        assert next(iter(pl[p])) == prompt[p]
        np.testing.assert_allclose(pl[p][prompt[p]].logprob, row[prompt[p]], atol=1e-4)
        assert set(np.argsort(-row)[:2].tolist()) <= set(pl[p])


def test_n_completions_share_the_prompt(micro, tok):
    """n completions: the first computes the prompt, the others reuse its cached blocks; with
    temperature 0 all are equal; sampled ones are independent and completion i equals the
    n = 1 request with seed + i. Without prefix caching each computes its own prompt."""
    eng = make_engine(micro, tok)
    prompt = prompts(1, seed=24, lo=37, hi=38)[0]
    before = eng.core.counters.reused_prompt_tokens
    greedy = run_one(eng, "g", prompt, SamplingParams(max_tokens=5, n=3))
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert eng.core.counters.reused_prompt_tokens - before >= 2 * (len(prompt) // 8 * 8)
    sampled = run_one(eng, "s", prompt, SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=40, logprobs=0))
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    for i, c in enumerate(sampled.outputs):
        alone = run_one(eng, f"s{i}", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=40 + i)).outputs[0]
        assert c.token_ids == alone.token_ids and len(c.logprobs) == len(c.token_ids)
    off = make_engine(micro, tok, reuse=False)
    res = run_one(off, "o", prompt, SamplingParams(max_tokens=5, n=2))
    assert [c.token_ids for c in res.outputs] == [greedy.outputs[0].token_ids] * 2
    assert off.core.counters.reused_prompt_tokens == 0
    # the offline API, on the same runner
    llm = LLM(micro.model, tokenizer=tok, runner=micro.runner, **OPTIONS)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=5, n=2, logprobs=1), use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [greedy.outputs[0].token_ids] * 2
    assert all(len(p) in (1, 2) for c in out.outputs for p in c.logprobs)
