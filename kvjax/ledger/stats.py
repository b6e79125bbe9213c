"""Statistics: global (`KVCacheStats`), per request (`RequestStats`) and per iteration
(`IterationStats`), all derived from one set of monotonically increasing counters."""
from __future__ import annotations

import dataclasses


class Counters:
    """Monotonic counters of one window manager (snapshots are subtracted for deltas)."""

    __slots__ = (
        "alloc_total",
        "alloc_new",
        "reused_full",
        "reused_partial",
        "missed",
        "gen_alloc",
        "offloaded",
        "onboarded",
        "copied",
        "offload_bytes",
        "onboard_bytes",
        "copy_bytes",
        "evicted",
    )

    def __init__(self) -> None:
        for f in self.__slots__:
            setattr(self, f, 0)

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, f) for f in self.__slots__)


def hit_rate(reused: int, missed: int) -> float:
    return 0.0 if reused == 0 else reused / (reused + missed)


@dataclasses.dataclass(frozen=True)
class KVCacheStats:
    """Global statistics, summed over window managers (per-window figures in the dicts)."""

    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    missed_blocks: int
    cache_hit_rate: float
    num_free_blocks_per_window: dict[int, int]
    max_secondary_blocks: int
    free_secondary_blocks: int
    offloaded_blocks: int
    onboarded_blocks: int
    copied_blocks: int
    evicted_blocks: int
    allocated_bytes: int


@dataclasses.dataclass(frozen=True)
class RequestStats:
    """What `add_sequence` did for one request (TensorRT-LLM's per-request counters)."""

    reused_blocks: int
    missed_blocks: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    cache_hit_rate: float
    prepopulated_tokens: int


@dataclasses.dataclass(frozen=True)
class IterationStats:
    """Deltas since the previous `iteration_stats()` call, plus current occupancy."""

    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    full_reused_blocks: int
    partial_reused_blocks: int
    missed_blocks: int
    cache_hit_rate: float
    gen_alloc_blocks: int
    offloaded_blocks: int
    onboarded_blocks: int
    copied_blocks: int
    offload_bytes: int
    onboard_bytes: int
    copy_bytes: int
    evicted_blocks: int
    primary_used_blocks: int
    primary_free_blocks: int
    secondary_used_blocks: int
    secondary_free_blocks: int
