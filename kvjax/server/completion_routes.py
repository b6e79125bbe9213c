"""POST /v1/completions and /v1/chat/completions: admit the request (`admission.py`), run it on
the engine thread, and answer with one JSON body or a stream of server-sent events
(`streaming.py`). A client that goes away aborts its request."""
from __future__ import annotations

import asyncio
import time
import uuid

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvjax.server.admission import (
    check_fits,
    check_kv_transfer,
    check_model,
    check_request,
    encode_prompt,
    read_request,
    render_chat,
    submit,
)
from kvjax.server.choices import ChoiceFormat, StreamChoices
from kvjax.server.engine_loop import EngineFailed, OutputStream, RequestFailed, ShuttingDown
from kvjax.server.http_errors import error_response, request_error
from kvjax.server.logprobs import TokenText
from kvjax.server.protocol import APIError, Parsed, bad, parse_chat, parse_completion
from kvjax.server.state import ServerState
from kvjax.server.streaming import EventStream, completion_events, wait_disconnect


def usage(out) -> dict:
    """OpenAI's `usage` of a request output, with the prompt tokens the prefix cache served."""
    n_prompt, n_out = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


async def final_output(server: ServerState, request: Request, stream: OutputStream):
    """The request's last output; None if the client went away first (then it is aborted)."""
    disconnect = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        while True:
            nxt = asyncio.ensure_future(stream.next())
            done, _ = await asyncio.wait({nxt, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                server.engine_loop.abort(stream.request_id)
                return None
            out = nxt.result()
            if out.finished:
                return out
    finally:
        disconnect.cancel()


async def respond(server: ServerState, request: Request, parsed: Parsed, rid: str, text: str | None, ids: list[int],
                  params, chat: bool):
    """Submit the admitted request and answer: a stream of events, or the finished output
    (499 if the client left first)."""
    loop_ = server.engine_loop
    tokenizer = server.tokenizer
    stream = submit(server, rid, text, ids, params, parsed.kv_transfer_params)
    created = int(time.time())
    model = server.config.model_name
    fmt = ChoiceFormat(parsed, chat, "" if not parsed.echo else text if text is not None else
                       tokenizer.decode(ids) if tokenizer is not None else "", TokenText(tokenizer))
    if parsed.stream:
        events = completion_events(stream, rid, created, model, chat, parsed.include_usage, usage, StreamChoices(fmt))
        return EventStream(events, on_disconnect=lambda: loop_.abort(rid))
    try:
        out = await final_output(server, request, stream)
    except asyncio.CancelledError:
        loop_.abort(rid)
        raise
    except (ShuttingDown, RequestFailed, EngineFailed, ValueError) as e:
        raise request_error(e) from None
    if out is None:
        return Response(status_code=499)  # nobody is listening
    obj = "chat.completion" if chat else "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": fmt.choices(out), "usage": usage(out)}
    if parsed.kv_transfer_params is not None:  # disaggregated prefill/decode: where the prompt's KV is offered
        body["kv_transfer_params"] = out.kv_transfer_params
    return JSONResponse(body)


async def completions(server: ServerState, request: Request):
    """POST /v1/completions: a text prompt (tokenised here) or token ids; 16 tokens by default."""
    try:
        parsed = await read_request(server, request, parse_completion)
        check_model(server, parsed.model)
        if isinstance(parsed.prompt, str):
            if server.tokenizer is None:
                raise bad("this model has no tokenizer: send the prompt as token ids", param="prompt")
            text = parsed.prompt
            ids = await anyio.to_thread.run_sync(encode_prompt, server, parsed.prompt, parsed.max_tokens)
        else:
            assert parsed.prompt is not None  # a completion request without a prompt was refused when parsed
            text, ids = None, list(parsed.prompt)
        max_tokens = parsed.max_tokens if parsed.max_tokens is not None else 16
        return await _answer(server, request, parsed, text, ids, max_tokens, chat=False)
    except APIError as e:
        return _refused(server, e)


async def chat_completions(server: ServerState, request: Request):
    """POST /v1/chat/completions: messages rendered with the chat template; without
    `max_tokens`, `default_max_tokens` capped by the context left."""
    try:
        parsed = await read_request(server, request, parse_chat)
        check_model(server, parsed.model)
        if server.tokenizer is None:
            raise bad("this model has no tokenizer: chat needs one", param="messages")
        text, ids = await anyio.to_thread.run_sync(render_chat, server, parsed)
        max_seq_len = server.max_seq_len
        if parsed.max_tokens is None:
            if len(ids) >= max_seq_len:
                check_fits(server, ids, 1, "messages")
            max_tokens = min(server.config.default_max_tokens, max_seq_len - len(ids))
        else:
            max_tokens = parsed.max_tokens
        return await _answer(server, request, parsed, text, ids, max_tokens, chat=True)
    except APIError as e:
        return _refused(server, e)


async def _answer(server: ServerState, request: Request, parsed: Parsed, text: str | None, ids: list[int],
                  max_tokens: int, *, chat: bool):
    """The checks both endpoints make once the prompt's ids are known, then the answer."""
    param = "messages" if chat else "prompt"
    check_fits(server, ids, max_tokens, param)
    params = parsed.sampling_params(max_tokens)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    check_request(server, rid, ids, params, param)
    check_kv_transfer(server, rid, ids, parsed.kv_transfer_params)
    return await respond(server, request, parsed, rid, text, ids, params, chat=chat)


def _refused(server: ServerState, e: APIError) -> Response:
    """An error answer; a 400 counts as a request refused as invalid."""
    if e.status == 400:
        server.metrics.request_rejected("invalid")
    return error_response(e)
