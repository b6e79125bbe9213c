"""What a request tells the cache: tokens, beams, reuse-isolation keys and retention wishes."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable, Sequence
from typing import cast

from kvjax.config import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY
from kvjax.errors import InvalidRequestError
from kvjax.validation import (
    INT32_MAX,
    UINT64_END,
    check_duration,
    check_hashable_id,
    check_int,
    check_int_list,
    check_opt_int,
    check_sequence,
)


@dataclasses.dataclass(frozen=True)
class MultimodalItem:
    """A multimodal input occupying prompt positions `[start, start + length)`, identified by `hash`."""

    hash: bytes
    start: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.hash, (bytes, bytearray)) or not self.hash:
            raise InvalidRequestError(f"MultimodalItem.hash must be non-empty bytes, got {self.hash!r}")
        if len(self.hash) > 32:
            raise InvalidRequestError(f"MultimodalItem.hash holds at most 32 bytes, got {len(self.hash)}")
        object.__setattr__(self, "hash", bytes(self.hash))  # a bytearray could change after validation
        object.__setattr__(self, "start", check_int("MultimodalItem.start", self.start, error=InvalidRequestError))
        object.__setattr__(self, "length", check_int("MultimodalItem.length", self.length, 1, error=InvalidRequestError))


@dataclasses.dataclass(frozen=True)
class TokenRangeRetention:
    """Priority (0..100) and optional duration for the blocks whose first token is in `[start, end)`."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "start", check_int("retention range start", self.start, error=InvalidRequestError))
        set_(self, "end", check_opt_int("retention range end", self.end, error=InvalidRequestError))
        if self.end is not None and self.end < self.start:
            raise InvalidRequestError(f"retention range has negative length: [{self.start}, {self.end})")
        set_(self, "priority", _check_priority(self.priority))
        set_(self, "duration_s", check_duration("retention duration_s", self.duration_s, error=InvalidRequestError))


def _check_priority(p: object) -> int:
    return check_int("retention priority", p, MIN_PRIORITY, MAX_PRIORITY, error=InvalidRequestError)


@dataclasses.dataclass(frozen=True)
class RetentionConfig:
    """Per token-range retention plus the priority of blocks filled during decode."""

    ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        ranges = check_sequence("RetentionConfig.ranges", self.ranges, error=InvalidRequestError)
        for r in ranges:
            if not isinstance(r, TokenRangeRetention):
                raise InvalidRequestError(f"RetentionConfig.ranges must hold TokenRangeRetention, got {r!r}")
        ranges = tuple(sorted(ranges, key=lambda r: r.start))
        object.__setattr__(self, "ranges", ranges)
        for prev, cur in itertools.pairwise(ranges):
            if prev.end is None:
                raise InvalidRequestError(f"retention range starting at {cur.start} follows an open-ended range")
            if cur.start < prev.end:
                raise InvalidRequestError(f"retention ranges overlap: [{prev.start}, {prev.end}) and [{cur.start}, {cur.end})")
        object.__setattr__(self, "decode_priority", _check_priority(self.decode_priority))
        object.__setattr__(
            self, "decode_duration_s", check_duration("decode_duration_s", self.decode_duration_s, error=InvalidRequestError)
        )


_PLAIN_ID_TYPES = frozenset((int, str))


def _plain_id(rid: object) -> bool:
    """An int, a str, or a flat tuple of them: hashable and equal to itself by construction,
    so `check_hashable_id` has nothing to find (engines often key requests by a tuple such as
    (client, number))."""
    t = type(rid)
    return t is int or t is str or (t is tuple and set(map(type, cast("tuple", rid))) <= _PLAIN_ID_TYPES)


