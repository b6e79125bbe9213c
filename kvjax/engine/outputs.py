"""What the engine returns per request (vLLM's shapes), and the text side of an output.

`RequestOutput(request_id, prompt, prompt_token_ids, outputs=[CompletionOutput(...)], finished)`
is cumulative: `outputs[0].text` and `.token_ids` hold everything generated so far, so a
streaming client sends `text[len(sent):]`. The text only ever grows: while a request runs,
`OutputText` holds back the last `len(longest stop string) - 1` characters (they could still
begin a stop string) and the detokeniser releases no incomplete character.

Stop handling follows vLLM's defaults: a stop string ends the output and is not part of the
text (the tokens that produced it stay in `token_ids`); a stop token (EOS or one of
`stop_token_ids`) stays in `token_ids` but its text is not added.

With `n > 1` a RequestOutput holds one CompletionOutput per completion (`index` 0..n-1), all
cumulative; logprobs are vLLM's: per position a dict {token id: Logprob}, the sampled (or
prompt) token first, then the most likely tokens, in order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class Logprob:
    """A token's log-probability (raw model distribution), its rank (1 = most likely) and its
    text on its own (vLLM's `Logprob`)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one position: {token id: Logprob}, the position's own token first, then the most likely ones
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (the request failed)
    stop_reason: int | str | None = None  # stop token id or stop string; None for EOS / length
    logprobs: list[PositionLogprobs] | None = None  # one per token of token_ids, when asked
    cumulative_logprob: float | None = None  # sum of the tokens' logprobs, when logprobs are asked

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Times on the engine's clock (seconds; compile time excluded unless the clock says otherwise)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # per prompt token (the first: None), when asked
    kv_transfer_params: dict | None = None  # a producer's offer of the prompt's KV (final output; docs/disaggregation.md)


class OutputText:
    """The output text of one request: incremental detokenisation plus stop strings."""

    def __init__(self, detokenizer, stop: Sequence[str]) -> None:
        self.detokenizer = detokenizer  # None: no tokenizer, no text
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.done = False

    def add(self, token_ids: Sequence[int], *, ends_with_stop_token: bool, finished: bool,
            check_stop: bool = True) -> str | None:
        """Append the text of new tokens (the last one is left out if it is a stop token);
        returns the stop string that ends the output, if one appeared (the text is then cut
        before it). `check_stop` False: look for no stop string in this text (min_tokens)."""
        if self.detokenizer is None or self.done:
            return None
        ids = list(token_ids[:-1]) if ends_with_stop_token else list(token_ids)
        start = len(self.text)
        if ids:
            self.text += self.detokenizer.push(ids)
        if finished:
            self.text += self.detokenizer.flush()
        if self.stop and check_stop:
            at = None
            for s in self.stop:
                i = self.text.find(s, max(0, start - self.hold))
                if i >= 0 and (at is None or i < at[0]):
                    at = (i, s)
            if at is not None:
                self.text = self.text[: at[0]]
                self.done = True
                return at[1]
        if finished:
            self.done = True
        return None

    def visible(self) -> str:
        """The text that can no longer change (all of it once the request finished)."""
        if self.done or not self.hold:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold)]
