"""Admission: reading and checking a request completely (body size, JSON, model name,
tokenisation, lengths against the cache's limits, the engine's own checks) before it reaches
the engine thread, and submitting it there. A refused request costs the engine nothing;
`APIError`s raised here become the client's answer."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio.to_thread
from starlette.requests import Request

from kvjax._math import ceil_div
from kvjax.errors import KVCacheError
from kvjax.server.engine_loop import OutputStream, QueueFull, ShuttingDown
from kvjax.server.protocol import APIError, Parsed, bad, parse_body
from kvjax.server.state import ServerState

MAX_SEQ_LEN_OPTION = "kvjax serve --max-model-len"  # what raises the context limit (vLLM's name; --max-seq-len too)


async def read_request(server: ServerState, request: Request, parse: Callable[[object], Parsed]) -> Parsed:
    """The checked request (`parse` of the JSON body); at most `max_body_bytes` are read
    (413); parsing and checking (linear in the body: a prompt of a million token ids) run
    off the event loop."""
    limit = server.config.max_body_bytes
    too_large = APIError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return await anyio.to_thread.run_sync(lambda: parse(parse_body(b"".join(chunks))))


def check_model(server: ServerState, name: str | None) -> None:
    """Refuse a model name this server does not answer to (None: any)."""
    config = server.config
    if name is not None and name != config.model_name and name not in config.other_model_names:
        raise bad(f"the model `{name}` does not exist; this server serves `{config.model_name}`", param="model",
                  code="model_not_found")


def check_fits(server: ServerState, ids: list[int], max_tokens: int, param: str) -> None:
    """Refuse a prompt that leaves no room in the context for `max_tokens` more."""
    max_seq_len = server.max_seq_len
    if len(ids) + max_tokens > max_seq_len:
        raise bad(f"this model's maximum context length is {max_seq_len} tokens ({MAX_SEQ_LEN_OPTION}); the "
                  f"request has {len(ids)} prompt tokens and asks for {max_tokens} more", param=param,
                  code="context_length_exceeded")


def check_text_fits(server: ServerState, text: str, max_tokens: int | None, param: str) -> None:
    """Refuse a text too long to fit the context whatever its tokens, before tokenising it:
    no token of this tokenizer covers more than `chars_per_token` characters."""
    if server.chars_per_token is None:
        return
    max_seq_len = server.max_seq_len
    least = ceil_div(len(text), server.chars_per_token)
    if least + (max_tokens or 1) > max_seq_len:
        raise bad(f"this model's maximum context length is {max_seq_len} tokens ({MAX_SEQ_LEN_OPTION}); the "
                  f"request's {len(text)} characters make at least {least} prompt tokens", param=param,
                  code="context_length_exceeded")


def encode_prompt(server: ServerState, text: str, max_tokens: int | None) -> list[int]:
    """A completion's text prompt as token ids, with special tokens (in a worker thread)."""
    tokenizer = server.tokenizer
    assert tokenizer is not None  # the handler checked
    check_text_fits(server, text, max_tokens, "prompt")
    return tokenizer.encode(text, add_special_tokens=True)


def render_chat(server: ServerState, parsed: Parsed) -> tuple[str, list[int]]:
    """The chat template's text for the messages and its token ids (in a worker thread); the
    template adds the special tokens itself."""
    tokenizer = server.tokenizer
    assert tokenizer is not None and parsed.messages is not None  # the handler checked; parse_chat set them
    try:
        text = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=parsed.add_generation_prompt,
                                             **parsed.template_kwargs)
    except (ValueError, TypeError, LookupError, AttributeError) as e:  # the template refused these messages
        raise bad(f"the chat template cannot render these messages: {e}", param="messages") from None
    assert isinstance(text, str)  # not tokenised by the template
    check_text_fits(server, text, parsed.max_tokens, "messages")
    return text, tokenizer.encode(text, add_special_tokens=False)


def check_request(server: ServerState, rid: str, ids: list[int], params, param: str) -> None:
    """The engine's own checks, as a 400 naming `param`."""
    try:
        server.engine.check_request(rid, ids, params)
    except ValueError as e:
        raise bad(str(e), param=param) from None


def check_kv_transfer(server: ServerState, rid: str, ids: list[int], kv_transfer_params: dict | None) -> None:
    """A request's `kv_transfer_params` against this engine's --kv-transfer-config (role,
    geometry digest, offered blocks vs prompt), as a 400; reads configuration only."""
    if kv_transfer_params is None:
        return
    remote = server.engine.core.remote_kv
    if remote is None:
        raise bad("kv_transfer_params need a server started with --kv-transfer-config", param="kv_transfer_params")
    try:
        remote.prepare(rid, kv_transfer_params, len(ids))
    except (ValueError, KVCacheError) as e:
        raise bad(f"{type(e).__name__}: {e}", param="kv_transfer_params") from None


def submit(server: ServerState, rid: str, text: str | None, ids: list[int], params,
           kv_transfer_params: dict | None = None) -> OutputStream:
    """Hand the checked request to the engine thread: 429 when the queue is full, 503 while
    shutting down (both counted as rejections)."""
    try:
        return server.engine_loop.submit(rid, text, ids, params, asyncio.get_running_loop(),
                                         kv_transfer_params=kv_transfer_params)
    except QueueFull as e:
        server.metrics.request_rejected("queue_full")
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
    except ShuttingDown as e:
        server.metrics.request_rejected("shutting_down")
        raise APIError(503, str(e), type="server_error", code="unavailable") from None
