"""The router front's errors as HTTP answers in OpenAI's shape (as a replica gives them): an
`APIError` as a response, and the app's handlers for Starlette's own errors (404, 405) and for
bugs (500)."""
from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from kvjax.server.protocol import APIError

log = logging.getLogger("kvjax.router")


def error_response(e: APIError) -> JSONResponse:
    """`e` as a response."""
    return JSONResponse(e.body(), status_code=e.status)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's routing errors (unknown path, wrong method) in OpenAI's shape."""
    return error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: this request fails, logged, in OpenAI's shape."""
    log.exception("unhandled error", exc_info=exc)
    return error_response(APIError(500, "internal server error", type="server_error"))
