"""`kvjax serve` in this process on 127.0.0.1, driven by the official `openai` client:
completions, chat, streaming, concurrent clients sharing a system prompt (reuse shows in
/metrics), disconnects that abort, every kind of bad request (400 with an OpenAI error body,
nothing changed), a full queue (429), prefix-cache resets, and graceful shutdown. Greedy
outputs over HTTP equal the offline API's and the dense reference's."""
import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ENGINE, MODEL, OPTIONS

from kvjax import LLM, SamplingParams
from kvjax.models import dense_greedy

LONG = {"ignore_eos": True}  # long generations must not stop at a sampled EOS


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


_HTTP = httpx.Client(timeout=60)  # one connection pool for the raw requests (a client per call is slow)


def metrics(url) -> dict:
    """/metrics as {(sample name, labels without model_name): value}."""
    out = {}
    for family in text_string_to_metric_families(_HTTP.get(url + "/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def metric(m, name, **labels):
    return m[(name, tuple(sorted(labels.items())))]


def wait_idle(url, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(url)
        if metric(m, "kvjax_num_requests_running") == 0 and metric(m, "kvjax_num_requests_waiting") == 0:
            return m
        time.sleep(0.05)
    raise AssertionError("the server did not become idle")


def dense(stack, ids, n):
    return dense_greedy(stack.model, [ids], n, forward=stack.dense_forward)[0]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _HTTP.get(server.url + "/health").json() == {"status": "ok"}


def test_greedy_outputs_equal_offline_and_dense(stack, server, client):
    llm = LLM(stack.model, tokenizer=stack.tokenizer, runner=stack.runner, **OPTIONS, **ENGINE)
    prompts = ["Hello", "The sky is", "kvjax pages"]  # prompt + 8 tokens <= 16: one dense shape
    offline = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    for prompt, off in zip(prompts, offline, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.text == off.outputs[0].text
        assert choice.token_ids == off.outputs[0].token_ids == dense(stack, off.prompt_token_ids, 8)
        assert choice.prompt_token_ids == off.prompt_token_ids == stack.tokenizer.encode(prompt)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(off.prompt_token_ids), 8)
    # token-id prompts too
    ids = stack.tokenizer.encode("ids")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == dense(stack, ids, 6)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    off = llm.chat(messages, SamplingParams(max_tokens=8), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == off.outputs[0].text
    assert r.choices[0].token_ids == off.outputs[0].token_ids  # (offline == dense: tests/engine)
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    llm.llm_engine.core.verify_idle()


def test_streaming(server, client):
    full = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Stream me", max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    msgs = [{"role": "user", "content": "Stream a chat"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=9, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"
    # raw SSE: data lines, [DONE] last
    with _HTTP.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": "raw", "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: {") for line in lines[:-1])


def test_concurrent_clients_share_a_system_prompt(stack, server, client):
    system = "You are the kvjax test assistant. Answer in one short line, and never mention the weather. " * 2
    n_system = len(stack.tokenizer.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False,
                                                        tokenize=True))
    wait_idle(server.url)
    before = metrics(server.url)

    def ask(question):
        return client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])

    first = ask("What is a KV cache?")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        later = list(pool.map(ask, ["Why page it?", "What is a block?", "Who evicts?", "What is reuse?"]))
    after = wait_idle(server.url)
    full_blocks = (n_system // 8) * 8  # tokens of whole blocks of the system prompt
    assert full_blocks >= 32
    assert first.usage.prompt_tokens_details.cached_tokens < full_blocks
    for r in later:
        assert r.usage.prompt_tokens_details.cached_tokens >= full_blocks
    reused = metric(after, "kvjax_prompt_tokens_reused_total") - metric(before, "kvjax_prompt_tokens_reused_total")
    assert reused >= 4 * full_blocks
    assert reused == sum(r.usage.prompt_tokens_details.cached_tokens for r in [first, *later])
    computed = metric(after, "kvjax_prompt_tokens_computed_total") - metric(before, "kvjax_prompt_tokens_computed_total")
    assert computed + reused == sum(r.usage.prompt_tokens for r in [first, *later])
    assert metric(after, "kvjax_prefix_cache_hit_rate") > 0
    assert metric(after, "kvjax_time_to_first_token_seconds_count") >= 5
    assert metric(after, "kvjax_inter_token_latency_seconds_count") > 0


class StepGate:
    """Holds the engine thread before each step until the test grants it: a client's
    disconnect, or a shutdown's timeout, then reaches the engine while its request still runs,
    however fast the machine (ungated, a fast machine finished 200 tokens inside a 0.5 s
    client timeout)."""

    def __init__(self, monkeypatch, loop):
        self.loop = loop
        self.permits = threading.Semaphore(0)
        self.free = False  # steps run without a grant
        self.aborted = threading.Event()
        engine = loop.engine
        step, abort = engine.step, loop.abort

        def gated_step():
            if not self.free and not self.permits.acquire(timeout=30):
                raise AssertionError("the test never granted the engine a step")
            return step()

        def recorded_abort(request_id):
            abort(request_id)
            self.aborted.set()

        monkeypatch.setattr(engine, "step", gated_step)
        monkeypatch.setattr(loop, "abort", recorded_abort)

    def allow(self, steps):
        self.permits.release(steps)

    def open_when(self, ready, what, timeout=20.0):
        """Wait for `ready()`, then let the engine run freely."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)
        self.free = True
        self.allow(1)  # wakes a step already waiting

    def open_after_abort(self):
        """Open once the server has queued the abort, and wait for the aborted request to
        finish (the metrics' gauges are stale while a step waits)."""
        self.open_when(self.aborted.is_set, "the server to abort the request")
        self.aborted.clear()
        deadline = time.monotonic() + 20
        while self.loop.pending:
            assert time.monotonic() < deadline, "the aborted request never finished"
            time.sleep(0.01)

    def close(self):
        """Gate the steps again (call while the engine is idle: no step is waiting)."""
        self.free = False
        self.permits = threading.Semaphore(0)


def test_disconnect_aborts_and_frees(server, client, monkeypatch):
    before = wait_idle(server.url)
    gate = StepGate(monkeypatch, server.engine_loop)
    gate.allow(4)  # enough for two streamed tokens; the rest wait for the disconnect
    stream = client.completions.create(model=MODEL, prompt="Talk for a long time", max_tokens=200, temperature=0,
                                       stream=True, extra_body=LONG)
    it = iter(stream)
    next(it), next(it)
    stream.close()  # the client goes away mid-stream
    gate.open_after_abort()
    after = wait_idle(server.url)
    assert metric(after, "kvjax_requests_finished_total", finish_reason="abort") == \
        metric(before, "kvjax_requests_finished_total", finish_reason="abort") + 1
    generated = metric(after, "kvjax_generation_tokens_total") - metric(before, "kvjax_generation_tokens_total")
    assert 2 <= generated < 200
    assert metric(after, "kvjax_kv_blocks_used", tier="primary") == 0
    # a non-streaming client that times out is aborted too: no step runs before its timeout
    gate.close()
    with pytest.raises(httpx.TimeoutException):
        _HTTP.post(server.url + "/v1/completions", timeout=0.5,
                   json={"model": MODEL, "prompt": "Wait for me", "max_tokens": 200, "temperature": 0, **LONG})
    gate.open_after_abort()
    after2 = wait_idle(server.url)
    assert metric(after2, "kvjax_requests_finished_total", finish_reason="abort") == \
        metric(after, "kvjax_requests_finished_total", finish_reason="abort") + 1
    assert metric(after2, "kvjax_generation_tokens_total") - metric(after, "kvjax_generation_tokens_total") < 200
    assert metric(after2, "kvjax_kv_blocks_used", tier="primary") == 0
    server.engine_loop.engine.core.verify_idle()  # the engine thread is idle: its ledger is at rest


BAD_BODIES = [
    ({"model": "gpt-4", "prompt": "x"}, "model", "model_not_found"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 1.5}, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "10"}, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": "x" * 600}, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 300}, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": 12}, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": ""}, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": [1, 2, 600]}, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
    ({"model": MODEL}, "prompt", "missing_required_parameter"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "top_k": -5}, "top_k", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "stop": [1]}, "stop", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", "invalid_type"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [512]}, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": -3}, "frequency_penalty", "invalid_value"),
    ({"model": MODEL, "prompt": "x", "best_of": 2}, "best_of", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "x", "foo": 1}, "foo", "unknown_parameter"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ([{"model": MODEL}], None, "invalid_type"),
]
BAD_CHAT = [
    ({"model": MODEL, "messages": "hi"}, "messages", "invalid_type"),
    ({"model": MODEL, "messages": []}, "messages", "invalid_type"),
    ({"model": MODEL, "messages": [{"content": "x"}]}, "messages[0]", "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}, "messages", "context_length_exceeded"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, "max_tokens", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools",
     "unsupported_parameter"),
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, "model", "model_not_found"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs", "invalid_type"),
]


