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

Handlers parse and check a request completely (protocol, tokenisation, lengths against the
cache's limits, from configuration only) before submitting it to the engine thread
(`EngineLoop`); they never touch the ledger. Streams are server-sent events ending with
`data: [DONE]`; with `stream_options: {"include_usage": true}` a last chunk carries the usage,
as in OpenAI's API. A client that disconnects (streaming or not) aborts its request: its blocks
are stored for reuse and freed.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvjax.engine.core import EngineBusyError
from kvjax.engine.event_publishing import event_hash_kind
from kvjax.engine.llm_engine import LLMEngine
from kvjax.server.choices import ChoiceFormat, StreamChoices
from kvjax.server.engine_loop import EngineLoop, OutputStream, QueueFull, ShuttingDown
from kvjax.server.metrics import ServerMetrics
from kvjax.server.logprobs import TokenText
from kvjax.server.protocol import APIError, Parsed, bad, parse_chat, parse_completion

log = logging.getLogger("kvjax.server")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """`max_pending`: requests queued or running at once (more get 429);
    `default_max_tokens`: a chat request's limit when it sets none (completions default to 16,
    as OpenAI's API), never beyond the context left; `shutdown_timeout`: seconds in-flight
    requests get to finish at shutdown before they are aborted."""

    model_name: str
    max_pending: int = 64
    default_max_tokens: int = 256
    shutdown_timeout: float = 10.0
    max_body_bytes: int = 8 << 20
    tokenizer_source: str | None = None  # what a router loads to tokenise alike (model name or directory)


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream:
    """A server-sent-events response that watches for the client going away: on a disconnect
    it stops producing and calls `on_disconnect` (which aborts the request)."""

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None]) -> None:
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})

        async def produce():
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        completed = False
        try:
            done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            completed = producer in done and producer.exception() is None
        finally:
            for task in (producer, watcher):
                task.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)
            if not completed:  # the client left (or sending failed): abort the request
                self.on_disconnect()


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def build_app(engine: LLMEngine, config: ServerConfig) -> Starlette:
    """The ASGI app; its lifespan starts the engine thread and shuts it down gracefully."""
    metrics = ServerMetrics(config.model_name)
    loop_ = EngineLoop(engine, max_pending=config.max_pending, metrics=metrics)
    tokenizer = engine.tokenizer
    max_seq_len = engine.max_seq_len

    # ------------------------------------------------------------------ helpers
    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise APIError(413, f"the request body exceeds {config.max_body_bytes} bytes", code="body_too_large")
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            raise APIError(413, f"the request body exceeds {config.max_body_bytes} bytes", code="body_too_large")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"the request body is not valid JSON ({e})", code="invalid_json") from None

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise bad(f"the model `{name}` does not exist; this server serves `{config.model_name}`", param="model",
                      code="model_not_found")

    def check_fits(ids: list[int], max_tokens: int, param: str) -> None:
        if len(ids) + max_tokens > max_seq_len:
            raise bad(f"this model's maximum context length is {max_seq_len} tokens; the request has {len(ids)} "
                      f"prompt tokens and asks for {max_tokens} more", param=param, code="context_length_exceeded")

    def check_request(rid: str, ids: list[int], params, param: str) -> None:
        try:
            engine.check_request(rid, ids, params)
        except ValueError as e:
            raise bad(str(e), param=param) from None

    def usage(out) -> dict:
        n_prompt, n_out = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}

    def submit(rid: str, text: str | None, ids: list[int], params) -> OutputStream:
        try:
            return loop_.submit(rid, text, ids, params, asyncio.get_running_loop())
        except QueueFull as e:
            metrics.request_rejected("queue_full")
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except ShuttingDown as e:
            metrics.request_rejected("shutting_down")
            raise APIError(503, str(e), type="server_error", code="unavailable") from None

    async def final_output(request: Request, stream: OutputStream):
        """The request's last output; None if the client went away first (then it is aborted)."""
        disconnect = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            while True:
                nxt = asyncio.ensure_future(stream.next())
                done, _ = await asyncio.wait({nxt, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    loop_.abort(stream.request_id)
                    return None
                out = nxt.result()
                if out.finished:
                    return out
        finally:
            disconnect.cancel()

    async def respond(request: Request, parsed: Parsed, rid: str, text: str | None, ids: list[int], params, chat: bool):
        stream = submit(rid, text, ids, params)
        created = int(time.time())
        model = config.model_name
        fmt = ChoiceFormat(parsed, chat, "" if not parsed.echo else text if text is not None else
                           tokenizer.decode(ids) if tokenizer is not None else "", TokenText(tokenizer))
        if parsed.stream:
            return EventStream(_events(stream, rid, created, model, chat, parsed.include_usage, usage, StreamChoices(fmt)),
                               on_disconnect=lambda: loop_.abort(rid))
        try:
            out = await final_output(request, stream)
        except asyncio.CancelledError:
            loop_.abort(rid)
            raise
        except ShuttingDown as e:
            raise APIError(503, str(e), type="server_error", code="unavailable") from None
        except ValueError as e:
            raise bad(str(e)) from None
        if out is None:
            return Response(status_code=499)  # nobody is listening
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model, "choices": fmt.choices(out),
                             "usage": usage(out)})

    # ------------------------------------------------------------------ endpoints
    async def completions(request: Request):
        try:
            parsed = parse_completion(await read_json(request))
            check_model(parsed.model)
            if isinstance(parsed.prompt, str):
                if tokenizer is None:
                    raise bad("this model has no tokenizer: send the prompt as token ids", param="prompt")
                text, ids = parsed.prompt, tokenizer.encode(parsed.prompt, add_special_tokens=True)
            else:
                assert parsed.prompt is not None  # a completion request without a prompt was refused when parsed
                text, ids = None, list(parsed.prompt)
            max_tokens = parsed.max_tokens if parsed.max_tokens is not None else 16
            check_fits(ids, max_tokens, "prompt")
            params = parsed.sampling_params(max_tokens)
            rid = f"cmpl-{uuid.uuid4().hex}"
            check_request(rid, ids, params, "prompt")
            return await respond(request, parsed, rid, text, ids, params, chat=False)
        except APIError as e:
            if e.status == 400:
                metrics.request_rejected("invalid")
            return _error(e)

    async def chat_completions(request: Request):
        try:
            parsed = parse_chat(await read_json(request))
            check_model(parsed.model)
            if tokenizer is None:
                raise bad("this model has no tokenizer: chat needs one", param="messages")
            try:
                text = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=parsed.add_generation_prompt,
                                                     **parsed.template_kwargs)
            except ValueError as e:
                raise bad(str(e), param="messages") from None
            ids = tokenizer.encode(text, add_special_tokens=False)
            if parsed.max_tokens is None:
                if len(ids) >= max_seq_len:
                    check_fits(ids, 1, "messages")
                max_tokens = min(config.default_max_tokens, max_seq_len - len(ids))
            else:
                max_tokens = parsed.max_tokens
            check_fits(ids, max_tokens, "messages")
            params = parsed.sampling_params(max_tokens)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            check_request(rid, ids, params, "messages")
            return await respond(request, parsed, rid, text, ids, params, chat=True)
        except APIError as e:
            if e.status == 400:
                metrics.request_rejected("invalid")
            return _error(e)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": started, "owned_by": "kvjax", "max_model_len": max_seq_len}]})

    async def health(request: Request):
        if loop_.alive and loop_.accepting:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics_endpoint(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    cc = engine.core.cache_config
    tokenizer_info = None if tokenizer is None else {
        "source": config.tokenizer_source, "fingerprint": tokenizer.fingerprint(), "vocab_size": tokenizer.vocab_size}

    async def kv_events_info(request: Request):
        return JSONResponse({
            "instance_id": instance_id,
            "model": config.model_name,
            "status": "ok" if loop_.alive and loop_.accepting else "unavailable",
            "tokens_per_block": cc.tokens_per_block,
            "hash_kind": event_hash_kind(cc),
            "max_seq_len": max_seq_len,
            "kv_events": engine.kv_events_info(),
            "tokenizer": tokenizer_info,
        })

    async def reset_prefix_cache(request: Request):
        try:
            dropped = await asyncio.wrap_future(loop_.reset_prefix_cache())
        except EngineBusyError as e:
            return _error(APIError(409, f"{e}; retry when no request is running", type="conflict_error", code="requests_running"))
        except ShuttingDown as e:
            return _error(APIError(503, str(e), type="server_error", code="unavailable"))
        return JSONResponse({"reset": True, "blocks_dropped": dropped})

    # ------------------------------------------------------------------ errors and lifespan
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=kind))

    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error", exc_info=exc)
        return _error(APIError(500, "internal server error", type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop_.start()
        try:
            yield
        finally:  # usually drained already by `launch.Server.shutdown`
            await asyncio.get_running_loop().run_in_executor(None, loop_.shutdown, config.shutdown_timeout)

    started = int(time.time())
    instance_id = uuid.uuid4().hex  # a restarted server is a new instance (its cache starts empty)
    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
            Route("/kv_events_info", kv_events_info, methods=["GET"]),
        ],
        # starlette types every handler as taking Exception; http_error is registered for HTTPException only
        exception_handlers={HTTPException: http_error, Exception: server_error},  # type: ignore[dict-item]
        lifespan=lifespan,
    )
    app.state.engine_loop = loop_
    app.state.metrics = metrics
    app.state.config = config
    app.state.instance_id = instance_id
    return app


async def _events(stream: OutputStream, rid: str, created: int, model: str, chat: bool, include_usage: bool, usage,
                  choices: StreamChoices) -> AsyncIterator[bytes]:
    """SSE chunks of one request: per completion (`index`) text deltas, the finish reason;
    optional usage, [DONE]."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict) -> dict:
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    last = None
    try:
        if chat:
            for choice in choices.roles():
                yield _sse(chunk(choice))
        async for out in stream.outputs():
            last = out
            for choice in choices.update(out):
                yield _sse(chunk(choice))
        if include_usage and last is not None:
            yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(last)})
    except (ShuttingDown, ValueError, RuntimeError) as e:
        yield _sse(APIError(503 if isinstance(e, ShuttingDown) else 500, str(e), type="server_error").body())
    yield b"data: [DONE]\n\n"
