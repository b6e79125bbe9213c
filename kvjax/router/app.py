"""The KV-aware router's OpenAI-compatible front (`kvjax router`), on `kvjax serve`'s stack
(Starlette, served by uvicorn).

Endpoints:
  POST /v1/completions, /v1/chat/completions   routed to one replica and proxied (SSE streams
                              relayed chunk by chunk); the response names the replica in the
                              `x-kvjax-replica` header
  GET  /v1/models             a live replica's answer
  GET  /health                200 while at least one replica is routed to, else 503; the body
                              lists every replica's state
  GET  /metrics               Prometheus text format (`metrics.py`)

A request is read with the replicas' own parser (`kvjax.server.protocol`: a request they would
refuse gets the same 400 here), tokenised as the replicas do (the prompt with special tokens,
or the chat template then no special tokens), hashed into blocks as their ledgers hash them,
and routed by the `Router` over the index its replicas' KV events fed (`replicas.py`). The
body is forwarded unchanged.

Failures: a replica that refuses the connection, drops it before answering or answers 503
(draining) or 429 (full) is skipped and the request goes to the next best replica, as long as
nothing was sent to the client yet (a stream is committed once its first bytes are relayed);
refused connections also take the replica out of routing until a health check brings it
back. A stream that breaks halfway ends with an error event and `data: [DONE]`. A client that
disconnects closes the connection to the replica, which aborts the request there.

Robustness: bodies are read up to `RouterConfig.max_body_bytes` (413 beyond); parsing and
tokenising run in worker threads, never on the event loop, and a text prompt too long for
every replica's context is not tokenised at all (routed on load; the replica refuses it).

This module only wires the app: `RouterConfig` is in `config.py`, the shared `RouterState` in
`front_state.py`, the endpoints in `front_routes.py` (over `prompt_tokens.py` and
`forwarding.py`), the error answers in `http_errors.py`.
"""
from __future__ import annotations

import asyncio
import contextlib
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from kvjax.router.config import REPLICA_HEADER, RouterConfig
from kvjax.router.front_state import RouterState
from kvjax.router.http_errors import http_error, server_error
from kvjax.router.metrics import RouterMetrics
from kvjax.router.prompt_tokens import prompt_token_ids
from kvjax.router.replicas import ReplicaSet
from kvjax.server.protocol import HeaderLimit

__all__ = ["REPLICA_HEADER", "RouterConfig", "build_router_app", "prompt_token_ids"]


@contextlib.asynccontextmanager
async def _run_front(front: RouterState, app: Starlette):
    """The lifespan: the HTTP client to the replicas, the replica set and its health checks."""
    import httpx

    config = front.config
    timeout = httpx.Timeout(config.request_timeout, connect=config.connect_timeout)
    async with httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
    ) as client:
        rs = ReplicaSet(front.router, client, tokenizer=front.tokenizer, tokenizer_spec=config.tokenizer,
                        health_timeout=config.health_timeout)
        front.client, front.replicas, front.metrics = client, rs, RouterMetrics(rs)
        app.state.replicas = rs
        app.state.metrics = front.metrics
        await rs.refresh()  # route from the first request on if the replicas are up
        checks = asyncio.ensure_future(rs.run(config.health_interval))
        try:
            yield
        finally:
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks
            await asyncio.get_running_loop().run_in_executor(None, rs.close)


def build_router_app(config: RouterConfig) -> Starlette:
    """The router's ASGI app; its lifespan starts the HTTP client and the health checks."""
    # the endpoints load httpx: imported here, so that reading a RouterConfig (the CLI) does not
    from kvjax.router.front_routes import chat_completions, completions, health, metrics_endpoint, models

    front = RouterState(config)
    app = Starlette(
        routes=[
            Route("/v1/completions", partial(completions, front), methods=["POST"]),
            Route("/v1/chat/completions", partial(chat_completions, front), methods=["POST"]),
            Route("/v1/models", partial(models, front), methods=["GET"]),
            Route("/health", partial(health, front), methods=["GET"]),
            Route("/metrics", partial(metrics_endpoint, front), methods=["GET"]),
        ],
        # starlette types every handler as taking Exception; http_error is registered for HTTPException only
        exception_handlers={HTTPException: http_error, Exception: server_error},  # type: ignore[dict-item]
        lifespan=partial(_run_front, front),
        middleware=[Middleware(HeaderLimit)],
    )
    app.state.router = front.router
    app.state.config = config
    return app
