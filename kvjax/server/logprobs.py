"""Logprobs in OpenAI's response shapes, from the engine's vLLM-style per-position dicts.

Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; a position's
`top_logprobs` maps token text to logprob for the position's own token and the N most likely
(up to N + 1 entries, as OpenAI's legacy API and vLLM); a position without logprobs (the first
prompt token under `echo`) is null in both lists. Chat: `{"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}` with the N most likely tokens.
A logprob of -inf is sent as -9999.0, as OpenAI does (JSON has no infinity).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from kvjax.engine.outputs import PositionLogprobs


def _finite(x: float) -> float:
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


class TokenText:
    """A token id's text on its own, as the logprobs show it (special tokens included)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token: int, known: str | None = None) -> str:
        if known is not None:
            return known
        if self.tokenizer is None:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)


class CompletionLogprobs:
    """Builds a choice's completions `logprobs` object in pieces (streaming sends each
    chunk's tokens; `text_offset` continues across chunks)."""

    def __init__(self, text: TokenText, num: int, offset: int = 0) -> None:
        self.text = text
        self.num = num
        self.offset = offset

    def build(self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, pos in zip(token_ids, positions, strict=True):
            if pos is None:
                s = self.text(token)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                own = pos[token]
                s = self.text(token, own.decoded_token)
                out["token_logprobs"].append(_finite(own.logprob))
                top: dict[str, float] = {}
                for i, (t, lp) in enumerate(pos.items()):  # the token first, then the most likely
                    if i > self.num:
                        break
                    top.setdefault(self.text(t, lp.decoded_token), _finite(lp.logprob))
                out["top_logprobs"].append(top)
            out["tokens"].append(s)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


def chat_logprobs(text: TokenText, num: int, token_ids: Sequence[int], positions: Sequence[PositionLogprobs]) -> dict:
    """A chat choice's `logprobs`: each token with its logprob and bytes, and the `num` most
    likely tokens of its position."""
    content = []
    for token, pos in zip(token_ids, positions, strict=True):
        own = pos[token]
        s = text(token, own.decoded_token)
        ranked = sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else math.inf)[:num]
        top = []
        for t, lp in ranked:
            ts = text(t, lp.decoded_token)
            top.append({"token": ts, "logprob": _finite(lp.logprob), "bytes": list(ts.encode("utf-8"))})
        content.append({"token": s, "logprob": _finite(own.logprob), "bytes": list(s.encode("utf-8")), "top_logprobs": top})
    return {"content": content}
