"""The OpenAI-compatible HTTP API (Starlette), served by uvicorn (`launch.py`).

Endpoints:
  POST /v1/completions        a prompt (text or token ids) -> text; `stream: true` for SSE
  POST /v1/chat/completions   messages, rendered with the tokenizer's chat template
  GET  /v1/models             the served model
  GET  /health                200 while the engine runs and takes requests, else 503 (also
                              while draining at shutdown)
  GET  /metrics               Prometheus text format (see `metrics.py`)
  POST /reset_prefix_cache    drop every cached prefix; 409 while requests run
  GET  /kv_events_info        what a KV-aware router needs: where the KV events are published
                              (null if they are not), the block size and hash kind to hash
                              prompts with, the tokenizer (source and fingerprint), and an
                              instance id that changes when the server restarts

With `ServerConfig.api_keys`, /v1/* and /reset_prefix_cache need `Authorization: Bearer KEY`
(`auth.py`); the engine thread logs per-request and periodic stats lines (`stats_logger.py`).

Handlers parse and check a request completely (protocol, tokenisation, lengths against the
cache's limits, from configuration only) before submitting it to the engine thread
(`EngineLoop`); they never touch the ledger. Streams are server-sent events ending with
`data: [DONE]`; with `stream_options: {"include_usage": true}` a last chunk carries the usage,
as in OpenAI's API. A client that disconnects (streaming or not) aborts its request: its blocks
are stored for reuse and freed.

Robustness: the body is read up to `ServerConfig.max_body_bytes` (413 beyond), parsed as strict
JSON with bounded nesting and valid Unicode (`protocol.parse_body`); JSON parsing, chat-template
rendering and tokenisation run in worker threads, never on the event loop, so a huge prompt
delays nobody else (a text prompt that cannot fit the context is refused before it is
tokenised). A request that fails inside the server fails alone (500, or an error event in its
stream); if the engine thread dies, in-flight requests get errors and `on_engine_death` (set by
`launch.py`: stop and exit non-zero) lets a supervisor restart the server.

This module only wires the app: the handlers are plain functions of a `ServerState`
(`state.py`) in `completion_routes.py` (generation, over `admission.py` and `streaming.py`)
and `service_routes.py` (the rest); `http_errors.py` gives every failure OpenAI's shape.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from kvjax.engine.llm_engine import LLMEngine
from kvjax.server.admission import MAX_SEQ_LEN_OPTION
from kvjax.server.auth import APIKeyMiddleware
from kvjax.server.completion_routes import chat_completions, completions
from kvjax.server.config import ServerConfig
from kvjax.server.http_errors import http_error, request_error, server_error
from kvjax.server.protocol import HeaderLimit
from kvjax.server.service_routes import health, kv_events_info, metrics_endpoint, models, reset_prefix_cache
from kvjax.server.state import ServerState
from kvjax.server.streaming import EventStream

__all__ = ["MAX_SEQ_LEN_OPTION", "EventStream", "ServerConfig", "build_app", "request_error"]

log = logging.getLogger("kvjax.server")


@contextlib.asynccontextmanager
async def _run_engine(server: ServerState, app: Starlette):
    """The lifespan: the engine thread runs while the app does, and shuts down gracefully."""
    server.running_loop = asyncio.get_running_loop()
    server.engine_loop.start()
    try:
        yield
    finally:  # usually drained already by `launch.Server.shutdown`
        await asyncio.get_running_loop().run_in_executor(None, server.engine_loop.shutdown, server.config.shutdown_timeout)


def build_app(engine: LLMEngine, config: ServerConfig) -> Starlette:
    """The ASGI app; its lifespan starts the engine thread and shuts it down gracefully.
    `app.state.on_engine_death` (None: nothing) is called on the event loop if the engine
    thread dies; `launch.py` sets it to stop the server."""

    def engine_died(error: BaseException) -> None:  # on the engine thread, once it failed every request
        log.critical("the engine thread died: the server stops so that a supervisor can restart it")
        hook = app.state.on_engine_death
        running_loop = server.running_loop
        if hook is not None and running_loop is not None:
            running_loop.call_soon_threadsafe(hook)

    server = ServerState(engine, config, on_death=engine_died)
    app = Starlette(
        routes=[
            Route("/v1/completions", partial(completions, server), methods=["POST"]),
            Route("/v1/chat/completions", partial(chat_completions, server), methods=["POST"]),
            Route("/v1/models", partial(models, server), methods=["GET"]),
            Route("/health", partial(health, server), methods=["GET"]),
            Route("/metrics", partial(metrics_endpoint, server), methods=["GET"]),
            Route("/reset_prefix_cache", partial(reset_prefix_cache, server), methods=["POST"]),
            Route("/kv_events_info", partial(kv_events_info, server), methods=["GET"]),
        ],
        # starlette types every handler as taking Exception; http_error is registered for HTTPException only
        exception_handlers={HTTPException: http_error, Exception: server_error},  # type: ignore[dict-item]
        lifespan=partial(_run_engine, server),
        middleware=[Middleware(HeaderLimit)],
    )
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys, protect=("/v1", "/reset_prefix_cache"))
    app.state.engine_loop = server.engine_loop
    app.state.metrics = server.metrics
    app.state.config = config
    app.state.instance_id = server.instance_id
    app.state.on_engine_death = None
    return app
