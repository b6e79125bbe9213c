"""`--api-key`: Bearer-token authentication of the OpenAI routes, as vLLM's server does it.

Requests to paths starting with `/v1` (other than CORS preflights, `OPTIONS`) must carry
`Authorization: Bearer <key>` with one of the keys, else they get a 401 with OpenAI's error
body (`code: "invalid_api_key"`). `/health`, `/metrics`, `/kv_events_info` stay open, as vLLM
leaves its non-`/v1` routes open (load balancers, Prometheus and routers need no key); the
server also protects `/reset_prefix_cache`, which changes state. Keys are compared in
constant time.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Sequence

from starlette.responses import JSONResponse

from kvjax.server.protocol import APIError

#: The environment variable vLLM reads when `--api-key` is not given.
API_KEY_ENV = "VLLM_API_KEY"


def api_keys(given: Sequence[str] | None, environ=os.environ) -> tuple[str, ...]:
    """The keys to require: `--api-key` values if any, else `VLLM_API_KEY` (as vLLM: the flag
    wins); empty keys are refused rather than silently accepted."""
    keys = tuple(given) if given else ((environ[API_KEY_ENV],) if environ.get(API_KEY_ENV) else ())
    if any(not k.strip() for k in keys):
        raise ValueError("--api-key must not be empty")
    return keys


class APIKeyMiddleware:
    """ASGI middleware (streams pass through untouched once authenticated)."""

    def __init__(self, app, keys: Iterable[str], protect: Iterable[str] = ("/v1",)) -> None:
        self.app = app
        self.keys = [b"Bearer " + k.encode() for k in keys]
        if not self.keys:
            raise ValueError("APIKeyMiddleware needs at least one key")
        self.protect = tuple(protect)

    def _authorized(self, headers) -> bool:
        value = next((v for k, v in headers if k == b"authorization"), None)
        if value is None:
            return False
        ok = False
        for key in self.keys:  # no early exit: the time does not say which key was close
            ok |= hmac.compare_digest(value, key)
        return ok

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"
                or not scope["path"].startswith(self.protect) or self._authorized(scope["headers"])):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "Incorrect or missing API key: send it as the header `Authorization: Bearer <key>`",
                       code="invalid_api_key")
        await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
