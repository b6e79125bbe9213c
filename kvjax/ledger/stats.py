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
    alloc_total: int
    alloc_new: int
    reused_full: int
    reused_partial: int
    missed: int
    gen_alloc: int
    offloaded: int
    onboarded: int
    copied: int
    offload_bytes: int
    onboard_bytes: int
    copy_bytes: int
    evicted: int

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


# ---------------------------------------------------------------------------- aggregation
def counter_totals(windows) -> list[int]:
    """Every counter summed over the window managers (in `Counters.__slots__` order)."""
    totals = [0] * len(Counters.__slots__)
    for wm in windows:
        totals = [a + b for a, b in zip(totals, wm.counters.as_tuple(), strict=True)]
    return totals


def cache_stats(windows, tokens_per_block: int) -> KVCacheStats:
    c = dict(zip(Counters.__slots__, counter_totals(windows), strict=True))
    reused = c["reused_full"] + c["reused_partial"]
    max_blocks = sum(wm.num_primary for wm in windows)
    free = sum(wm.num_free_primary for wm in windows)
    return KVCacheStats(
        max_num_blocks=max_blocks,
        free_num_blocks=free,
        used_num_blocks=max_blocks - free,
        tokens_per_block=tokens_per_block,
        alloc_total_blocks=c["alloc_total"],
        alloc_new_blocks=c["alloc_new"],
        reused_blocks=reused,
        missed_blocks=c["missed"],
        cache_hit_rate=hit_rate(reused, c["missed"]),
        num_free_blocks_per_window={wm.window: wm.num_free_primary for wm in windows},
        max_secondary_blocks=sum(wm.num_secondary for wm in windows),
        free_secondary_blocks=sum(wm.num_free_secondary for wm in windows),
        offloaded_blocks=c["offloaded"],
        onboarded_blocks=c["onboarded"],
        copied_blocks=c["copied"],
        evicted_blocks=c["evicted"],
        allocated_bytes=sum(wm.block_bytes * (wm.num_primary - wm.num_free_primary) for wm in windows),
    )


def iteration_stats(windows, base: list[int]) -> tuple[IterationStats, list[int]]:
    """Counters since `base` (an earlier `counter_totals`) plus occupancy, and the new base."""
    now = counter_totals(windows)
    d = dict(zip(Counters.__slots__, (a - b for a, b in zip(now, base, strict=True)), strict=True))
    reused = d["reused_full"] + d["reused_partial"]
    p_free = sum(wm.num_free_primary for wm in windows)
    s_free = sum(wm.num_free_secondary for wm in windows)
    stats = IterationStats(
        alloc_total_blocks=d["alloc_total"],
        alloc_new_blocks=d["alloc_new"],
        reused_blocks=reused,
        full_reused_blocks=d["reused_full"],
        partial_reused_blocks=d["reused_partial"],
        missed_blocks=d["missed"],
        cache_hit_rate=hit_rate(reused, d["missed"]),
        gen_alloc_blocks=d["gen_alloc"],
        offloaded_blocks=d["offloaded"],
        onboarded_blocks=d["onboarded"],
        copied_blocks=d["copied"],
        offload_bytes=d["offload_bytes"],
        onboard_bytes=d["onboard_bytes"],
        copy_bytes=d["copy_bytes"],
        evicted_blocks=d["evicted"],
        primary_used_blocks=sum(wm.num_primary for wm in windows) - p_free,
        primary_free_blocks=p_free,
        secondary_used_blocks=sum(wm.num_secondary for wm in windows) - s_free,
        secondary_free_blocks=s_free,
    )
    return stats, now
