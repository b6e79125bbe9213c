"""`kvjax router` in front of two `kvjax serve` SUBPROCESSES on 127.0.0.1 (micro model, KV events
on ZeroMQ): repeated prefixes go to the replica that holds them (its /metrics shows the reuse,
and the router predicted exactly the tokens the replica reused), chat requests are tokenised
like the replicas do, streams are relayed, a killed replica costs no request, and a restarted
replica is learned again from its new event stream. Bounded in time; everything started is
stopped at the end."""
import json
import time

import httpx
import pytest
from serve_helpers import ServeProcess, metric_value, wait_for

from kvjax.router.app import REPLICA_HEADER, RouterConfig
from kvjax.router.launch import RouterThread

pytestmark = pytest.mark.slow

TPB = 8
PREFIX = [(7 * i + 3) % 500 + 1 for i in range(8 * TPB)]  # 64 tokens: 8 full blocks
OTHER = [(11 * i + 5) % 500 + 1 for i in range(8 * TPB)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("router-cluster")
    reps = [ServeProcess(work, "r0"), ServeProcess(work, "r1")]
    router = None
    try:
        reps[0].start().wait_healthy()
        complete(reps[0].url, [1, 2, 3], 4)  # compiles; the executables land in the shared cache
        reps[1].start().wait_healthy()
        complete(reps[1].url, [1, 2, 3], 4)
        router = RouterThread(RouterConfig(tuple(r.url for r in reps), health_interval=0.2, health_timeout=1.0,
                                           request_timeout=120.0)).start()
        wait_for(lambda: all(r.available for r in router.replicas.replicas.values()), 30, "both replicas routed to")
        yield router, reps
    finally:
        if router is not None:
            router.stop()
        for r in reps:
            r.kill()


_HTTP = httpx.Client(timeout=120)


def complete(url, prompt, max_tokens=4, **extra):
    r = _HTTP.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r


def reused(url) -> float:
    return metric_value(_HTTP.get(url + "/metrics").text, "kvjax_prompt_tokens_reused_total")


def index_blocks(router, url) -> int:
    return router.router.index.num_blocks(url)


def test_repeat_prefixes_go_to_the_replica_that_holds_them(cluster):
    router, reps = cluster
    before = {r.url: reused(r.url) for r in reps}
    first = complete(router.url, PREFIX + [9, 9, 9])
    home = first.headers[REPLICA_HEADER]
    other = next(r.url for r in reps if r.url != home)
    wait_for(lambda: index_blocks(router, home) >= 8, 10, "the router to learn the prefix from the replica's events")
    for i in range(3):
        r = complete(router.url, PREFIX + [20 + i, 30 + i])
        assert r.headers[REPLICA_HEADER] == home
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
    assert reused(home) - before[home] >= 3 * len(PREFIX)  # visible on the replica's /metrics
    assert reused(other) == before[other]
    page = _HTTP.get(router.url + "/metrics").text
    assert metric_value(page, "kvjax_router_predicted_cached_tokens_total", replica=home) >= 3 * len(PREFIX)
    assert metric_value(page, "kvjax_router_replica_available", replica=other) == 1.0
    assert metric_value(page, "kvjax_router_kv_event_batches_total", replica=home) > 0


def test_chat_is_tokenised_like_the_replicas(cluster):
    router, reps = cluster
    system = {"role": "system", "content": "You are a terse assistant. " * 6}
    body = {"model": "micro", "messages": [system, {"role": "user", "content": "first question"}], "max_tokens": 3,
            "temperature": 0}
    r = _HTTP.post(router.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    home = r.headers[REPLICA_HEADER]
    wait_for(lambda: index_blocks(router, home) >= 8 + 2, 10, "the chat prefix in the index")
    page = _HTTP.get(router.url + "/metrics").text
    predicted0 = metric_value(page, "kvjax_router_predicted_cached_tokens_total", replica=home)
    body["messages"][1]["content"] = "second question"
    r = _HTTP.post(router.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == home
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    predicted = metric_value(_HTTP.get(router.url + "/metrics").text, "kvjax_router_predicted_cached_tokens_total",
                             replica=home) - predicted0
    # the router hashed the same tokens the replica cached (it predicts full blocks; partial reuse adds the rest)
    assert predicted >= 2 * TPB and predicted == cached // TPB * TPB


def test_stream_is_relayed_and_bad_requests_answered_like_a_replica(cluster):
    router, reps = cluster
    plain = complete(router.url, OTHER, 6).json()["choices"][0]["text"]
    with _HTTP.stream("POST", router.url + "/v1/completions",
                      json={"prompt": OTHER, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == plain
    bad = _HTTP.post(router.url + "/v1/completions", json={"prompt": "x", "n": 0})
    direct = _HTTP.post(reps[0].url + "/v1/completions", json={"prompt": "x", "n": 0})
    assert bad.status_code == direct.status_code == 400 and bad.json() == direct.json()
    assert _HTTP.get(router.url + "/v1/models").json()["data"][0]["id"] == "micro"
    assert _HTTP.get(router.url + "/health").json()["status"] == "ok"


POISON = [  # (endpoint, body, param, code): each once took a replica down or answered 500
    ("/v1/completions", {"prompt": [1, 2, 3], "top_k": 2**31}, "top_k", "invalid_value"),
    ("/v1/completions", {"prompt": [1, 2, 3], "seed": 2**64}, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "a\ud800"}, "prompt", "invalid_unicode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "invalid_value"),
    # refused by the replica, not the router: the vocabulary, the template, the context length
    ("/v1/completions", {"prompt": [1, 2, 600]}, "prompt", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", "invalid_value"),
    ("/v1/completions", {"prompt": "word " * 1_500_000}, "prompt", "context_length_exceeded"),
]


def test_poison_requests_leave_every_replica_healthy(cluster):
    router, reps = cluster
    targets = [router.url] + [r.url for r in reps]  # through the router, and straight at each replica
    for url in targets:
        for path, body, param, code in POISON:
            content = json.dumps(body).encode()  # keeps the lone surrogate as its JSON escape
            r = _HTTP.post(url + path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == 400, (url, path, r.text[:300])
            assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), (url, r.json())
    nested = b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    for url in targets:
        r = _HTTP.post(url + "/v1/completions", content=nested, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    for r in reps:
        assert _HTTP.get(r.url + "/health").status_code == 200 and r.proc.poll() is None
        complete(r.url, [4, 5, 6], 2)
    assert all(rep.available for rep in router.replicas.replicas.values())
    complete(router.url, [4, 5, 6], 2)


def test_keeps_serving_when_a_replica_dies_and_relearns_it_after_restart(cluster):
    router, reps = cluster
    home = complete(router.url, PREFIX + [1, 1]).headers[REPLICA_HEADER]
    victim = next(r for r in reps if r.url == home)
    survivor = next(r for r in reps if r.url != home)
    victim.kill()
    t0 = time.monotonic()
    for i in range(4):  # the first one may still be routed to the dead replica: it is retried elsewhere
        r = complete(router.url, PREFIX + [40 + i])
        assert r.headers[REPLICA_HEADER] == survivor.url
    with _HTTP.stream("POST", router.url + "/v1/completions",
                      json={"prompt": PREFIX + [77], "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == survivor.url
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""] or "[DONE]" in r.text
    assert time.monotonic() - t0 < 60
    assert not router.replicas.replicas[victim.url].available
    assert index_blocks(router, victim.url) == 0  # a dead replica's blocks are forgotten
    health = _HTTP.get(router.url + "/health").json()
    assert health["status"] == "ok" and [r["available"] for r in health["replicas"] if r["url"] == victim.url] == [False]

    old_instance = router.replicas.replicas[victim.url].instance_id
    victim.start().wait_healthy()
    wait_for(lambda: router.replicas.replicas[victim.url].available, 20, "the restarted replica to be routed to again")
    assert router.replicas.replicas[victim.url].instance_id != old_instance
    # it came back empty: the router must not believe it still holds PREFIX
    assert router.router.index.match(router.router.request_hashes(PREFIX + [1]), [victim.url])[victim.url].blocks == 0
    # what the new process caches reaches the router through its new event stream
    fresh = [(13 * i + 1) % 500 + 1 for i in range(6 * TPB)]
    complete(victim.url, fresh + [2])  # straight to the replica, not through the router
    wait_for(lambda: index_blocks(router, victim.url) >= 6, 20, "the router to learn the restarted replica's blocks")
    r = complete(router.url, fresh + [3, 4])
    assert r.headers[REPLICA_HEADER] == victim.url
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(fresh)
    page = _HTTP.get(router.url + "/metrics").text
    assert metric_value(page, "kvjax_router_replica_marked_down_total", replica=victim.url) >= 1
    assert metric_value(page, "kvjax_router_requests_routed_total", replica=survivor.url) >= 5
