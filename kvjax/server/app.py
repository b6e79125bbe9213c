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

import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvjax._math import ceil_div
from kvjax.engine.core import EngineBusyError
from kvjax.engine.event_publishing import event_hash_kind
from kvjax.engine.llm_engine import LLMEngine
from kvjax.server.auth import APIKeyMiddleware
from kvjax.server.choices import ChoiceFormat, StreamChoices
from kvjax.server.engine_loop import EngineFailed, EngineLoop, OutputStream, QueueFull, RequestFailed, ShuttingDown
from kvjax.server.logprobs import TokenText
from kvjax.server.metrics import ServerMetrics
from kvjax.server.protocol import APIError, HeaderLimit, Parsed, bad, parse_body, parse_chat, parse_completion
from kvjax.server.stats_logger import StatsLogger

log = logging.getLogger("kvjax.server")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """`max_pending`: requests queued or running at once (more get 429);
    `default_max_tokens`: a chat request's limit when it sets none (completions default to 16,
    as OpenAI's API), never beyond the context left; `shutdown_timeout`: seconds in-flight
    requests get to finish at shutdown before they are aborted; `max_body_bytes`: the largest
    request body read (larger ones get 413); `other_model_names`: further names requests may use
    (`model_name` is the one reported); `api_keys`: Bearer keys required on /v1/* (`auth.py`);
    `log_requests` / `log_stats_interval`: `stats_logger.py`."""

    model_name: str
    max_pending: int = 64
    default_max_tokens: int = 256
    shutdown_timeout: float = 10.0
    max_body_bytes: int = 32 << 20
    tokenizer_source: str | None = None  # what a router loads to tokenise alike (model name or directory)
    other_model_names: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    log_requests: bool = True
    log_stats_interval: float | None = 10.0


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


MAX_SEQ_LEN_OPTION = "kvjax serve --max-model-len"  # what raises the context limit (vLLM's name; --max-seq-len too)