def test_bad_requests_get_400_and_change_nothing(server, client):
    wait_idle(server.url)
    core = server.engine_loop.engine.core
    snapshot, generated = core.ledger.snapshot(), core.counters.generated_tokens
    before = metrics(server.url)
    for path, cases in (("/v1/completions", BAD_BODIES), ("/v1/chat/completions", BAD_CHAT)):
        for body, param, code in cases:
            r = _HTTP.post(server.url + path, json=body, timeout=30)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert (err["param"], err["code"]) == (param, code), (body, err)
    for raw in (b'{"model": "micro", "prompt": ', b"not json", b"\xff\xfe"):
        r = _HTTP.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # the openai client raises its typed errors
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="unknown", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 600}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    r = _HTTP.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = _HTTP.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    after = metrics(server.url)
    assert core.ledger.snapshot() == snapshot and core.counters.generated_tokens == generated
    rejected = metric(after, "kvjax_requests_rejected_total", reason="invalid") - metric(
        before, "kvjax_requests_rejected_total", reason="invalid"
    )
    assert rejected == len(BAD_BODIES) + len(BAD_CHAT) + 3 + 3
    for name in ("kvjax_prompt_tokens_computed_total", "kvjax_generation_tokens_total", "kvjax_num_requests_running"):
        assert metric(after, name) == metric(before, name)


