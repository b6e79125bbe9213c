"""Tier-3 policies with SGLang HiCache's names and meanings, as pure decision objects (no I/O).

`WritePolicy` decides when a block that lives in the host tier is written to the store;
`PrefetchPolicy` decides whether the store is consulted for a request and when a running
prefetch stops. The engine feeds them events and does what they answer; they never touch a
store, a clock or the ledger (elapsed time is an argument), so a trace replays exactly.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclasses.dataclass
class _HostBlock:
    uses: int = 1  # the store to host counts as the first use
    in_store: bool = False  # the store holds it (written by us, or it came from the store)
    writing: bool = False  # a put is in flight
    evicted: bool = False  # left the host tier while its put was in flight


class WritePolicy:
    """When host-tier blocks are written to the store (keys are store keys).

    * `write_through`: every block is written as soon as its host copy is stored (SGLang's
      threshold 1); the store mirrors the host tier, and a host eviction loses nothing.
    * `write_through_selective`: a block is written once it has been used `selective_uses`
      times (default 2: its host store plus one hit), so one-off prompts never reach the
      store; a block evicted from host before that is dropped.
    * `write_back`: nothing is written until the host tier evicts the block; the caller keeps
      the evicted slot pinned until the put is polled (`on_store_result`).

    A block that came into the host tier from the store (`from_store=True`) is never written
    back. State is kept only for blocks in the host tier (it is dropped on host eviction), so
    it is bounded by the host pool size. Each `on_*` method returns the keys to put now;
    `on_store_result` reports a put's outcome (a failed write-through put is retried on the
    block's next hit, a failed write-back put is dropped with the block).
    """

    def __init__(self, name: str = "write_through", *, selective_uses: int = 2) -> None:
        if name not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {name!r}")
        if isinstance(selective_uses, bool) or not isinstance(selective_uses, int) or selective_uses < 1:
            raise ValueError(f"selective_uses must be a positive int, got {selective_uses!r}")
        self.name = name
        self.threshold = 1 if name == "write_through" else selective_uses
        self._blocks: dict[str, _HostBlock] = {}
        self.puts_requested = 0

    def _want(self, key: str, b: _HostBlock) -> bool:
        if b.in_store or b.writing:
            return False
        if self.name == "write_back" or b.uses < self.threshold:
            return False
        b.writing = True
        self.puts_requested += 1
        return True

    def on_host_stored(self, keys: Iterable[str], *, from_store: bool = False) -> list[str]:
        """Blocks whose host copy is now complete (offloaded from device, or restored from the
        store); returns those to write now."""
        out = []
        for k in keys:
            b = self._blocks.get(k)
            if b is None:
                b = self._blocks[k] = _HostBlock(in_store=from_store)
            else:
                b.in_store = b.in_store or from_store
            if self._want(k, b):
                out.append(k)
        return out

    def on_hit(self, keys: Iterable[str]) -> list[str]:
        """Host blocks a request reused; returns those that have now earned a write."""
        out = []
        for k in keys:
            b = self._blocks.get(k)
            if b is None:
                continue  # not in the host tier: the policy has nothing to decide
            b.uses += 1
            if self._want(k, b):
                out.append(k)
        return out

    def on_host_evicted(self, keys: Iterable[str]) -> list[str]:
        """Blocks the host tier is evicting; returns those to write before the slot is reused
        (write_back only). State for the others is dropped."""
        out = []
        for k in keys:
            b = self._blocks.get(k)
            if b is None:
                continue
            if self.name == "write_back" and not b.in_store and not b.writing:
                b.writing = True
                self.puts_requested += 1
                out.append(k)
            if b.writing:
                b.evicted = True
            else:
                del self._blocks[k]
        return out

    def on_store_result(self, keys: Iterable[str], ok: Iterable[bool]) -> None:
        """Outcome of a put this policy asked for."""
        for k, good in zip(keys, ok, strict=True):
            b = self._blocks.get(k)
            if b is None:
                continue
            b.writing = False
            b.in_store = bool(good)
            if b.evicted:
                del self._blocks[k]

    def on_store_removed(self, keys: Iterable[str]) -> None:
        """The store lost blocks (evicted or removed): host copies may be written again."""
        for k in keys:
            b = self._blocks.get(k)
            if b is not None:
                b.in_store = False

    def tracked(self) -> int:
        """Blocks the policy holds state for (host blocks, plus evicted ones with a put in flight)."""
        return len(self._blocks)


@dataclasses.dataclass(frozen=True)
class PrefetchDecision:
    """`stop`: end the prefetch now; `use_blocks`: how many leading blocks of the request the
    engine may take from it (the completed prefix; the rest are recomputed)."""

    stop: bool
    use_blocks: int


class PrefetchPolicy:
    """Whether to consult the store for a request, and when a running prefetch stops.

    * `min_hit_tokens` (SGLang's prefetch threshold, default 256): the store is not consulted
      when fewer tokens than that are missing locally, and a lookup that finds fewer is not
      fetched: below it, a round trip costs more than recomputing.
    * `best_effort`: stop whenever the scheduler is ready to run the request, using what has
      arrived by then.
    * `wait_complete`: never stop early; the request waits for every block it asked for.
    * `timeout`: like `wait_complete` up to `timeout_base_s + timeout_per_block_s * blocks`
      seconds after the prefetch started, then like `best_effort`.
    """

    def __init__(
        self,
        name: str = "timeout",
        *,
        tokens_per_block: int,
        min_hit_tokens: int = 256,
        timeout_base_s: float = 0.5,
        timeout_per_block_s: float = 0.002,
    ) -> None:
        if name not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch policy must be one of {PREFETCH_POLICIES}, got {name!r}")
        if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")
        if isinstance(min_hit_tokens, bool) or not isinstance(min_hit_tokens, int) or min_hit_tokens < 0:
            raise ValueError(f"min_hit_tokens must be an int >= 0, got {min_hit_tokens!r}")
        for n, v in (("timeout_base_s", timeout_base_s), ("timeout_per_block_s", timeout_per_block_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{n} must be a number >= 0, got {v!r}")
        self.name = name
        self.tokens_per_block = tokens_per_block
        self.min_hit_tokens = min_hit_tokens
        self.timeout_base_s = float(timeout_base_s)
        self.timeout_per_block_s = float(timeout_per_block_s)

    def should_consult(self, missing_tokens: int) -> bool:
        """Whether to look the request's uncached blocks up at all."""
        return missing_tokens >= max(self.min_hit_tokens, self.tokens_per_block)

    def should_fetch(self, hit_blocks: int) -> bool:
        """Whether a lookup that found `hit_blocks` leading blocks is worth fetching."""
        return hit_blocks > 0 and hit_blocks * self.tokens_per_block >= self.min_hit_tokens

    def deadline_s(self, blocks: int) -> float:
        """Seconds a `timeout` prefetch of `blocks` blocks may run."""
        return self.timeout_base_s + self.timeout_per_block_s * blocks

    def decide(self, *, elapsed_s: float, blocks: int, done_prefix: int, scheduler_ready: bool) -> PrefetchDecision:
        """One look at a running prefetch of `blocks` blocks, `done_prefix` of whose leading
        blocks have arrived, `elapsed_s` after it started; `scheduler_ready` says the
        scheduler could run the request now."""
        if not 0 <= done_prefix <= blocks:
            raise ValueError(f"done_prefix must be in [0, {blocks}], got {done_prefix}")
        if done_prefix == blocks:
            return PrefetchDecision(True, blocks)
        if self.name == "wait_complete":
            return PrefetchDecision(False, 0)
        if self.name == "timeout" and elapsed_s < self.deadline_s(blocks):
            return PrefetchDecision(False, 0)
        if self.name == "timeout" or scheduler_ready:
            return PrefetchDecision(True, done_prefix)
        return PrefetchDecision(False, 0)
