"""The router front's endpoints: the two generation routes read and tokenise a request as the
replicas do, route it and forward it (`forwarding.py`), trying the next best replica while
none took it; /v1/models, /health and /metrics answer from the replica set."""
from __future__ import annotations

from typing import cast

import anyio.to_thread
import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvjax.router.config import REPLICA_HEADER
from kvjax.router.forwarding import Retry, forward
from kvjax.router.front_state import RouterState
from kvjax.router.http_errors import error_response
from kvjax.router.pd_flow import two_steps
from kvjax.router.prompt_tokens import prompt_token_ids
from kvjax.server.protocol import APIError, parse_body, parse_chat, parse_completion


async def proxy(front: RouterState, request: Request, path: str, chat: bool) -> Response:
    """Read (at most `max_body_bytes`: 413), parse and tokenise the request off the event loop,
    then route it, retrying on the replicas that did not take it; the body goes on unchanged."""
    config = front.config
    too_large = APIError(413, f"the request body exceeds {config.max_body_bytes} bytes", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
        return error_response(too_large)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > config.max_body_bytes:
            return error_response(too_large)
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        parse = parse_chat if chat else parse_completion
        parsed = await anyio.to_thread.run_sync(lambda: parse(parse_body(body)))
    except APIError as e:
        return error_response(e)
    ids = await anyio.to_thread.run_sync(prompt_token_ids, parsed, front.replicas.tokenizer, front.max_seq_len())

    async def place(body: bytes, stream: bool, exclude) -> Response:
        return await _place(front, request, path, body, ids, stream, exclude)

    if config.disaggregated:  # vLLM's prefill-then-decode flow (pd_flow.py)
        return await two_steps(front, request, path, body, ids, parsed.stream, place)
    return await place(body, parsed.stream, ())


async def _place(front: RouterState, request: Request, path: str, body: bytes, ids: list[int] | None, stream: bool,
                 exclude) -> Response:
    """Route the request (never to a replica in `exclude`) and forward it, trying the next best
    replica while none took it."""
    router, metrics = front.router, front.metrics
    tried: list[str] = list(exclude)
    last: Retry | None = None
    while True:
        try:
            # a prompt the router cannot tokenise is routed on load alone (one dummy token, no full block)
            decision = router.route(ids or [0], exclude=tried)
        except RuntimeError:
            break
        url = cast(str, decision.replica)  # the front's router is built on replica URLs
        tpb = router.tokens_per_block or 0
        metrics.request_routed(url, len(ids or ()), decision.match.blocks * tpb)
        out = await forward(front, request, url, path, body, stream)
        if not isinstance(out, Retry):
            return out
        metrics.retried.labels(url, out.reason).inc()
        tried.append(url)
        last = out
    if last is not None and last.response is not None:
        return last.response  # every replica was full or draining: say what the last one said
    metrics.failed.labels("no_replica").inc()
    return error_response(APIError(503, "no replica is available", type="server_error", code="unavailable"))


async def completions(front: RouterState, request: Request) -> Response:
    """POST /v1/completions, routed."""
    return await proxy(front, request, "/v1/completions", chat=False)


async def chat_completions(front: RouterState, request: Request) -> Response:
    """POST /v1/chat/completions, routed."""
    return await proxy(front, request, "/v1/chat/completions", chat=True)


async def models(front: RouterState, request: Request) -> Response:
    """The first routed replica's /v1/models answer."""
    for url, rep in front.replicas.replicas.items():
        if not rep.available:
            continue
        try:
            resp = await front.client.get(url + "/v1/models", timeout=front.config.health_timeout)
        except httpx.HTTPError:
            continue
        if resp.status_code == 200:
            return Response(resp.content, media_type="application/json", headers={REPLICA_HEADER: url})
    return error_response(APIError(503, "no replica is available", type="server_error", code="unavailable"))


async def health(front: RouterState, request: Request) -> Response:
    """200 while at least one replica is routed to, else 503; every replica's state."""
    status = front.replicas.status()
    ok = any(r["available"] for r in status)
    return JSONResponse({"status": "ok" if ok else "unavailable", "replicas": status}, status_code=200 if ok else 503)


async def metrics_endpoint(front: RouterState, request: Request) -> Response:
    """Prometheus text format."""
    return Response(front.metrics.render(), media_type=CONTENT_TYPE_LATEST)
