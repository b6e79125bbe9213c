"""Server-sent events: the chunks of a streamed completion and the ASGI response that relays
them while watching for the client going away (which aborts the request)."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from kvjax.server.choices import StreamChoices
from kvjax.server.engine_loop import EngineFailed, OutputStream, RequestFailed, ShuttingDown
from kvjax.server.http_errors import request_error

log = logging.getLogger("kvjax.server")


def sse(obj) -> bytes:
    """One event: `obj` as compact JSON (non-ASCII text kept as is)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def wait_disconnect(receive) -> None:
    """Return once the client has gone away (other messages are dropped)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


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
                    chunk = sse(request_error(e).body()) + b"data: [DONE]\n\n"
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.ensure_future(produce())
        watcher = asyncio.ensure_future(wait_disconnect(receive))
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


async def completion_events(stream: OutputStream, rid: str, created: int, model: str, chat: bool, include_usage: bool,
                            usage, choices: StreamChoices) -> AsyncIterator[bytes]:
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
                yield sse(chunk(choice))
        async for out in stream.outputs():
            last = out
            for choice in choices.update(out):
                yield sse(chunk(choice))
        if include_usage and last is not None:
            yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(last)})
    except (ShuttingDown, RequestFailed, EngineFailed, ValueError) as e:  # the engine failed this request
        yield sse(request_error(e).body())
    yield b"data: [DONE]\n\n"
