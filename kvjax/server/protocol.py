"""The OpenAI request bodies the server accepts, checked field by field, and its error body.

Every check runs before anything is submitted to the engine, so a bad request changes nothing.
A wrong type, a value out of range, an unknown field, or a feature kvjax does not serve
(suffix, best_of > 1, logit_bias, tools, images) is a 400 with
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}`; `param` names the
offending field. Missing optional fields take OpenAI's defaults (`temperature` 1.0: pass 0 for
greedy decoding). Served as OpenAI / vLLM define them: `n` (1..128), `presence_penalty` and
`frequency_penalty` ([-2, 2]), `logprobs` (completions: 0..20 top tokens; chat: true, with
`top_logprobs` 0..20), `echo` (completions: the prompt is prepended to the text, and with
`logprobs` the prompt tokens get logprobs too, the first one null). Extensions, as vLLM names
them: `top_k`, `min_tokens`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`, `return_token_ids` (the choice then carries `token_ids`, and
`prompt_token_ids` in non-streaming responses), and for chat `add_generation_prompt` and
`chat_template_kwargs` (extra template variables).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from kvjax.engine.sampling import INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams
from kvjax.errors import KVCacheError


class APIError(KVCacheError):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------- the body
MAX_JSON_DEPTH = 32  # the deepest request (a chat message's content part) needs 5 levels


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_body(raw: bytes) -> Any:
    """The request body as JSON, or a 400: strict JSON (no NaN / Infinity), UTF-8, nested at
    most `MAX_JSON_DEPTH` levels, every string valid Unicode (a lone surrogate such as
    `"\\ud800"` cannot be encoded or tokenised). Linear in the body's size: a server runs it
    off its event loop."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, bad UTF-8, NaN, ints over 4300 digits
        raise bad(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:  # the decoder's own limit (about 1000 levels)
        raise bad(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json") from None
    check_json(body)
    return body


def check_json(body: Any) -> None:
    """Refuse (400) JSON nested deeper than `MAX_JSON_DEPTH` or holding a string (or key) that
    is not valid Unicode; `param` names the field where it was found."""
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        v, depth, top = stack.pop()
        if isinstance(v, str):
            _check_unicode(v, top)
        elif isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise bad(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", param=top,
                          code="invalid_json")
            if isinstance(v, dict):
                for k, x in v.items():
                    _check_unicode(k, top)  # a bad key cannot name itself
                    if isinstance(x, (str, dict, list)):
                        stack.append((x, depth + 1, top if top is not None else k))
            else:
                stack.extend((x, depth + 1, top) for x in v if isinstance(x, (str, dict, list)))


def _check_unicode(s: str, param: str | None) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{param or 'the request'}: a string holds {s[e.start]!r}, a lone UTF-16 surrogate, which is not valid "
                  "Unicode", param=param, code="invalid_unicode") from None


MAX_HEADER_BYTES = 64 << 10


class HeaderLimit:
    """ASGI middleware: a request whose head (path, query string, header names and values)
    exceeds `max_bytes` gets 431 in OpenAI's error shape. uvicorn's h11 limit only catches a
    head that arrives in pieces; this one holds whatever the socket delivered at once."""

    def __init__(self, app, max_bytes: int = MAX_HEADER_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._size(scope) > self.max_bytes:
            body = json.dumps(APIError(431, f"the request head (path and headers) exceeds {self.max_bytes} bytes",
                                       code="headers_too_large").body()).encode()
            await send({"type": "http.response.start", "status": 431,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _size(scope) -> int:
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        return head + sum(len(k) + len(v) for k, v in scope["headers"])


# ---------------------------------------------------------------------- field checks
_MISSING = object()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


class _Fields:
    """Typed access to a JSON object's fields; every error names the field."""

    def __init__(self, body: Any, allowed: set[str]) -> None:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object", code="invalid_type")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise bad(f"unrecognized request argument supplied: {unknown[0]}", param=unknown[0], code="unknown_parameter")
        self.body = body

    def get(self, name: str, check, expected: str, default=None):
        v = self.body.get(name, _MISSING)
        if v is _MISSING or v is None:
            return default
        if not check(v):
            raise bad(f"{name} must be {expected}, got {v!r}", param=name, code="invalid_type")
        return v

    def int_(self, name, lo=None, hi=None, default=None):
        v = self.get(name, _is_int, "an integer", default)
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise bad(f"{name} must be {rng}, got {v!r}", param=name)
        return v

    def number(self, name, lo, hi, default=None, lo_open=False):
        v = self.get(name, _is_number, "a number", default)
        if v is not None and (v < lo or v > hi or (lo_open and v == lo)):
            left = "(" if lo_open else "["
            raise bad(f"{name} must be in {left}{lo}, {hi}], got {v!r}", param=name)
        return v

    def bool_(self, name, default=None):
        return self.get(name, lambda v: isinstance(v, bool), "true or false", default)

    def str_(self, name, default=None):
        return self.get(name, lambda v: isinstance(v, str), "a string", default)

    def unsupported(self, name, ok) -> None:
        """A field kvjax does not serve: accepted only when `ok(value)` (its neutral value)."""
        v = self.body.get(name, None)
        if v is not None and not ok(v):
            raise bad(f"{name}={v!r} is not supported by this server", param=name, code="unsupported_parameter")


# ---------------------------------------------------------------------- requests
_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "stream",
    "stream_options", "n", "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "skip_special_tokens",
    "return_token_ids", "min_tokens", "repetition_penalty", "kv_transfer_params",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
                         "add_generation_prompt", "chat_template_kwargs", "parallel_tool_calls"}


# what `Tokenizer.apply_chat_template` takes as its own arguments: never template variables
TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "tokenize", "tools", "documents", "chat_template"})


@dataclasses.dataclass
class Parsed:
    """A checked request: the prompt (text or token ids, or chat messages), sampling values
    (`max_tokens` None: the endpoint's default), streaming options."""

    model: str | None
    prompt: str | list[int] | None
    messages: list[dict] | None
    sampling: dict
    max_tokens: int | None
    stream: bool
    include_usage: bool
    add_generation_prompt: bool = True
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    return_token_ids: bool = False
    echo: bool = False  # completions: the prompt text (and its logprobs) come first
    top_logprobs: int | None = None  # the top tokens per position to show; None: no logprobs
    kv_transfer_params: dict | None = None  # disaggregated prefill/decode (vLLM's; checked by the engine)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except ValueError as e:  # every field was checked already; keep the message if not
            raise bad(str(e)) from None


MAX_N = 128  # OpenAI's limit on n


def _common(f: _Fields) -> dict:
    f.unsupported("logit_bias", lambda v: v == {})
    f.str_("user")
    stop = f.body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
            raise bad("stop must be a non-empty string or a list of at most 16 of them", param="stop", code="invalid_type")
    ids = f.body.get("stop_token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids)):
        raise bad("stop_token_ids must be a list of token ids >= 0", param="stop_token_ids", code="invalid_type")
    if ids and max(ids) > INT32_MAX:
        raise bad(f"stop_token_ids must be <= {INT32_MAX}, got {max(ids)}", param="stop_token_ids")
    seed = f.int_("seed", lo=INT64_MIN, hi=INT64_MAX)
    top_k = f.int_("top_k", lo=-1, hi=INT32_MAX, default=0)
    return dict(
        temperature=f.number("temperature", 0.0, 2.0, default=1.0),
        top_p=f.number("top_p", 0.0, 1.0, default=1.0, lo_open=True),
        top_k=top_k,
        seed=seed,
        stop=tuple(stop or ()),
        stop_token_ids=tuple(ids or ()),
        ignore_eos=f.bool_("ignore_eos", default=False),
        skip_special_tokens=f.bool_("skip_special_tokens", default=True),
        n=f.int_("n", lo=1, hi=MAX_N, default=1),
        presence_penalty=f.number("presence_penalty", -2.0, 2.0, default=0.0),
        frequency_penalty=f.number("frequency_penalty", -2.0, 2.0, default=0.0),
        repetition_penalty=_repetition(f),
        min_tokens=f.int_("min_tokens", lo=0, hi=INT32_MAX, default=0),
    )


def _kv_transfer_params(f: _Fields) -> dict | None:
    """An object or null here; its keys are the engine's to check (`RemoteKV.prepare`)."""
    return f.get("kv_transfer_params", lambda v: isinstance(v, dict), "an object", None)


def _repetition(f: _Fields) -> float:
    v = f.get("repetition_penalty", _is_number, "a number", 1.0)
    if not v > 0:
        raise bad(f"repetition_penalty must be > 0, got {v!r}", param="repetition_penalty")
    return v


def _check_min_tokens(sampling: dict, max_tokens: int | None) -> None:
    if max_tokens is not None and sampling["min_tokens"] > max_tokens:
        raise bad(f"min_tokens={sampling['min_tokens']} exceeds max_tokens={max_tokens}", param="min_tokens")


def _stream_options(f: _Fields, stream: bool) -> bool:
    opts = f.body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not isinstance(opts.get("include_usage", False), bool):
        raise bad("stream_options must be {\"include_usage\": true|false}", param="stream_options", code="invalid_type")
    return bool(opts.get("include_usage", False))


def parse_completion(body: Any) -> Parsed:
    f = _Fields(body, COMPLETION_FIELDS)
    model = f.str_("model")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt must not be empty", param="prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if min(prompt) < 0 or max(prompt) > INT32_MAX:
            raise bad(f"prompt token ids must be in [0, {INT32_MAX}]", param="prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("only one prompt per request is supported", param="prompt", code="unsupported_parameter")
    else:
        raise bad("prompt must be a string or a list of token ids", param="prompt", code="invalid_type")
    f.unsupported("suffix", lambda v: False)
    f.unsupported("best_of", lambda v: v == 1)
    echo = f.bool_("echo", default=False)
    logprobs = f.int_("logprobs", lo=0, hi=MAX_LOGPROBS)
    sampling = _common(f)
    sampling["logprobs"] = logprobs
    sampling["prompt_logprobs"] = logprobs if echo else None
    stream = f.bool_("stream", default=False)
    max_tokens = f.int_("max_tokens", lo=1, hi=INT32_MAX)
    _check_min_tokens(sampling, max_tokens if max_tokens is not None else 16)
    return Parsed(model, prompt, None, sampling, max_tokens, stream, _stream_options(f, stream),
                  return_token_ids=f.bool_("return_token_ids", default=False), echo=echo, top_logprobs=logprobs,
                  kv_transfer_params=_kv_transfer_params(f))


def _message_content(m: Mapping, i: int) -> str:
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content",
                          code="unsupported_parameter")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content",
              code="invalid_type")


def parse_chat(body: Any) -> Parsed:
    f = _Fields(body, CHAT_FIELDS)
    model = f.str_("model")
    messages = body.get("messages")
    if messages is None:
        raise bad("messages is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", param="messages", code="invalid_type")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role", param=f"messages[{i}]", code="invalid_type")
        if m.get("tool_calls"):
            raise bad("tool calls are not supported", param=f"messages[{i}].tool_calls", code="unsupported_parameter")
        entry = {"role": m["role"], "content": _message_content(m, i)}
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad(f"messages[{i}].name must be a string", param=f"messages[{i}].name", code="invalid_type")
        if isinstance(m.get("name"), str):
            entry["name"] = m["name"]
        clean.append(entry)
    logprobs = f.bool_("logprobs", default=False)
    top = f.int_("top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs needs logprobs: true", param="top_logprobs")
    f.unsupported("tools", lambda v: v == [])
    f.unsupported("tool_choice", lambda v: v == "none")
    f.unsupported("parallel_tool_calls", lambda v: isinstance(v, bool))
    f.unsupported("response_format", lambda v: v == {"type": "text"})
    sampling = _common(f)
    sampling["logprobs"] = (top or 0) if logprobs else None
    stream = f.bool_("stream", default=False)
    max_tokens = f.int_("max_tokens", lo=1, hi=INT32_MAX)
    mct = f.int_("max_completion_tokens", lo=1, hi=INT32_MAX)
    if max_tokens is not None and mct is not None and max_tokens != mct:
        raise bad("max_tokens and max_completion_tokens differ", param="max_completion_tokens")
    _check_min_tokens(sampling, max_tokens if max_tokens is not None else mct)
    kwargs = f.get("chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    reserved = sorted(set(kwargs) & TEMPLATE_ARGUMENTS)
    if reserved:
        raise bad(f"chat_template_kwargs must not set {reserved[0]!r}: the server sets it (pass "
                  "add_generation_prompt as a request field)", param="chat_template_kwargs")
    return Parsed(model, None, clean, sampling, max_tokens if max_tokens is not None else mct, stream,
                  _stream_options(f, stream), f.bool_("add_generation_prompt", default=True), dict(kwargs),
                  f.bool_("return_token_ids", default=False), top_logprobs=sampling["logprobs"],
                  kv_transfer_params=_kv_transfer_params(f))
