"""Errors as HTTP answers in OpenAI's shape: an `APIError` as a response, what a request the
engine thread failed maps to, and the app's handlers for Starlette's own errors (404, 405) and
for bugs (500), so that every failure a client sees has the same body."""
from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from kvjax.server.engine_loop import EngineFailed, RequestFailed, ShuttingDown
from kvjax.server.protocol import APIError, bad

log = logging.getLogger("kvjax.server")


def error_response(e: APIError) -> JSONResponse:
    """`e` as a response; a 429 tells the client when to retry."""
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


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


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's routing errors (unknown path, wrong method) in OpenAI's shape."""
    kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=kind))


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: this request fails alone, logged, in OpenAI's shape."""
    log.exception("unhandled error", exc_info=exc)
    return error_response(APIError(500, "internal server error", type="server_error"))
