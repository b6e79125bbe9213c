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
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from typing import cast

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvjax._math import ceil_div
from kvjax.router.metrics import RouterMetrics
from kvjax.router.policy import make_policy
from kvjax.router.replicas import ReplicaSet, load_tokenizer, normalise_url
from kvjax.router.router import Router
from kvjax.server.protocol import APIError, HeaderLimit, Parsed, parse_body, parse_chat, parse_completion

log = logging.getLogger("kvjax.router")

REPLICA_HEADER = "x-kvjax-replica"
_RETRY_STATUSES = (429, 503)  # the replica took nothing: another one may


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """`replicas`: the `kvjax serve` URLs; `policy` ("kv-aware", "round-robin", "least-loaded")
    with `policy_options` (kv-aware: alpha, imbalance_cap, slack, other_tier_weight);
    `tokenizer`: a tokenizer directory or built-in model name (None: the one the replicas
    report); `tokens_per_block` / `hash_kind`: how to hash prompts (None: learned from the first
    replica, the others must agree); `health_interval` seconds between health rounds;
    `request_timeout` seconds a replica may take to answer (or between two stream chunks)."""

    replicas: tuple[str, ...]
    policy: str = "kv-aware"
    policy_options: tuple[tuple[str, float], ...] = ()
    tokenizer: str | None = None
    tokens_per_block: int | None = None
    hash_kind: str | None = None
    health_interval: float = 2.0
    health_timeout: float = 2.0
    connect_timeout: float = 2.0
    request_timeout: float = 600.0
    max_body_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one --replica URL")
        urls = tuple(normalise_url(u) for u in self.replicas)
        if len(set(urls)) != len(urls):
            raise ValueError(f"replica URLs must be distinct, got {list(self.replicas)}")
        object.__setattr__(self, "replicas", urls)
        for name in ("health_interval", "health_timeout", "connect_timeout", "request_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if (self.tokens_per_block is None) != (self.hash_kind is None):
            raise ValueError("give both tokens_per_block and hash_kind, or neither (learned from the replicas)")
        make_policy(self.policy, **dict(self.policy_options))  # fails here on a bad name or option


class _Retry:
    """A replica did not take the request; `response` is what it said, if anything."""

    def __init__(self, reason: str, response: Response | None = None) -> None:
        self.reason = reason
        self.response = response


class _Relay(StreamingResponse):
    """A proxied stream that always releases its replica connection and load, even when the
    client leaves before the first chunk is relayed (the generator then never starts)."""

    def __init__(self, content, close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def prompt_token_ids(parsed: Parsed, tokenizer, max_seq_len: int | None = None) -> list[int] | None:
    """The prompt's token ids exactly as a replica computes them (None if this router cannot:
    a text prompt without a tokenizer, a chat its template refuses; or should not: a prompt
    longer than `max_seq_len` tokens, which no replica serves, is neither tokenised, when its
    length alone says so, nor hashed; the replica answers). Slow on long prompts: call it off
    the event loop."""

    def fits(ids: list[int]) -> list[int] | None:
        return None if max_seq_len is not None and len(ids) > max_seq_len else ids

    def too_long(text: str) -> bool:
        per = tokenizer.max_chars_per_token()
        return max_seq_len is not None and per is not None and ceil_div(len(text), per) > max_seq_len

    if parsed.messages is not None:
        if tokenizer is None:
            return None
        try:
            text = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=parsed.add_generation_prompt,
                                                 **parsed.template_kwargs)
        except (ValueError, TypeError, LookupError, AttributeError):
            return None
        return None if too_long(text) else fits(tokenizer.encode(text, add_special_tokens=False))
    if isinstance(parsed.prompt, str):
        if tokenizer is None or too_long(parsed.prompt):
            return None
        return fits(tokenizer.encode(parsed.prompt, add_special_tokens=True))
    assert parsed.prompt is not None  # a completion request without a prompt was refused when parsed
    return fits(list(parsed.prompt))


def build_router_app(config: RouterConfig) -> Starlette:  # noqa: C901 - split next
    """The router's ASGI app; its lifespan starts the HTTP client and the health checks."""
    import anyio
    import anyio.to_thread
    import httpx

    policy = make_policy(config.policy, **dict(config.policy_options))
    router = Router(list(config.replicas), policy, tokens_per_block=config.tokens_per_block,
                    hash_kind=config.hash_kind or "sha256")
    tokenizer = None if config.tokenizer is None else load_tokenizer(config.tokenizer)
    state: dict = {}

    def replicas() -> ReplicaSet:
        return state["replicas"]

    # ------------------------------------------------------------------ forwarding
    async def forward(request: Request, url: str, path: str, body: bytes, stream: bool):
        """Send the request to one replica: a Response for the client, or a `_Retry`."""
        client: httpx.AsyncClient = state["client"]
        rs = replicas()
        headers = {"content-type": "application/json", "accept": "text/event-stream" if stream else "application/json"}
        upstream = client.build_request("POST", url + path, content=body, headers=headers)
        send = asyncio.ensure_future(client.send(upstream, stream=True))
        disconnect = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait({send, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
        if send not in done:  # the client left: dropping the connection aborts it on the replica
            send.cancel()
            with contextlib.suppress(BaseException):
                resp = await send
                await resp.aclose()
            router.finished(url)
            return Response(status_code=499)
        try:
            resp = send.result()
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            router.finished(url)
            rs.mark_down(rs.replicas[url], f"connection failed ({type(e).__name__})")
            return _Retry("unreachable")
        except httpx.TimeoutException:
            router.finished(url)
            state["metrics"].failed.labels("timeout").inc()
            return _error(APIError(504, f"replica {url} did not answer within {config.request_timeout} s", type="server_error"))
        if resp.status_code != 200 or not stream:
            try:
                content = await resp.aread()
            except (httpx.ReadError, httpx.RemoteProtocolError) as e:  # died before answering: nothing reached the client
                rs.mark_down(rs.replicas[url], f"connection lost ({type(e).__name__})")
                return _Retry("connection_lost")
            except httpx.TimeoutException:
                state["metrics"].failed.labels("timeout").inc()
                return _error(
                    APIError(504, f"replica {url} did not answer within {config.request_timeout} s", type="server_error")
                )
            finally:
                await resp.aclose()
                router.finished(url)
            out = Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"),
                           headers={REPLICA_HEADER: url})
            if resp.status_code in _RETRY_STATUSES:
                return _Retry(f"status_{resp.status_code}", out)
            return out
        chunks = resp.aiter_raw()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.TimeoutException) as e:
            await resp.aclose()
            router.finished(url)
            rs.mark_down(rs.replicas[url], f"stream broke before its first bytes ({type(e).__name__})")
            return _Retry("connection_lost")

        closed = False

        async def close() -> None:  # idempotent: the relay, or the response if the relay never ran
            nonlocal closed
            if not closed:
                closed = True
                router.finished(url)
                with anyio.CancelScope(shield=True):
                    await resp.aclose()

        async def relay():
            try:
                if first:
                    yield first
                async for chunk in chunks:
                    yield chunk
            except httpx.HTTPError as e:  # committed: tell the client in-band
                state["metrics"].failed.labels("stream_broken").inc()
                log.warning("stream from %s broke: %s", url, e)
                if isinstance(e, (httpx.ReadError, httpx.RemoteProtocolError)):
                    rs.mark_down(rs.replicas[url], f"stream broke ({type(e).__name__})")
                await close()
                yield _sse(APIError(502, f"the replica's stream broke: {type(e).__name__}", type="server_error").body())
                yield b"data: [DONE]\n\n"
            finally:
                await close()

        return _Relay(relay(), close, media_type=resp.headers.get("content-type", "text/event-stream"),
                      headers={"cache-control": "no-cache", REPLICA_HEADER: url})

    def max_seq_len() -> int | None:
        """The longest context of a routed replica (None if none says)."""
        lens = [r.info.get("max_seq_len") for r in replicas().replicas.values() if r.available and r.info]
        ints = [n for n in lens if isinstance(n, int)]
        return max(ints) if ints else None

    async def proxy(request: Request, path: str, chat: bool):
        too_large = APIError(413, f"the request body exceeds {config.max_body_bytes} bytes", code="body_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            return _error(too_large)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                return _error(too_large)
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            parse = parse_chat if chat else parse_completion
            parsed = await anyio.to_thread.run_sync(lambda: parse(parse_body(body)))
        except APIError as e:
            return _error(e)
        ids = await anyio.to_thread.run_sync(prompt_token_ids, parsed, replicas().tokenizer, max_seq_len())
        metrics = state["metrics"]
        tried: list[str] = []
        last: _Retry | None = None
        while True:
            try:
                # a prompt the router cannot tokenise is routed on load alone (one dummy token, no full block)
                decision = router.route(ids or [0], exclude=tried)
            except RuntimeError:
                break
            url = cast(str, decision.replica)  # the front's router is built on replica URLs
            tpb = router.tokens_per_block or 0
            metrics.request_routed(url, len(ids or ()), decision.match.blocks * tpb)
            out = await forward(request, url, path, body, parsed.stream)
            if not isinstance(out, _Retry):
                return out
            metrics.retried.labels(url, out.reason).inc()
            tried.append(url)
            last = out
        if last is not None and last.response is not None:
            return last.response  # every replica was full or draining: say what the last one said
        metrics.failed.labels("no_replica").inc()
        return _error(APIError(503, "no replica is available", type="server_error", code="unavailable"))

    # ------------------------------------------------------------------ endpoints
    async def completions(request: Request):
        return await proxy(request, "/v1/completions", chat=False)

    async def chat_completions(request: Request):
        return await proxy(request, "/v1/chat/completions", chat=True)

    async def models(request: Request):
        import httpx

        for url, rep in replicas().replicas.items():
            if not rep.available:
                continue
            try:
                resp = await state["client"].get(url + "/v1/models", timeout=config.health_timeout)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                return Response(resp.content, media_type="application/json", headers={REPLICA_HEADER: url})
        return _error(APIError(503, "no replica is available", type="server_error", code="unavailable"))

    async def health(request: Request):
        status = replicas().status()
        ok = any(r["available"] for r in status)
        return JSONResponse({"status": "ok" if ok else "unavailable", "replicas": status}, status_code=200 if ok else 503)

    async def metrics_endpoint(request: Request):
        return Response(state["metrics"].render(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: HTTPException):
        return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    async def server_error(request: Request, exc: Exception):  # a bug: this request fails, in OpenAI's shape
        log.exception("unhandled error", exc_info=exc)
        return _error(APIError(500, "internal server error", type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        timeout = httpx.Timeout(config.request_timeout, connect=config.connect_timeout)
        async with httpx.AsyncClient(
            timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
        ) as client:
            rs = ReplicaSet(router, client, tokenizer=tokenizer, tokenizer_spec=config.tokenizer,
                            health_timeout=config.health_timeout)
            state.update(client=client, replicas=rs, metrics=RouterMetrics(rs))
            app.state.replicas = rs
            app.state.metrics = state["metrics"]
            await rs.refresh()  # route from the first request on if the replicas are up
            checks = asyncio.ensure_future(rs.run(config.health_interval))
            try:
                yield
            finally:
                checks.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checks
                await asyncio.get_running_loop().run_in_executor(None, rs.close)

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
        ],
        # starlette types every handler as taking Exception; http_error is registered for HTTPException only
        exception_handlers={HTTPException: http_error, Exception: server_error},  # type: ignore[dict-item]
        lifespan=lifespan,
        middleware=[Middleware(HeaderLimit)],
    )
    app.state.router = router
    app.state.config = config
    return app
