"""`n`, `logprobs`, `echo`, penalties and `stop_reason` through the `openai` client against a
live server on 127.0.0.1 serving the qwen2 checkpoint of tests/fixtures/hf: the logprobs equal
transformers' log-softmax (tests/fixtures/logprobs/qwen2.json, written by
make_logprob_fixtures.py) within 1e-4."""
import json
from pathlib import Path

import numpy as np
import openai
import pytest

from kvjax.engine import LLMEngine
from kvjax.server import ServerConfig, ServerThread

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPECTED = json.loads((FIXTURES / "logprobs" / "qwen2.json").read_text())
MODEL = "qwen2-fixture"
OPTIONS = dict(tokens_per_block=8, max_seq_len=128, primary_blocks=64, secondary_blocks=0, max_batch_size=4,
               max_num_tokens=64, min_batch_bucket=4, min_chunk_bucket=32, min_blocks_bucket=16, prefill_rows=1)
ATOL = 1e-4


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine.from_options(FIXTURES / "hf" / "qwen2", **OPTIONS)
    srv = ServerThread(engine, ServerConfig(MODEL, max_pending=8)).start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield srv, client
    srv.stop()
    srv.engine_loop.engine.core.verify_idle()


def test_the_prompt_tokenises_like_transformers(served):
    srv, _ = served
    tok = srv.engine_loop.engine.tokenizer
    exp = EXPECTED["completion"]
    assert tok.encode(exp["prompt"], add_special_tokens=True) == exp["prompt_ids"]
    chat = EXPECTED["chat"]
    assert tok.apply_chat_template(chat["messages"], add_generation_prompt=True) == chat["text"]


def test_completion_echo_logprobs_n(served):
    """echo + logprobs + n = 2 at temperature 0: both choices are transformers' greedy
    continuation; the prompt's logprobs (the first null) and the generated tokens' equal
    transformers' log-softmax, and each position's top_logprobs hold its token and the 2 most
    likely."""
    srv, client = served
    exp = EXPECTED["completion"]
    tok = srv.engine_loop.engine.tokenizer
    ids, greedy = exp["prompt_ids"], exp["greedy"]
    r = client.completions.create(model=MODEL, prompt=exp["prompt"], echo=True, logprobs=2, n=2, temperature=0,
                                  max_tokens=len(greedy), extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 2 * len(greedy)
    for c in r.choices:
        assert c.token_ids == greedy and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == exp["prompt"] + tok.decode(greedy)
        lp = c.logprobs
        all_ids = ids + greedy
        assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in all_ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], exp["next_logprob"], atol=ATOL)
        assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(lp.tokens))]
        for p in range(1, len(all_ids)):
            want = {tok.decode([all_ids[p]], skip_special_tokens=False): exp["next_logprob"][p - 1]}
            for t, v in zip(exp["top_ids"][p - 1][:2], exp["top_logprobs"][p - 1][:2], strict=True):
                want.setdefault(tok.decode([t], skip_special_tokens=False), v)
            got = lp.top_logprobs[p]
            assert set(got) == set(want)
            np.testing.assert_allclose([got[k] for k in want], list(want.values()), atol=ATOL)
    assert r.choices[0].logprobs == r.choices[1].logprobs


