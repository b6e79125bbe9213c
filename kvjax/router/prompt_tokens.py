"""A request's prompt as the token ids a replica computes for it, for the router to hash: the
text prompt with special tokens, or the chat template's text without them, or the ids sent."""
from __future__ import annotations

from kvjax._math import ceil_div
from kvjax.server.protocol import Parsed


def prompt_token_ids(parsed: Parsed, tokenizer, max_seq_len: int | None = None) -> list[int] | None:
    """The prompt's token ids exactly as a replica computes them (None if this router cannot:
    a text prompt without a tokenizer, a chat its template refuses; or should not: a prompt
    longer than `max_seq_len` tokens, which no replica serves, is neither tokenised, when its
    length alone says so, nor hashed; the replica answers). Slow on long prompts: call it off
    the event loop."""

    def fits(ids: list[int]) -> list[int] | None:
        return None if max_seq_len is not None and len(ids) > max_seq_len else ids

    def too_long(text: str) -> bool:
        per = tokenizer.max_chars_per_token()
        return max_seq_len is not None and per is not None and ceil_div(len(text), per) > max_seq_len

    if parsed.messages is not None:
        if tokenizer is None:
            return None
        try:
            text = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=parsed.add_generation_prompt,
                                                 **parsed.template_kwargs)
        except (ValueError, TypeError, LookupError, AttributeError):
            return None
        return None if too_long(text) else fits(tokenizer.encode(text, add_special_tokens=False))
    if isinstance(parsed.prompt, str):
        if tokenizer is None or too_long(parsed.prompt):
            return None
        return fits(tokenizer.encode(parsed.prompt, add_special_tokens=True))
    assert parsed.prompt is not None  # a completion request without a prompt was refused when parsed
    return fits(list(parsed.prompt))