@dataclasses.dataclass
class Request:
    """One sequence to cache. `prompt` is token ids; `extra_ids` (one per prompt token) separate
    identical token ids with different meaning (e.g. prompt-tuning embeddings)."""

    request_id: Hashable
    prompt: Sequence[int]
    max_new_tokens: int = 0
    beam_width: int = 1
    lora_task_id: int | None = None
    cache_salt: str | int | None = None
    extra_ids: Sequence[int] | None = None
    mm_items: tuple[MultimodalItem, ...] = ()
    retention: RetentionConfig | None = None
    num_draft_tokens: int = 0
    encoder_len: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def _plain(self) -> bool:
        """True when every field already has the form `validate` would leave it in and passes
        its checks (the common request: an int, str or flat tuple id, list prompt, defaults
        elsewhere), so admission does not pay for the general checks twice."""
        n, d, w = self.max_new_tokens, self.num_draft_tokens, self.beam_width
        return (
            _plain_id(self.request_id)
            and (type(self.prompt) is list or type(self.prompt) is tuple)
            and type(n) is int and 0 <= n <= INT32_MAX
            and type(d) is int and 0 <= d <= INT32_MAX
            and type(w) is int and 1 <= w <= INT32_MAX
            and type(self.mm_items) is tuple and not self.mm_items
            and self.extra_ids is None and self.lora_task_id is None and self.encoder_len is None
            and (self.cache_salt is None or type(self.cache_salt) is str)
            and (self.retention is None or isinstance(self.retention, RetentionConfig))
        )

    def validate(self) -> None:
        """Check and normalise every field (numpy integers become ints); the ledger calls it
        again at admission, since a Request can be changed after construction.

        Structure and every scalar field are checked here; prompt token *values* are checked
        where they are used (admission, scheduler queries): prompts are long, and admission
        already reads every token it cannot match.
        """
        if self._plain():
            return
        err = InvalidRequestError
        check_hashable_id("request_id", self.request_id)
        if hasattr(self.prompt, "tolist") and not isinstance(self.prompt, (list, tuple)):  # numpy / jax arrays
            if getattr(self.prompt, "ndim", 1) != 1:
                raise err(f"prompt must be one-dimensional, got shape {getattr(self.prompt, 'shape', None)}")
            self.prompt = self.prompt.tolist()
        if not isinstance(self.prompt, (list, tuple)):
            raise err(f"prompt must be a list of token ids, got {type(self.prompt).__name__}")
        if self.extra_ids is not None:
            # one extra id per prompt token, unsigned 64-bit like TensorRT-LLM's
            self.extra_ids = check_int_list("extra_ids", self.extra_ids, 0, UINT64_END - 1, error=err)
            if len(self.extra_ids) != len(self.prompt):
                raise err(f"extra_ids needs one id per prompt token: {len(self.extra_ids)=} != {len(self.prompt)=}")
        self.mm_items = check_sequence("mm_items", self.mm_items, error=err)
        self.max_new_tokens = check_int("max_new_tokens", self.max_new_tokens, error=err)
        self.num_draft_tokens = check_int("num_draft_tokens", self.num_draft_tokens, error=err)
        self.beam_width = check_int("beam_width", self.beam_width, 1, error=err)
        self.lora_task_id = check_opt_int("lora_task_id", self.lora_task_id, 0, UINT64_END - 1, error=err)
        salt = self.cache_salt
        if salt is not None and not isinstance(salt, str):
            self.cache_salt = check_int("cache_salt", salt, 0, UINT64_END - 1, error=err)  # or a str
        for item in self.mm_items:
            if not isinstance(item, MultimodalItem):
                raise err(f"mm_items must hold MultimodalItem, got {item!r}")
            if item.start + item.length > len(self.prompt):
                raise err(
                    f"multimodal item [{item.start}, {item.start + item.length}) exceeds the prompt ({len(self.prompt)} tokens)"
                )
        self.encoder_len = check_opt_int("encoder_len", self.encoder_len, 1, error=err)
        if self.retention is not None and not isinstance(self.retention, RetentionConfig):
            raise err(f"retention must be a RetentionConfig or None, got {self.retention!r}")
