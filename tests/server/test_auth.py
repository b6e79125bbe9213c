"""`APIKeyMiddleware` on a bare Starlette app: any of the keys opens the protected prefixes,
anything else is a 401 in OpenAI's error shape; other routes and CORS preflights stay open."""
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvjax.server.auth import APIKeyMiddleware


def _app():
    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST", "OPTIONS"])
                            for p in ("/v1/models", "/health", "/reset_prefix_cache")])
    app.add_middleware(APIKeyMiddleware, keys=("k1", "k2"), protect=("/v1", "/reset_prefix_cache"))
    return app


def test_keys_and_open_routes():
    with TestClient(_app()) as client:
        for key in ("k1", "k2"):
            assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).text == "ok"
        for headers in ({}, {"Authorization": "Bearer k3"}, {"Authorization": "Bearer k1 "}, {"Authorization": "k1"},
                        {"Authorization": "bearer k1"}, {"X-API-Key": "k1"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
        assert client.post("/reset_prefix_cache").status_code == 401
        assert client.get("/health").text == "ok"
        assert client.options("/v1/models").text == "ok"  # CORS preflights carry no credentials


def test_needs_a_key():
    with pytest.raises(ValueError, match="at least one key"):
        APIKeyMiddleware(None, keys=())
