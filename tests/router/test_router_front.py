"""The router front against scripted fake replicas on 127.0.0.1 (no model, no JAX): full or
draining replicas and refused connections are retried elsewhere while nothing was streamed,
dead replicas leave routing at once, a stream that breaks ends with an error event, a client
that leaves closes the replica's request, incompatible replicas are never used, restarts are
noticed and counted (also after the old process died), and every request's load is released."""
import asyncio
import json
import socket
import threading
import time
import uuid

import httpx
import pytest
import uvicorn
from serve_helpers import metric_value, wait_for
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kvjax.router.app import REPLICA_HEADER, RouterConfig
from kvjax.router.launch import RouterThread
from kvjax.router.replicas import connect_endpoint, normalise_url


class FakeReplica:
    """A scripted replica: `mode` decides how /v1/completions answers."""

    def __init__(self, name: str, tokens_per_block: int = 4, hash_kind: str = "sha256", port: int = 0) -> None:
        self.name = name
        self.hash_kind = hash_kind
        self.mode = "ok"
        self.instance_id = uuid.uuid4().hex
        self.tokens_per_block = tokens_per_block
        self.requests = 0
        self.cancelled = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))  # a given port: the same replica URL after a restart
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None

    def app(self) -> Starlette:
        async def info(request):
            return JSONResponse({"instance_id": self.instance_id, "status": "ok", "model": "m", "max_seq_len": 64,
                                 "tokens_per_block": self.tokens_per_block, "hash_kind": self.hash_kind, "kv_events": None,
                                 "tokenizer": None})

        async def completions(request: Request):
            self.requests += 1
            body = await request.json()
            if self.mode in ("503", "429"):
                return JSONResponse({"error": {"message": f"{self.name} says {self.mode}"}}, status_code=int(self.mode))
            if not body.get("stream"):
                return JSONResponse({"choices": [{"text": self.name}]})

            async def events():
                yield b'data: {"choices": [{"text": "a"}]}\n\n'
                if self.mode == "break":
                    raise RuntimeError("replica crashed mid-stream")
                if self.mode == "hang":
                    try:
                        await asyncio.sleep(60)
                    except asyncio.CancelledError:
                        self.cancelled.set()
                        raise
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "m"}]})

        return Starlette(routes=[Route("/kv_events_info", info), Route("/v1/completions", completions, methods=["POST"]),
                                 Route("/v1/models", models)])

    def start(self) -> "FakeReplica":
        self.server = uvicorn.Server(uvicorn.Config(self.app(), log_level="critical", lifespan="off"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        wait_for(lambda: self.server.started, 10, f"{self.name} to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()


@pytest.fixture
def fakes():
    made = []

    def make(n, **kw):
        reps = [FakeReplica(f"f{i}", **kw).start() for i in range(n)]
        made.extend(reps)
        return reps

    yield make
    for r in made:
        if r.server is not None and not r.server.should_exit:
            r.stop()


def router_over(reps, **kw) -> RouterThread:
    cfg = dict(health_interval=60.0, health_timeout=1.0, request_timeout=10.0)
    cfg.update(kw)
    return RouterThread(RouterConfig(tuple(r.url for r in reps), **cfg))  # started by `with`


def post(router, body, **kw):
    return httpx.post(router.url + "/v1/completions", json=body, timeout=20, **kw)


BODY = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_tokens": 2}


def loads(router):
    return dict(router.router.loads)


def test_full_or_draining_replicas_are_retried_elsewhere(fakes):
    a, b = fakes(2)
    with router_over([a, b], policy="round-robin") as router:
        a.mode = "503"
        answers = {post(router, BODY).json()["choices"][0]["text"] for _ in range(4)}
        assert answers == {"f1"}  # whatever f0 refused was retried on f1
        assert a.requests >= 2 and b.requests == 4
        page = httpx.get(router.url + "/metrics").text
        assert metric_value(page, "kvjax_router_requests_retried_total", replica=a.url, reason="status_503") == a.requests
        assert router.replicas.replicas[a.url].available  # a 503 is not a dead replica
        a.mode = b.mode = "429"
        r = post(router, BODY)
        assert r.status_code == 429 and "says 429" in r.text  # everyone full: the client hears it
        assert loads(router) == {a.url: 0, b.url: 0}


def test_a_dead_replica_costs_no_request_and_leaves_routing(fakes):
    a, b = fakes(2)
    with router_over([a, b], policy="round-robin") as router:
        assert {post(router, BODY).json()["choices"][0]["text"] for _ in range(2)} == {"f0", "f1"}
        a.stop()  # the health interval is long: only the failed connection tells the router
        for _ in range(3):
            r = post(router, BODY)
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] == b.url
        rep = router.replicas.replicas[a.url]
        assert not rep.available and "connection failed" in rep.problem
        health = httpx.get(router.url + "/health").json()
        assert health["status"] == "ok" and [x["available"] for x in health["replicas"]] == [False, True]
        b.stop()
        r = post(router, BODY)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
        assert httpx.get(router.url + "/health").status_code == 503
        assert loads(router) == {a.url: 0, b.url: 0}


def test_streams_are_relayed_and_a_broken_stream_ends_with_an_error(fakes):
    (a,) = fakes(1)
    with router_over([a]) as router:
        with httpx.stream("POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=20) as r:
            lines = [x for x in r.iter_lines() if x]
        assert lines == ['data: {"choices": [{"text": "a"}]}', "data: [DONE]"]
        a.mode = "break"
        with httpx.stream("POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=20) as r:
            lines = [x for x in r.iter_lines() if x]
        assert lines[0] == 'data: {"choices": [{"text": "a"}]}' and lines[-1] == "data: [DONE]"
        assert "stream broke" in json.loads(lines[1][6:])["error"]["message"]
        wait_for(lambda: loads(router) == {a.url: 0}, 5, "the load to be released")


def test_a_client_that_leaves_closes_the_replicas_request(fakes):
    (a,) = fakes(1)
    a.mode = "hang"
    with router_over([a]) as router:
        with httpx.stream("POST", router.url + "/v1/completions", json={**BODY, "stream": True}, timeout=20) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would close the connection already
            assert next(lines).startswith("data: ")
            time.sleep(0.2)
            assert loads(router) == {a.url: 1} and not a.cancelled.is_set()
        assert a.cancelled.wait(10), "the replica never saw the client leave"
        wait_for(lambda: loads(router) == {a.url: 0}, 5, "the load to be released")


def test_incompatible_replicas_are_not_used_and_restarts_are_noticed(fakes):
    a, b, c = fakes(3)
    b.tokens_per_block = 8
    c.hash_kind = "trtllm64"
    with router_over([a, b, c], health_interval=0.1) as router:
        assert (router.router.tokens_per_block, router.router.hash_kind) == (4, "sha256")  # learned from a replica
        rb, rc = router.replicas.replicas[b.url], router.replicas.replicas[c.url]
        assert not rb.available and "incompatible" in rb.problem and "8 tokens" in rb.problem
        assert not rc.available and "'trtllm64' hash" in rc.problem
        assert all(post(router, BODY).headers[REPLICA_HEADER] == a.url for _ in range(3))
        a.instance_id = uuid.uuid4().hex  # a new process behind the same URL
        wait_for(lambda: router.replicas.replicas[a.url].restarts == 1, 5, "the restart to be noticed")
        assert router.replicas.replicas[a.url].available
        assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "m"


def test_a_replica_that_died_and_came_back_counts_as_a_restart(fakes):
    a, b = fakes(2)
    with router_over([a, b], policy="round-robin", health_interval=0.1) as router:
        rep = router.replicas.replicas[a.url]

        def restarts_metric():
            text = httpx.get(router.url + "/metrics").text
            return metric_value(text, "kvjax_router_replica_restarts_total", replica=a.url)

        assert rep.available and rep.restarts == 0 and restarts_metric() == 0
        a.stop()
        wait_for(lambda: not rep.available, 5, "the dead replica to leave routing")
        again = FakeReplica("f0", port=a.port)  # a new process (new instance id) behind the same URL
        again.start()
        try:
            wait_for(lambda: rep.available, 5, "the new process to be routed to")
            assert rep.restarts == 1 and restarts_metric() == 1 and rep.instance_id == again.instance_id
            assert {post(router, BODY).json()["choices"][0]["text"] for _ in range(2)} == {"f0", "f1"}
            # unreachable for a while, then back as the same process: not a restart
            again.stop()
            wait_for(lambda: not rep.available, 5, "the unreachable replica to leave routing")
            same = FakeReplica("f0", port=a.port)
            same.instance_id = again.instance_id
            again = same.start()
            wait_for(lambda: rep.available, 5, "the replica to come back")
            assert rep.restarts == 1 and restarts_metric() == 1
        finally:
            again.stop()


def test_bad_requests_are_answered_without_a_replica(fakes):
    (a,) = fakes(1)
    with router_over([a]) as router:
        r = post(router, {"prompt": [1, 2], "logprobs": 21})  # at most 20
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        r = httpx.post(router.url + "/v1/chat/completions", content=b"{not json", timeout=5)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert a.requests == 0


def test_config_and_endpoint_helpers():
    with pytest.raises(ValueError, match="at least one"):
        RouterConfig(())
    with pytest.raises(ValueError, match="distinct"):
        RouterConfig(("http://a:1", "http://a:1/"))
    with pytest.raises(ValueError, match="routing policy"):
        RouterConfig(("http://a:1",), policy="random")
    with pytest.raises(ValueError, match="http"):
        normalise_url("a:1")
    with pytest.raises(ValueError, match="both"):
        RouterConfig(("http://a:1",), tokens_per_block=8)
    assert connect_endpoint("tcp://0.0.0.0:5557", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5557"
    assert connect_endpoint("tcp://*:5557", "http://host:8000") == "tcp://host:5557"
    assert connect_endpoint("tcp://10.0.0.9:5557", "http://host:8000") == "tcp://10.0.0.9:5557"
    assert connect_endpoint("ipc:///tmp/kv", "http://host:8000") == "ipc:///tmp/kv"


def test_cli_router_flags(monkeypatch, capsys):
    import kvjax.router.launch
    from kvjax.cli import main

    seen = {}
    monkeypatch.setattr(kvjax.router.launch, "serve_router",
                        lambda config, *, host, port, log_level: seen.update(config=config, host=host, port=port))
    code = main(["router", "--replica", "http://127.0.0.1:8001", "--replica", "http://127.0.0.1:8002/", "--port", "9000",
                 "--alpha", "0.3", "--imbalance-cap", "1.5", "--tokenizer", "micro", "--health-interval", "0.5"])
    assert code == 0, capsys.readouterr().err
    cfg = seen["config"]
    assert cfg.replicas == ("http://127.0.0.1:8001", "http://127.0.0.1:8002") and seen["port"] == 9000
    assert dict(cfg.policy_options) == {"alpha": 0.3, "imbalance_cap": 1.5} and cfg.tokenizer == "micro"
    assert cfg.health_interval == 0.5 and cfg.policy == "kv-aware"
    assert main(["router", "--replica", "localhost:8001"]) == 2
    assert "http(s)://HOST:PORT" in capsys.readouterr().err
    assert main(["router", "--replica", "http://a:1", "--policy", "round-robin", "--alpha", "1"]) == 2
    assert "apply to --policy kv-aware" in capsys.readouterr().err
    assert main(["router"]) == 2
    assert "--replica" in capsys.readouterr().err


def test_long_prompts_are_tokenised_off_the_event_loop(fakes, monkeypatch):
    """The router tokenises to route: a long prompt is tokenised in a worker thread (without
    the GIL) while /health answers; one that cannot fit any replica's context (the fakes say
    64 tokens) is not tokenised at all and goes to a replica, which answers for it."""
    (a,) = fakes(1)
    with router_over([a], tokenizer="micro") as router:
        wait_for(lambda: router.replicas.replicas[a.url].available, 10, "the replica routed to")
        tokenizer = router.replicas.tokenizer
        encoded = []
        encode = tokenizer.encode
        monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
        r = post(router, {"prompt": "word " * 1_500_000, "max_tokens": 2})  # 7.5 MB: longer than 64 tokens for sure
        assert r.status_code == 200 and encoded == []
        routed = []
        route = router.router.route
        monkeypatch.setattr(router.router, "route", lambda ids, **kw: routed.append(len(ids)) or route(ids, **kw))
        assert post(router, {"prompt": list(range(1, 1_000_001)), "max_tokens": 2}).status_code == 200
        assert routed == [1]  # a million token ids are routed on load, not hashed into blocks on the event loop
        monkeypatch.setattr(tokenizer, "max_chars_per_token", lambda: None)  # no bound: tokenised in full
        done = threading.Event()
        latencies = []

        def long_request():
            try:
                assert post(router, {"prompt": "some words, " * 50_000, "max_tokens": 2}).status_code == 200
            finally:
                done.set()

        t = threading.Thread(target=long_request)
        t.start()
        with httpx.Client(timeout=30) as c:
            while not done.is_set() or not latencies:
                t0 = time.perf_counter()
                assert c.get(router.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)
        t.join(30)
        assert encoded == [600_000] and len(latencies) >= 5 and max(latencies) < 2.0, (encoded, latencies)
        assert loads(router) == {a.url: 0}


def test_an_unexpected_error_fails_one_request_in_openai_shape(fakes, monkeypatch):
    (a,) = fakes(1)
    with router_over([a]) as router:
        wait_for(lambda: router.replicas.replicas[a.url].available, 10, "the replica routed to")
        route = router.router.route
        monkeypatch.setattr(router.router, "route", lambda ids, **kw: {}["injected routing bug"])
        r = post(router, BODY)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        monkeypatch.setattr(router.router, "route", route)
        assert post(router, BODY).status_code == 200
        assert httpx.get(router.url + "/health").status_code == 200


def test_size_limits_and_invalid_unicode_are_answered_without_a_replica(fakes):
    (a,) = fakes(1)
    with router_over([a], max_body_bytes=1 << 20) as router:
        r = httpx.post(router.url + "/v1/completions", content=b'{"prompt": "' + b"x" * (1 << 20) + b'"}', timeout=20)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = post(router, BODY, headers={"x-padding": "y" * (100 << 10)})
        assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
        r = httpx.post(router.url + "/v1/completions", content=b'{"prompt": "\\ud800"}', timeout=20)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode"
        assert a.requests == 0
        assert post(router, BODY).status_code == 200
