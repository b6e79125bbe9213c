"""One bad request never takes `kvjax serve` down: every malformed or out-of-range input gets
a 4xx in OpenAI's error shape naming the parameter, and the server stays healthy and serves
the next request; huge inputs are refused before heavy work and never block the event loop; a
request that fails inside the server fails alone (its blocks freed, the ledger intact); an
engine thread that dies fails its in-flight requests and makes `serve` exit with status 1."""
import json
import socket
import threading
import time

import httpx
import pytest
from server_helpers import MODEL

from kvjax.engine.sampling import SamplingParams
from kvjax.server import ServerConfig
from kvjax.server.launch import serve

BODY_LIMIT = 16 << 20
I32 = 2**31
_HTTP = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def server(stack):
    srv = stack.server(max_pending=8, max_body_bytes=BODY_LIMIT).start()
    yield srv
    srv.stop()
    srv.engine_loop.engine.core.verify_idle()


def cmpl(**fields):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(content="Hi", **fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


def raw(obj) -> bytes:
    return json.dumps(obj).encode()


C, CH = "/v1/completions", "/v1/chat/completions"
# (endpoint, body as JSON-able object or raw bytes, expected param, expected code); all 400
BAD = [
    # numbers beyond the engine's int32 (top_k used to overflow in the step and kill the engine)
    (C, cmpl(top_k=I32), "top_k", "invalid_value"),
    (C, cmpl(top_k=2**63), "top_k", "invalid_value"),
    (C, cmpl(top_k=-2), "top_k", "invalid_value"),
    (C, cmpl(seed=2**63), "seed", "invalid_value"),
    (C, cmpl(seed=-(2**63) - 1), "seed", "invalid_value"),
    (C, cmpl(max_tokens=I32), "max_tokens", "invalid_value"),
    (C, cmpl(max_tokens=I32 - 1), "prompt", "context_length_exceeded"),
    (C, cmpl(max_tokens=True), "max_tokens", "invalid_type"),
    (C, cmpl(stop_token_ids=[I32]), "stop_token_ids", "invalid_value"),
    (C, cmpl(stop_token_ids=[2, 2**70]), "stop_token_ids", "invalid_value"),
    (C, cmpl(stop_token_ids="2"), "stop_token_ids", "invalid_type"),
    (C, cmpl(stop_token_ids=[511, 512]), "prompt", "invalid_value"),  # outside the vocabulary
    (C, cmpl(prompt=[1, I32]), "prompt", "invalid_value"),
    (C, cmpl(prompt=[1, 2**80]), "prompt", "invalid_value"),
    (C, cmpl(prompt=[1, 512]), "prompt", "invalid_value"),
    (C, cmpl(prompt=[True, 2]), "prompt", "invalid_type"),
    (C, cmpl(prompt=[1.5]), "prompt", "invalid_type"),
    (C, cmpl(prompt=[]), "prompt", "invalid_type"),
    (C, cmpl(prompt=None), "prompt", "missing_required_parameter"),
    # non-finite and wrong-typed numbers
    (C, b'{"prompt": "x", "temperature": NaN}', None, "invalid_json"),
    (C, b'{"prompt": "x", "temperature": Infinity}', None, "invalid_json"),
    (C, b'{"prompt": "x", "top_p": -Infinity}', None, "invalid_json"),
    (C, b'{"prompt": "x", "temperature": 1e400}', "temperature", "invalid_type"),
    (C, cmpl(temperature=-0.5), "temperature", "invalid_value"),
    (C, cmpl(top_p=1.5), "top_p", "invalid_value"),
    (C, b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", None, "invalid_json"),
    # strings that are not valid Unicode: a lone UTF-16 surrogate, in any field
    (C, b'{"prompt": "a\\ud800b"}', "prompt", "invalid_unicode"),
    (C, b'{"prompt": "x", "stop": ["\\udfff"]}', "stop", "invalid_unicode"),
    (C, b'{"prompt": "x", "user": "\\ud83d"}', "user", "invalid_unicode"),
    (C, b'{"prompt": "x", "\\ud800": 1}', None, "invalid_unicode"),
    (CH, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages", "invalid_unicode"),
    (CH, b'{"messages": [{"role": "\\ud800", "content": "x"}]}', "messages", "invalid_unicode"),
    (CH, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "messages",
     "invalid_unicode"),
    (C, b'{"prompt": "\xff\xfe"}', None, "invalid_json"),  # invalid UTF-8 bytes
    # structure: non-objects, deep nesting, wrong types
    (C, b'"a string"', None, "invalid_type"),
    (C, b"null", None, "invalid_type"),
    (C, b"42", None, "invalid_type"),
    (C, b"", None, "invalid_json"),
    (C, b"[" * 100_000 + b"]" * 100_000, None, "invalid_json"),  # RecursionError in the decoder
    (C, raw(cmpl(user=None, stream_options=None, logit_bias=json.loads("[" * 40 + "]" * 40))), "logit_bias",
     "invalid_json"),
    (CH, raw(chat(chat_template_kwargs={"x": json.loads("[" * 40 + "]" * 40)})), "chat_template_kwargs", "invalid_json"),
    (C, cmpl(stop={"a": 1}), "stop", "invalid_type"),
    (C, cmpl(stop=["a", 3]), "stop", "invalid_type"),
    (C, cmpl(stop=[""]), "stop", "invalid_type"),
    (C, cmpl(stop=["s"] * 17), "stop", "invalid_type"),
    (C, cmpl(user=5), "user", "invalid_type"),
    (C, cmpl(stream=1), "stream", "invalid_type"),
    (CH, chat(content=5), "messages[0].content", "invalid_type"),
    (CH, {"messages": [None]}, "messages[0]", "invalid_type"),
    (CH, {"messages": [{"role": 3, "content": "x"}]}, "messages[0]", "invalid_type"),
    (CH, {"messages": [{"role": "user", "content": "x", "name": 7}]}, "messages[0].name", "invalid_type"),
    (CH, {"messages": []}, "messages", "invalid_type"),
    (CH, {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "invalid_value"),  # the template refuses it
    # template variables that are the template's own arguments
    (CH, chat(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs", "invalid_value"),
    (CH, chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs", "invalid_value"),
    (CH, chat(chat_template_kwargs={"tokenize": True}), "chat_template_kwargs", "invalid_value"),
    (CH, chat(chat_template_kwargs={"chat_template": "{{ 1 }}"}), "chat_template_kwargs", "invalid_value"),
    (CH, chat(chat_template_kwargs="x"), "chat_template_kwargs", "invalid_type"),
    (CH, chat(max_completion_tokens=I32), "max_completion_tokens", "invalid_value"),
]


def healthy_and_serving(url):
    assert _HTTP.get(url + "/health").status_code == 200
    r = _HTTP.post(url + C, json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def assert_error(r, status, param, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert (err["param"], err["code"]) == (param, code), err
    return err


def test_bad_inputs_get_400_naming_the_parameter_and_the_server_keeps_serving(server):
    core = server.engine_loop.engine.core
    healthy_and_serving(server.url)
    snapshot = core.ledger.snapshot()
    for path, body, param, code in BAD:
        content = body if isinstance(body, bytes) else raw(body)
        r = _HTTP.post(server.url + path, content=content, headers={"content-type": "application/json"})
        err = assert_error(r, 400, param, code)
        assert err["type"] == "invalid_request_error", (body, err)
    assert core.ledger.snapshot() == snapshot  # nothing reached the engine
    healthy_and_serving(server.url)
    core.ledger.verify_integrity()


def test_sampling_params_guard_the_int32_and_int64_ranges():
    for bad in (dict(top_k=I32), dict(max_tokens=I32), dict(stop_token_ids=(I32,)), dict(seed=2**63),
                dict(temperature=float("inf")), dict(temperature=float("nan")), dict(top_k=2**64)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    ok = SamplingParams(top_k=I32 - 1, max_tokens=I32 - 1, stop_token_ids=(I32 - 1,), seed=-(2**63))
    assert ok.top_k == I32 - 1 and ok.seed == -(2**63)


def test_body_and_header_limits(server):
    big = b'{"prompt": "' + b"x" * BODY_LIMIT + b'"}'
    r = _HTTP.post(server.url + C, content=big, headers={"content-type": "application/json"})
    assert_error(r, 413, None, "body_too_large")

    def chunks():  # no content-length: the limit holds while reading
        for _ in range(17):
            yield b"x" * (1 << 20)

    r = _HTTP.post(server.url + C, content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, None, "body_too_large")
    r = _HTTP.post(server.url + C, json=cmpl(), headers={"x-padding": "y" * (100 << 10)})
    assert_error(r, 431, None, "headers_too_large")
    r = _HTTP.post(server.url + C + "?q=" + "z" * (40 << 10), json=cmpl(), headers={"x-padding": "y" * (30 << 10)})
    assert_error(r, 431, None, "headers_too_large")
    healthy_and_serving(server.url)


def _health_latencies(url, busy: threading.Event) -> list[float]:
    """/health round trips while `busy` is set (at least one)."""
    out = []
    with httpx.Client(timeout=30) as c:
        while busy.is_set() or not out:
            t = time.perf_counter()
            assert c.get(url + "/health").status_code == 200
            out.append(time.perf_counter() - t)
            time.sleep(0.02)
    return out


def _while_busy(url, work) -> tuple[list, list[float]]:
    busy = threading.Event()
    busy.set()
    results: list = []

    def run():
        try:
            results.extend(work())
        finally:
            busy.clear()

    t = threading.Thread(target=run)
    t.start()
    latencies = _health_latencies(url, busy)
    t.join(60)
    return results, latencies


def test_huge_prompts_are_refused_before_tokenising_and_never_block_health(server):
    text = "word " * 1_500_000  # 7.5 MB

    def work():
        with httpx.Client(timeout=60) as c:
            return [("prompt", c.post(server.url + C, json=cmpl(prompt=text))),
                    ("messages", c.post(server.url + CH, json=chat(content=text))),
                    ("prompt", c.post(server.url + C, json=cmpl(prompt=[7] * 2_000_000)))]

    t0 = time.perf_counter()
    results, latencies = _while_busy(server.url, work)
    took = time.perf_counter() - t0
    for param, r in results:
        err = assert_error(r, 400, param, "context_length_exceeded")
        assert "--max-model-len" in err["message"]
    assert took < 20 and max(latencies) < 2.0, (took, max(latencies))
    healthy_and_serving(server.url)


def test_tokenising_runs_off_the_event_loop(stack, monkeypatch):
    """With no length bound known for the tokenizer, a long prompt is tokenised in full: in a
    worker thread, without the GIL, while /health answers."""
    monkeypatch.setattr(stack.tokenizer, "max_chars_per_token", lambda: None)
    with stack.server(max_pending=2) as srv:
        text = "some words, " * 50_000  # 600 k characters: seconds of tokenising, longer than the bound

        def work():
            with httpx.Client(timeout=60) as c:
                return [c.post(srv.url + C, json=cmpl(prompt=text))]

        (r,), latencies = _while_busy(srv.url, work)
        assert_error(r, 400, "prompt", "context_length_exceeded")
        assert len(latencies) >= 5 and max(latencies) < 2.0, latencies
    srv.engine_loop.engine.core.verify_idle()


class Poison:
    """Makes the detokenisation of every request whose prompt starts with `MARK` raise."""

    MARK = [9, 9, 9, 9]

    def __init__(self, monkeypatch, tokenizer):
        make = tokenizer.detokenizer

        def detokenizer(prompt_ids=(), skip_special_tokens=True):
            real = make(prompt_ids, skip_special_tokens)
            if list(prompt_ids[:4]) == self.MARK:
                def push(new_ids):
                    raise RuntimeError("injected detokenisation failure")
                real.push = push
            return real

        monkeypatch.setattr(tokenizer, "detokenizer", detokenizer)


def sse_events(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_a_request_that_fails_inside_the_server_fails_alone(stack, server, monkeypatch):
    Poison(monkeypatch, stack.tokenizer)
    loop = server.engine_loop
    core = loop.engine.core
    good_body = {"model": MODEL, "prompt": [3, 1, 4, 1, 5], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = _HTTP.post(server.url + C, json=good_body).json()["choices"][0]
    failed_before = core.counters.finished.get("error", 0)
    bad_body = {"model": MODEL, "prompt": Poison.MARK + [1, 2, 3], "max_tokens": 24, "ignore_eos": True}
    results: dict = {}

    def run(name, body, stream):
        with httpx.Client(timeout=60) as c:
            if stream:
                with c.stream("POST", server.url + C, json={**body, "stream": True}) as r:
                    results[name] = (r.status_code, sse_events(r))
            else:
                r = c.post(server.url + C, json=body)
                results[name] = (r.status_code, r.json())

    threads = [threading.Thread(target=run, args=a) for a in
               (("good", good_body, False), ("good_stream", good_body, True), ("bad", bad_body, False),
                ("bad_stream", bad_body, True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    status, body = results["bad"]
    assert status == 500 and body["error"]["code"] == "request_failed" and body["error"]["type"] == "server_error"
    status, events = results["bad_stream"]
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_failed"
    status, body = results["good"]
    assert status == 200 and body["choices"][0]["text"] == expected["text"]
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 24
    status, events = results["good_stream"]
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected["text"]
    assert core.counters.finished.get("error", 0) == failed_before + 2
    deadline = time.monotonic() + 10
    while loop.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loop.pending == 0
    core.ledger.verify_integrity()
    for w in core.ledger.windows:
        assert core.ledger.num_allocated_blocks(w) == 0  # the failed requests' blocks were freed
    healthy_and_serving(server.url)


def test_a_failing_event_stream_ends_in_band_and_aborts_its_request(server, monkeypatch):
    import kvjax.server.streaming as streaming

    sse = streaming.sse

    def failing_sse(obj):  # only chunks of include_usage streams carry "usage": None
        if obj.get("usage", 0) is None and obj["choices"][0].get("text"):
            raise RuntimeError("injected stream failure")
        return sse(obj)

    monkeypatch.setattr(streaming, "sse", failing_sse)
    counters = server.engine_loop.engine.core.counters
    aborted = counters.finished["abort"]
    body = {"model": MODEL, "prompt": [2, 7, 1, 8], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with _HTTP.stream("POST", server.url + C, json={**body, "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    with _HTTP.stream("POST", server.url + C, json={**body, "max_tokens": 5}) as r:
        ok = sse_events(r)
    assert ok[-1] == "[DONE]" and ok[-2]["choices"][0]["finish_reason"] == "length"
    loop = server.engine_loop
    deadline = time.monotonic() + 10
    while loop.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loop.pending == 0
    assert counters.finished["abort"] == aborted + 1  # the failed stream's request was aborted, not left generating
    healthy_and_serving(server.url)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_engine_fails_in_flight_requests_and_serve_exits_1(stack, monkeypatch):
    engine = stack.engine()
    gate, entered = threading.Event(), threading.Event()

    def broken_step():  # a fault inside the batched step (no request explains it), once the gate opens
        entered.set()
        if not gate.is_set():
            time.sleep(0.01)
            return []
        raise RuntimeError("injected engine fault")

    monkeypatch.setattr(engine.core, "step", broken_step)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    outcome: list = []

    def run():
        try:
            serve(engine, ServerConfig(MODEL, shutdown_timeout=2), host="127.0.0.1", port=port, log_level="critical")
            outcome.append(0)
        except SystemExit as e:
            outcome.append(e.code)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and th.is_alive(), "the server did not start"
        time.sleep(0.05)
    results: dict = {}

    def request(name, stream):
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
        with httpx.Client(timeout=30) as c:
            if stream:
                with c.stream("POST", url + C, json=body) as r:
                    results[name] = (r.status_code, sse_events(r))
            else:
                r = c.post(url + C, json=body)
                results[name] = (r.status_code, r.json())

    clients = [threading.Thread(target=request, args=a) for a in (("plain", False), ("stream", True))]
    for t in clients:
        t.start()
    assert entered.wait(30)
    deadline = time.monotonic() + 10
    while engine.get_num_unfinished_requests() < 2:
        assert time.monotonic() < deadline, "both requests should reach the engine"
        time.sleep(0.02)
    gate.set()
    for t in clients:
        t.join(30)
    th.join(30)
    assert not th.is_alive() and outcome == [1]
    status, body = results["plain"]
    assert status == 500 and body["error"]["code"] == "engine_failed"
    status, events = results["stream"]
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_failed"
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_a_request_whose_output_cannot_be_handed_over_fails_alone(server, monkeypatch):
    loop = server.engine_loop
    deliver = loop._deliver

    def failing_deliver(out, now):  # e.g. a metrics or hand-over bug that hits one request
        if list(out.prompt_token_ids[:4]) == Poison.MARK:
            raise RuntimeError("injected hand-over failure")
        return deliver(out, now)

    monkeypatch.setattr(loop, "_deliver", failing_deliver)
    results: dict = {}

    def run(name, prompt):
        with httpx.Client(timeout=60) as c:
            results[name] = c.post(server.url + C, json={"model": MODEL, "prompt": prompt, "max_tokens": 30,
                                                         "temperature": 0, "ignore_eos": True})

    threads = [threading.Thread(target=run, args=("bad", Poison.MARK + [5])), threading.Thread(target=run, args=("good", [5, 8]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert_error(results["bad"], 500, None, "request_failed")
    assert results["good"].status_code == 200 and results["good"].json()["usage"]["completion_tokens"] == 30
    deadline = time.monotonic() + 10
    while loop.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    core = loop.engine.core
    assert loop.pending == 0 and not core.has_unfinished_requests()
    core.ledger.verify_integrity()
    for w in core.ledger.windows:
        assert core.ledger.num_allocated_blocks(w) == 0
    healthy_and_serving(server.url)


def test_the_tokenizer_length_bound_holds_and_is_withheld_when_text_may_vanish():
    import glob
    import random

    from tokenizers import Tokenizer as Backend
    from tokenizers import models, normalizers, pre_tokenizers

    from kvjax import Tokenizer

    rng = random.Random(0)
    alphabet = "ab cdé✓\n\t<|bos|>日本語😀"
    tokenizers = [Tokenizer.builtin(512)] + [Tokenizer.from_pretrained(d) for d in sorted(glob.glob("tests/fixtures/hf/*/"))]
    for tok in tokenizers:
        per = tok.max_chars_per_token()
        assert per is not None and per >= 1
        for n in (1, 100, 9000):  # 9000: past the length encoded without the GIL
            text = "".join(rng.choice(alphabet) for _ in range(n))
            ids = tok.encode(text, add_special_tokens=False)
            assert ids == list(tok.backend.encode(text, add_special_tokens=False).ids)
            assert len(ids) >= -(-len(text) // per)
    byte_vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    bpe = Backend(models.BPE(vocab={**byte_vocab, "ĠĠab": 256}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert Tokenizer(bpe).max_chars_per_token() == 4
    for setup in (lambda b: setattr(b, "normalizer", normalizers.Strip()),
                  lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.WhitespaceSplit())):
        b = Backend(models.BPE(vocab={"a": 0, "b": 1}, merges=[], unk_token="a"))
        setup(b)
        assert Tokenizer(b).max_chars_per_token() is None  # "   " may become no token at all
    partial = Backend(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))  # no unk: "c" is dropped
    assert Tokenizer(partial).encode("ccc") == [] and Tokenizer(partial).max_chars_per_token() is None
    fused = Backend(models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    assert Tokenizer(fused).max_chars_per_token() is None
    assert Tokenizer(Backend(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))).max_chars_per_token() is None
