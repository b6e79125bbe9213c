"""The endpoints around generation: GET /v1/models, /health, /metrics, /kv_events_info and
POST /reset_prefix_cache. They read the server's state; only the reset goes through the engine
thread (the ledger is that thread's alone)."""
from __future__ import annotations

import asyncio

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvjax.engine.core_types import EngineBusyError
from kvjax.engine.event_publishing import event_hash_kind
from kvjax.server.engine_loop import ShuttingDown
from kvjax.server.http_errors import error_response
from kvjax.server.protocol import APIError
from kvjax.server.state import ServerState


async def models(server: ServerState, request: Request):
    """Every name this server answers to, with its context length."""
    config = server.config
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": server.started, "owned_by": "kvjax", "max_model_len": server.max_seq_len}
        for name in (config.model_name, *config.other_model_names)]})


async def health(server: ServerState, request: Request):
    """200 while the engine runs and takes requests; 503 otherwise (also while draining)."""
    if server.serving:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


async def metrics_endpoint(server: ServerState, request: Request):
    """Prometheus text format."""
    return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def kv_events_info(server: ServerState, request: Request):
    """What a KV-aware router needs to hash prompts as this server does and follow its cache."""
    cc = server.cache_config
    return JSONResponse({
        "instance_id": server.instance_id,
        "model": server.config.model_name,
        "status": "ok" if server.serving else "unavailable",
        "tokens_per_block": cc.tokens_per_block,
        "hash_kind": event_hash_kind(cc),
        "max_seq_len": server.max_seq_len,
        "kv_events": server.engine.kv_events_info(),
        "tokenizer": server.tokenizer_info,
    })


async def reset_prefix_cache(server: ServerState, request: Request):
    """Drop every cached prefix, on the engine thread; 409 while requests run."""
    try:
        dropped = await asyncio.wrap_future(server.engine_loop.reset_prefix_cache())
    except EngineBusyError as e:
        return error_response(APIError(409, f"{e}; retry when no request is running", type="conflict_error",
                                       code="requests_running"))
    except ShuttingDown as e:
        return error_response(APIError(503, str(e), type="server_error", code="unavailable"))
    return JSONResponse({"reset": True, "blocks_dropped": dropped})
