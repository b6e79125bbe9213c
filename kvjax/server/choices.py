"""The `choices` of a response, one per completion (`n`), with `logprobs`, `echo` and
`stop_reason` as OpenAI / vLLM send them; and their streamed form (per-index deltas)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from kvjax.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from kvjax.server.logprobs import CompletionLogprobs, TokenText, chat_logprobs
from kvjax.server.protocol import Parsed


@dataclasses.dataclass
class ChoiceFormat:
    """What shapes a request's choices: the parsed request, the endpoint, the prompt's text
    (for `echo`) and the token texts of logprobs."""

    parsed: Parsed
    chat: bool
    prompt_text: str
    token_text: TokenText

    def _logprobs(self, out: RequestOutput, c: CompletionOutput, builder: CompletionLogprobs | None,
                  start: int, end: int, with_prompt: bool):
        """The logprobs object of tokens [start, end) of `c` (and of the prompt first, when
        echoing it); None when the request asked for none."""
        num = self.parsed.top_logprobs
        if num is None:
            return None
        assert c.logprobs is not None  # the engine computed them: the request asked
        if self.chat:
            return chat_logprobs(self.token_text, num, c.token_ids[start:end], c.logprobs[start:end])
        assert builder is not None
        ids = list(c.token_ids[start:end])
        positions: list[PositionLogprobs | None] = list(c.logprobs[start:end])
        if with_prompt:
            assert out.prompt_logprobs is not None  # echo with logprobs asks for them
            ids, positions = list(out.prompt_token_ids) + ids, list(out.prompt_logprobs) + positions
        return builder.build(ids, positions)

    def builder(self) -> CompletionLogprobs | None:
        if self.chat or self.parsed.top_logprobs is None:
            return None
        return CompletionLogprobs(self.token_text, self.parsed.top_logprobs)

    def choices(self, out: RequestOutput) -> list[dict]:
        """The choices of a finished request (non-streaming)."""
        result = []
        for c in out.outputs:
            logprobs = self._logprobs(out, c, self.builder(), 0, len(c.token_ids), self.parsed.echo)
            if self.chat:
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            else:
                text = self.prompt_text + c.text if self.parsed.echo else c.text
                choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}
            if self.parsed.return_token_ids:
                choice["token_ids"] = c.token_ids
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            result.append(choice)
        return result


class StreamChoices:
    """Per-index streaming state: what text and tokens each completion has sent so far."""

    def __init__(self, fmt: ChoiceFormat) -> None:
        self.fmt = fmt
        self.n = fmt.parsed.sampling.get("n", 1)
        self.sent = [0] * self.n
        self.sent_ids = [0] * self.n
        self.done = [False] * self.n
        self.builders = [fmt.builder() for _ in range(self.n)]
        self.echoed = False

    def _choice(self, index: int, delta: str | None, finish, logprobs, ids: list[int] | None, stop_reason=None) -> dict:
        fmt = self.fmt
        if fmt.chat:
            choice = {"index": index, "delta": {} if delta is None else {"content": delta}, "logprobs": logprobs,
                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if fmt.parsed.return_token_ids:
            choice["token_ids"] = ids or []
        return choice

    def roles(self) -> Iterator[dict]:
        """Chat: the first chunk of every completion carries the role."""
        for i in range(self.n):
            yield {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def update(self, out: RequestOutput) -> Iterator[dict]:
        """The choices to send for a new cumulative output."""
        fmt = self.fmt
        if fmt.parsed.echo and not self.echoed and not fmt.chat:  # the prompt first, once, with its logprobs
            self.echoed = True
            for i, b in enumerate(self.builders):
                lp = None
                if b is not None:
                    assert out.prompt_logprobs is not None  # echo with logprobs asks for them
                    lp = b.build(list(out.prompt_token_ids), list(out.prompt_logprobs))
                yield self._choice(i, fmt.prompt_text, None, lp, [])
        for c in out.outputs:
            i = c.index
            if self.done[i]:
                continue
            delta = c.text[self.sent[i]:]
            self.sent[i] = len(c.text)
            if delta:
                end = len(c.token_ids)
                lp = fmt._logprobs(out, c, self.builders[i], self.sent_ids[i], end, False)
                yield self._choice(i, delta, None, lp, c.token_ids[self.sent_ids[i]:end])
                self.sent_ids[i] = end
            if c.finish_reason is not None:
                self.done[i] = True
                end = len(c.token_ids)
                lp = fmt._logprobs(out, c, self.builders[i], self.sent_ids[i], end, False)
                yield self._choice(i, None if fmt.chat else "", c.finish_reason, lp, c.token_ids[self.sent_ids[i]:end],
                                   c.stop_reason)
                self.sent_ids[i] = end
