"""What a request tells the cache: tokens, beams, reuse-isolation keys and retention wishes."""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from kvjax.config import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY


@dataclasses.dataclass(frozen=True)
class MultimodalItem:
    """A multimodal input occupying prompt positions `[start, start + length)`, identified by `hash`."""

    hash: bytes
    start: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.hash, (bytes, bytearray)) or not self.hash:
            raise ValueError(f"MultimodalItem.hash must be non-empty bytes, got {self.hash!r}")
        if len(self.hash) > 32:
            raise ValueError(f"MultimodalItem.hash holds at most 32 bytes, got {len(self.hash)}")
        if self.start < 0 or self.length < 1:
            raise ValueError(f"MultimodalItem needs start >= 0 and length >= 1, got {self.start=}, {self.length=}")


@dataclasses.dataclass(frozen=True)
class TokenRangeRetention:
    """Priority (0..100) and optional duration for the blocks whose first token is in `[start, end)`."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"retention range start must be >= 0, got {self.start}")
        if self.end is not None and self.end < self.start:
            raise ValueError(f"retention range has negative length: [{self.start}, {self.end})")
        _check_priority(self.priority)
        if self.duration_s is not None and self.duration_s < 0:
            raise ValueError(f"retention duration must be >= 0, got {self.duration_s}")


def _check_priority(p: int) -> None:
    if isinstance(p, bool) or not isinstance(p, int) or not MIN_PRIORITY <= p <= MAX_PRIORITY:
        raise ValueError(f"retention priority must be an int in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {p!r}")


@dataclasses.dataclass(frozen=True)
class RetentionConfig:
    """Per token-range retention plus the priority of blocks filled during decode."""

    ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        ranges = tuple(sorted(self.ranges, key=lambda r: r.start))
        object.__setattr__(self, "ranges", ranges)
        for prev, cur in zip(ranges, ranges[1:]):
            if prev.end is None:
                raise ValueError(f"retention range starting at {cur.start} follows an open-ended range")
            if cur.start < prev.end:
                raise ValueError(f"retention ranges overlap: [{prev.start}, {prev.end}) and [{cur.start}, {cur.end})")
        _check_priority(self.decode_priority)
        if self.decode_duration_s is not None and self.decode_duration_s < 0:
            raise ValueError(f"decode_duration_s must be >= 0, got {self.decode_duration_s}")

    def block_retention(self, block_index: int, tokens_per_block: int) -> tuple[int | None, float | None]:
        """(priority, duration) of the range holding the block's first token, else (None, None)."""
        first = block_index * tokens_per_block
        for r in self.ranges:
            if r.start <= first and (r.end is None or first < r.end):
                return r.priority, r.duration_s
        return None, None


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
        if hasattr(self.prompt, "tolist"):  # numpy / jax arrays
            self.prompt = self.prompt.tolist()
        if self.extra_ids is not None and hasattr(self.extra_ids, "tolist"):
            self.extra_ids = self.extra_ids.tolist()
        self.mm_items = tuple(self.mm_items)
        for name in ("max_new_tokens", "num_draft_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {self.beam_width!r}")
        if self.lora_task_id is not None and (isinstance(self.lora_task_id, bool) or not isinstance(self.lora_task_id, int)):
            raise ValueError(f"lora_task_id must be an int or None, got {self.lora_task_id!r}")
        if self.cache_salt is not None and (isinstance(self.cache_salt, bool) or not isinstance(self.cache_salt, (str, int))):
            raise ValueError(f"cache_salt must be a str, an int or None, got {self.cache_salt!r}")
        if self.extra_ids is not None and len(self.extra_ids) != len(self.prompt):
            raise ValueError(f"extra_ids needs one id per prompt token: {len(self.extra_ids)=} != {len(self.prompt)=}")
        for item in self.mm_items:
            if not isinstance(item, MultimodalItem):
                raise ValueError(f"mm_items must hold MultimodalItem, got {item!r}")
            if item.start + item.length > len(self.prompt):
                raise ValueError(f"multimodal item [{item.start}, {item.start + item.length}) exceeds the prompt ({len(self.prompt)} tokens)")
        if self.encoder_len is not None and (not isinstance(self.encoder_len, int) or self.encoder_len < 1):
            raise ValueError(f"encoder_len must be a positive int or None, got {self.encoder_len!r}")
        if self.retention is not None and not isinstance(self.retention, RetentionConfig):
            raise ValueError(f"retention must be a RetentionConfig or None, got {self.retention!r}")