def request_error(e: BaseException) -> APIError:
    """The HTTP error of a request the engine thread failed (`OutputStream.next` raised `e`)."""
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), type="server_error", code="unavailable")
    if isinstance(e, EngineFailed):
        return APIError(500, str(e), type="server_error", code="engine_failed")
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), type="server_error", code="request_failed")
    if isinstance(e, ValueError):  # the engine refused it (a race with the handler's checks)
        return bad(str(e))
    return APIError(500, f"this request failed inside the server ({type(e).__name__})", type="server_error")


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

        failed = False

        async def produce():
            nonlocal failed
            events = aiter(self.events)
            while True:
                try:
                    chunk = await anext(events)
                except StopAsyncIteration:
                    break
                except Exception as e:  # making this request's events failed: end its stream in-band
                    log.exception("the event stream of a request failed")
                    failed = True
                    chunk = _sse(request_error(e).body()) + b"data: [DONE]\n\n"
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        completed = False
        try:
            done, _ = await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            completed = producer in done and producer.exception() is None and not failed
        finally:
            for task in (producer, watcher):
                task.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)
            if not completed:  # the client left, sending or making events failed: abort the request
                self.on_disconnect()


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def build_app(engine: LLMEngine, config: ServerConfig) -> Starlette:  # noqa: C901 - split next
    """The ASGI app; its lifespan starts the engine thread and shuts it down gracefully.
    `app.state.on_engine_death` (None: nothing) is called on the event loop if the engine
    thread dies; `launch.py` sets it to stop the server."""

    def engine_died(error: BaseException) -> None:  # on the engine thread, once it failed every request
        log.critical("the engine thread died: the server stops so that a supervisor can restart it")
        hook = app.state.on_engine_death
        if hook is not None and running_loop is not None:
            running_loop.call_soon_threadsafe(hook)

    metrics = ServerMetrics(config.model_name)
    stats = StatsLogger(interval=config.log_stats_interval, log_requests=config.log_requests)
    loop_ = EngineLoop(engine, max_pending=config.max_pending, metrics=metrics, stats=stats, on_death=engine_died)
    running_loop: asyncio.AbstractEventLoop | None = None
    tokenizer = engine.tokenizer
    max_seq_len = engine.max_seq_len
    chars_per_token = None if tokenizer is None else tokenizer.max_chars_per_token()

    # ------------------------------------------------------------------ helpers
    async def read_request(request: Request, parse: Callable[[object], Parsed]) -> Parsed:
        """The checked request (`parse` of the JSON body); at most `max_body_bytes` are read
        (413); parsing and checking (linear in the body: a prompt of a million token ids) run
        off the event loop."""
        too_large = APIError(413, f"the request body exceeds {config.max_body_bytes} bytes", code="body_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return await anyio.to_thread.run_sync(lambda: parse(parse_body(b"".join(chunks))))

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name and name not in config.other_model_names:
            raise bad(f"the model `{name}` does not exist; this server serves `{config.model_name}`", param="model",
                      code="model_not_found")

    def check_fits(ids: list[int], max_tokens: int, param: str) -> None:
        if len(ids) + max_tokens > max_seq_len:
            raise bad(f"this model's maximum context length is {max_seq_len} tokens ({MAX_SEQ_LEN_OPTION}); the "
                      f"request has {len(ids)} prompt tokens and asks for {max_tokens} more", param=param,
                      code="context_length_exceeded")

    def check_text_fits(text: str, max_tokens: int | None, param: str) -> None:
        """Refuse a text too long to fit the context whatever its tokens, before tokenising it:
        no token of this tokenizer covers more than `chars_per_token` characters."""
        if chars_per_token is None:
            return
        least = ceil_div(len(text), chars_per_token)
        if least + (max_tokens or 1) > max_seq_len:
            raise bad(f"this model's maximum context length is {max_seq_len} tokens ({MAX_SEQ_LEN_OPTION}); the "
                      f"request's {len(text)} characters make at least {least} prompt tokens", param=param,
                      code="context_length_exceeded")

    def encode_prompt(text: str, max_tokens: int | None) -> list[int]:  # in a worker thread
        assert tokenizer is not None  # the handler checked
        check_text_fits(text, max_tokens, "prompt")
        return tokenizer.encode(text, add_special_tokens=True)

    def render_chat(parsed: Parsed) -> tuple[str, list[int]]:  # in a worker thread
        assert tokenizer is not None and parsed.messages is not None  # the handler checked; parse_chat set them
        try:
            text = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=parsed.add_generation_prompt,
                                                 **parsed.template_kwargs)
        except (ValueError, TypeError, LookupError, AttributeError) as e:  # the template refused these messages
            raise bad(f"the chat template cannot render these messages: {e}", param="messages") from None
        assert isinstance(text, str)  # not tokenised by the template
        check_text_fits(text, parsed.max_tokens, "messages")
        return text, tokenizer.encode(text, add_special_tokens=False)

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
        except (ShuttingDown, RequestFailed, EngineFailed, ValueError) as e:
            raise request_error(e) from None
        if out is None:
            return Response(status_code=499)  # nobody is listening
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model, "choices": fmt.choices(out),
                             "usage": usage(out)})

    # ------------------------------------------------------------------ endpoints
    async def completions(request: Request):
        try:
            parsed = await read_request(request, parse_completion)
            check_model(parsed.model)
            if isinstance(parsed.prompt, str):
                if tokenizer is None:
                    raise bad("this model has no tokenizer: send the prompt as token ids", param="prompt")
                text, ids = parsed.prompt, await anyio.to_thread.run_sync(encode_prompt, parsed.prompt, parsed.max_tokens)
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
            parsed = await read_request(request, parse_chat)
            check_model(parsed.model)
            if tokenizer is None:
                raise bad("this model has no tokenizer: chat needs one", param="messages")
            text, ids = await anyio.to_thread.run_sync(render_chat, parsed)
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
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "kvjax", "max_model_len": max_seq_len}
            for name in (config.model_name, *config.other_model_names)]})

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
        nonlocal running_loop
        running_loop = asyncio.get_running_loop()
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
        middleware=[Middleware(HeaderLimit)],
    )
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys, protect=("/v1", "/reset_prefix_cache"))
    app.state.engine_loop = loop_
    app.state.metrics = metrics
    app.state.config = config
    app.state.instance_id = instance_id
    app.state.on_engine_death = None
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
    except (ShuttingDown, RequestFailed, EngineFailed, ValueError) as e:  # the engine failed this request
        yield _sse(request_error(e).body())
    yield b"data: [DONE]\n\n"
