"""Forwarding one request to one replica: send it (dropping it if the client leaves), then
either read the whole answer or relay the replica's stream chunk by chunk. A replica that took
nothing (unreachable, dropped the connection before answering, answered 429 or 503, or broke
its stream before the first bytes) gives a `Retry`, and the caller tries the next one; once
bytes reached the client, a broken stream ends in-band with an error event."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvjax.router.config import REPLICA_HEADER
from kvjax.router.front_state import RouterState
from kvjax.router.http_errors import error_response
from kvjax.server.protocol import APIError

log = logging.getLogger("kvjax.router")

_RETRY_STATUSES = (429, 503)  # the replica took nothing: another one may


class Retry:
    """A replica did not take the request; `response` is what it said, if anything."""

    def __init__(self, reason: str, response: Response | None = None) -> None:
        self.reason = reason
        self.response = response


class Relay(StreamingResponse):
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


def sse(obj) -> bytes:
    """One server-sent event: `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def wait_disconnect(receive) -> None:
    """Return once the client has gone away (other messages are dropped)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _timed_out(front: RouterState, url: str) -> Response:
    front.metrics.failed.labels("timeout").inc()
    return error_response(APIError(504, f"replica {url} did not answer within {front.config.request_timeout} s",
                                   type="server_error"))


async def forward(front: RouterState, request: Request, url: str, path: str, body: bytes,
                  stream: bool) -> Response | Retry:
    """Send the request to one replica: a Response for the client, or a `Retry`."""
    resp = await _send(front, request, url, path, body, stream)
    if not isinstance(resp, httpx.Response):
        return resp
    if resp.status_code != 200 or not stream:
        return await _whole_answer(front, url, resp)
    return await _relay(front, url, resp)


async def _send(front: RouterState, request: Request, url: str, path: str, body: bytes,
                stream: bool) -> httpx.Response | Response | Retry:
    """The replica's response head; a 499 if the client left first (dropping the connection
    aborts the request on the replica), a `Retry` if the replica is unreachable, a 504."""
    client = front.client
    rs = front.replicas
    headers = {"content-type": "application/json", "accept": "text/event-stream" if stream else "application/json"}
    upstream = client.build_request("POST", url + path, content=body, headers=headers)
    send = asyncio.ensure_future(client.send(upstream, stream=True))
    disconnect = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({send, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
    if send not in done:  # the client left: dropping the connection aborts it on the replica
        send.cancel()
        with contextlib.suppress(BaseException):
            resp = await send
            await resp.aclose()
        front.router.finished(url)
        return Response(status_code=499)
    try:
        return send.result()
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        front.router.finished(url)
        rs.mark_down(rs.replicas[url], f"connection failed ({type(e).__name__})")
        return Retry("unreachable")
    except httpx.TimeoutException:
        front.router.finished(url)
        return _timed_out(front, url)


async def _whole_answer(front: RouterState, url: str, resp: httpx.Response) -> Response | Retry:
    """A non-streamed answer (or any error status) read whole, then passed on; 429 and 503
    give a `Retry` carrying it."""
    rs = front.replicas
    try:
        content = await resp.aread()
    except (httpx.ReadError, httpx.RemoteProtocolError) as e:  # died before answering: nothing reached the client
        rs.mark_down(rs.replicas[url], f"connection lost ({type(e).__name__})")
        return Retry("connection_lost")
    except httpx.TimeoutException:
        return _timed_out(front, url)
    finally:
        await resp.aclose()
        front.router.finished(url)
    out = Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"),
                   headers={REPLICA_HEADER: url})
    if resp.status_code in _RETRY_STATUSES:
        return Retry(f"status_{resp.status_code}", out)
    return out


async def _relay(front: RouterState, url: str, resp: httpx.Response) -> Response | Retry:
    """The replica's stream relayed chunk by chunk, once its first bytes came (before them, a
    broken stream is a `Retry`)."""
    rs = front.replicas
    chunks = resp.aiter_raw()
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except (httpx.ReadError, httpx.RemoteProtocolError, httpx.TimeoutException) as e:
        await resp.aclose()
        front.router.finished(url)
        rs.mark_down(rs.replicas[url], f"stream broke before its first bytes ({type(e).__name__})")
        return Retry("connection_lost")

    closed = False

    async def close() -> None:  # idempotent: the relay, or the response if the relay never ran
        nonlocal closed
        if not closed:
            closed = True
            front.router.finished(url)
            with anyio.CancelScope(shield=True):
                await resp.aclose()

    async def relay():
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as e:  # committed: tell the client in-band
            front.metrics.failed.labels("stream_broken").inc()
            log.warning("stream from %s broke: %s", url, e)
            if isinstance(e, (httpx.ReadError, httpx.RemoteProtocolError)):
                rs.mark_down(rs.replicas[url], f"stream broke ({type(e).__name__})")
            await close()
            yield sse(APIError(502, f"the replica's stream broke: {type(e).__name__}", type="server_error").body())
            yield b"data: [DONE]\n\n"
        finally:
            await close()

    return Relay(relay(), close, media_type=resp.headers.get("content-type", "text/event-stream"),
                 headers={"cache-control": "no-cache", REPLICA_HEADER: url})