def test_reset_prefix_cache(server, client):
    prompt = "A prompt long enough to fill a few blocks of the cache, twice over, twice over."
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    stream = client.completions.create(model=MODEL, prompt="keep running", max_tokens=200, temperature=0, stream=True,
                                       extra_body=LONG)
    next(iter(stream))
    r = _HTTP.post(server.url + "/reset_prefix_cache")
    assert r.status_code == 409 and r.json()["error"]["code"] == "requests_running"
    stream.close()
    wait_idle(server.url)
    r = _HTTP.post(server.url + "/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["reset"] is True and r.json()["blocks_dropped"] > 0
    third = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(metrics(server.url), "kvjax_prefix_cache_resets_total") >= 1


def _read_stream(url, body, into: list):
    """Read an SSE stream to its end (or until the server closes it), keeping parsed chunks."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    into.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    except httpx.HTTPError as e:
        into.append(e)


def test_queue_full_then_graceful_shutdown(stack, monkeypatch):
    """max_pending=1: a second request gets 429. Shutdown then gives the in-flight stream
    `shutdown_timeout` seconds, aborts it (its stream still ends normally), refuses new
    requests with 503, and leaves the ledger empty. The engine's steps are gated, so the
    stream is still running when the drain gives up on it, on any machine."""
    srv = stack.server(max_pending=1, shutdown_timeout=0.5).start()
    loop = srv.engine_loop
    gate = StepGate(monkeypatch, loop)
    gate.allow(3)  # the first streamed tokens; the rest wait for the drain's timeout
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        chunks: list = []
        body = {"model": MODEL, "prompt": "long", "max_tokens": 240, "temperature": 0, "stream": True, **LONG}
        reader = threading.Thread(target=_read_stream, args=(srv.url, body, chunks))
        reader.start()
        deadline = time.monotonic() + 30
        while not chunks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert chunks, "the first request did not start streaming"
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="second", max_tokens=2)
        assert e.value.status_code == 429 and e.value.code == "queue_full"
        assert metric(metrics(srv.url), "kvjax_requests_rejected_total", reason="queue_full") == 1
    finally:
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        refused = None
        try:
            deadline = time.monotonic() + 20
            while loop.accepting and time.monotonic() < deadline:
                time.sleep(0.01)
            # draining (it waits out its timeout: no step runs), so the socket is still open
            refused = _HTTP.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "late"}, timeout=5)
        finally:
            # the drain queues its abort once its timeout has passed: then the engine may run
            gate.open_when(lambda: loop._commands.qsize() > 0, "the drain to abort the stream")
            stopper.join(60)
            reader.join(60)
    assert not stopper.is_alive() and not reader.is_alive()
    assert refused is not None and refused.status_code == 503
    assert chunks[-1] == "[DONE]"
    finals = [ch["choices"][0]["finish_reason"] for ch in chunks[:-1] if ch["choices"][0]["finish_reason"]]
    assert finals == ["abort"]
    core = loop.engine.core
    core.verify_idle()
    assert core.counters.finished["abort"] == 1 and loop.error is None


def test_shutdown_lets_short_requests_finish(stack):
    srv = stack.server(shutdown_timeout=30).start()
    chunks: list = []
    body = {"model": MODEL, "prompt": "short", "max_tokens": 20, "temperature": 0, "stream": True}
    reader = threading.Thread(target=_read_stream, args=(srv.url, body, chunks))
    reader.start()
    deadline = time.monotonic() + 30
    while not chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.stop()
    reader.join(60)
    assert chunks[-1] == "[DONE]"
    assert [ch["choices"][0]["finish_reason"] for ch in chunks[:-1] if ch["choices"][0]["finish_reason"]] == ["length"]
    srv.engine_loop.engine.core.verify_idle()


def test_async_scheduling_serves_the_same_tokens(stack):
    """A server whose engine overlaps steps (`kvjax serve --async-scheduling`): concurrent
    completions, one ended by a stop string found a step late, get the serial offline
    engine's tokens and texts; the engine ends idle (its last wasted rows read)."""
    llm = LLM(stack.model, tokenizer=stack.tokenizer, runner=stack.runner, **OPTIONS, **ENGINE)
    prompts = ["Hello", "The sky is", "kvjax pages", "overlap"]
    offline = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    text = offline[1].outputs[0].text
    stop = next(text[j : j + 2] for j in range(1, len(text) - 2) if "\ufffd" not in text[j : j + 2])
    stopped = llm.generate(prompts[1], SamplingParams(max_tokens=8, stop=[stop]), use_tqdm=False)[0].outputs[0]
    srv = stack.server(stack.engine(async_scheduling=True)).start()
    try:
        assert srv.engine_loop.engine.core.overlap
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(prompt, stops=None):
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=stops,
                                             extra_body={"return_token_ids": True}).choices[0]

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(ask, p) for p in prompts] + [pool.submit(ask, prompts[1], [stop])]
            got = [f.result() for f in futures]
        for choice, off in zip(got, offline, strict=False):
            assert choice.token_ids == off.outputs[0].token_ids and choice.text == off.outputs[0].text
        assert got[4].text == stopped.text and got[4].finish_reason == "stop"
    finally:
        srv.stop()
    srv.engine_loop.engine.core.verify_idle()


def test_compilations_stay_bounded(stack):
    """Every request of this module ran on at most three executables, one step shape each:
    decode rows [4, 1] alone, a prefill row [1, 64] alone, or both in one forward, one
    block-table width (bucketed shapes; the runner counts traces)."""
    assert {(4, 0, 0, 32), (0, 1, 64, 32)} <= stack.runner.shapes <= {(4, 0, 0, 32), (0, 1, 64, 32), (4, 1, 64, 32)}
    assert stack.runner.num_traces == len(stack.runner.shapes)
