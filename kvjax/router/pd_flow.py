"""Disaggregated prefill/decode through the router: vLLM's two-step proxy flow
(`toy_proxy_server.py`), each step routed by the front's policy among its side's replicas.

1. Prefill: the client's body with `max_tokens` (and `max_completion_tokens`) 1, not streamed,
   and `kv_transfer_params` asking for remote decode, sent to a prefill replica. Its answer
   carries the `kv_transfer_params` that say where the prompt's KV is offered.
2. Decode: the client's body as it came, plus those `kv_transfer_params`, sent to a decode
   replica, which pulls the KV instead of computing it; its answer (streamed or not) is the
   client's. A prefill that answers without params (e.g. a prompt shorter than a block) gives
   a plain decode request: the decode replica computes the prompt.

A prefill replica that refuses with an error status ends the request with that answer.
"""
from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from kvjax.router.front_state import RouterState

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict) -> bytes:
    """Step 1's body: one token, no stream, remote decode asked."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "kv_transfer_params")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return json.dumps(out).encode()


def decode_body(body: dict, params: dict | None) -> bytes:
    """Step 2's body: the client's, with the prefill's `kv_transfer_params` (if any)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params is not None:
        out["kv_transfer_params"] = params
    return json.dumps(out).encode()


async def two_steps(front: RouterState, request: Request, path: str, body: bytes, ids: list[int] | None,
                    stream: bool, place) -> Response:
    """Run both steps; `place(body, stream, exclude)` routes one request and forwards it
    (retrying on the side's other replicas, as the front does)."""
    config = front.config
    client_body = json.loads(body)  # parsed by the replicas' parser already: a JSON object
    first = await place(prefill_body(client_body), False, config.decode_replicas)
    if first.status_code != 200:
        front.metrics.failed.labels("prefill_failed").inc()
        return first
    try:
        params = json.loads(bytes(first.body)).get("kv_transfer_params")
    except (ValueError, AttributeError):
        params = None
    front.metrics.pd_prefills.labels("with_kv" if params else "without_kv").inc()
    return await place(decode_body(client_body, params), stream, config.prefill_replicas)