def test_chat_logprobs_and_stop_reason(served):
    srv, client = served
    exp = EXPECTED["chat"]
    n_prompt = len(exp["prompt_ids"])
    greedy = exp["greedy"]
    r = client.chat.completions.create(model=MODEL, messages=exp["messages"], logprobs=True, top_logprobs=3, temperature=0,
                                       max_tokens=len(greedy), extra_body={"ignore_eos": True})
    (c,) = r.choices
    content = c.logprobs.content
    assert len(content) == len(greedy) and c.finish_reason == "length" and c.stop_reason is None
    tok = srv.engine_loop.engine.tokenizer
    for j, (t, entry) in enumerate(zip(greedy, content, strict=True)):
        p = n_prompt + j - 1  # the position whose logits chose token j
        assert entry.token == tok.decode([t], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        np.testing.assert_allclose(entry.logprob, exp["next_logprob"][p], atol=ATOL)
        assert len(entry.top_logprobs) == 3
        np.testing.assert_allclose([x.logprob for x in entry.top_logprobs], exp["top_logprobs"][p][:3], atol=ATOL)
        want = [tok.decode([i], skip_special_tokens=False) for i in exp["top_ids"][p][:3]]
        assert [x.token for x in entry.top_logprobs] == want
    # a stop token: the choice says which
    r = client.chat.completions.create(model=MODEL, messages=exp["messages"], temperature=0, max_tokens=4,
                                       extra_body={"stop_token_ids": [greedy[1]], "ignore_eos": True})
    (c,) = r.choices
    assert (c.finish_reason, c.stop_reason, r.usage.completion_tokens) == ("stop", greedy[1], 2)


def test_streamed_n_matches_the_non_streamed_choices(served):
    """Seeded sampling with n = 3: the streamed chunks, gathered per index, equal the
    non-streamed choices (each completion its own key stream), and they differ."""
    _, client = served
    body = dict(model=MODEL, prompt=EXPECTED["completion"]["prompt"], n=3, temperature=1.0, seed=11, max_tokens=8,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    texts = {c.index: c.text for c in whole.choices}
    assert len(set(texts.values())) > 1
    got: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(stream=True, **body):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished.add(c.index)
    assert got == texts and finished == {0, 1, 2}


def test_penalties_change_a_repetitive_greedy_output(served):
    _, client = served
    exp = EXPECTED["completion"]
    body = dict(model=MODEL, prompt=exp["prompt"], temperature=0, max_tokens=len(exp["greedy"]))
    plain = client.completions.create(**body, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert plain.token_ids == exp["greedy"]  # the fixture's greedy output repeats one token
    pen = client.completions.create(**body, frequency_penalty=2.0, presence_penalty=1.0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.2})
    toks = pen.choices[0].token_ids
    assert len(toks) == len(exp["greedy"]) and toks != exp["greedy"]


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 21}, "logprobs"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"extra_body": {"min_tokens": 20}}, "min_tokens"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
])
def test_bad_values_are_refused(served, body, param):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, **body)
    assert e.value.body["param"] == param


def test_top_logprobs_needs_logprobs(served):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2, max_tokens=2)
    assert e.value.body["param"] == "top_logprobs"


def test_streamed_chat_n_with_logprobs(served):
    """A streamed chat with n = 2: each index gets its role chunk, its deltas with their
    tokens' logprobs and its finish reason; text and logprobs equal the non-streamed ones."""
    _, client = served
    body = dict(model=MODEL, messages=EXPECTED["chat"]["messages"], n=2, temperature=0.8, seed=5, max_tokens=5,
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**body)
    text: dict[int, str] = {}
    lps: dict[int, list] = {}
    roles, finish = set(), {}
    for chunk in client.chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None:
                lps.setdefault(c.index, []).extend(c.logprobs.content)
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert roles == {0, 1} and finish == {0: "length", 1: "length"}
    for c in whole.choices:
        assert text[c.index] == c.message.content
        assert [(x.token, x.logprob) for x in lps[c.index]] == [(x.token, x.logprob) for x in c.logprobs.content]


def test_streamed_echo_with_logprobs(served):
    """A streamed completion with echo + logprobs sends the prompt (with its logprobs, the
    first null) first, then the generated tokens; gathered, they equal the non-streamed choice."""
    _, client = served
    exp = EXPECTED["completion"]
    body = dict(model=MODEL, prompt=exp["prompt"], echo=True, logprobs=1, temperature=0, max_tokens=3,
                extra_body={"ignore_eos": True})
    (whole,) = client.completions.create(**body).choices
    text, tokens, token_lps, offsets = "", [], [], []
    for chunk in client.completions.create(stream=True, **body):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                token_lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text and text.startswith(exp["prompt"])
    assert tokens == whole.logprobs.tokens and token_lps == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset and token_lps[0] is None
