"""Routing policies: pick a replica for a request from each replica's load and cached prefix.

Pure functions of their inputs (plus, for ties, when each replica was last chosen), so they
are unit-tested without a network. The KV-aware cost function (docs/routing.md):

    mean   = (sum of loads + 1) / replicas          the mean load once this request is placed
    hit_r  = (gpu_tokens_r + w * other_tokens_r) / prompt_tokens      in [0, 1]
    score_r = hit_r - alpha * (load_r + 1) / mean

A replica is eligible only if placing the request there keeps it under the imbalance cap:
`load_r + 1 <= max(cap * mean, min_load + 1 + slack)` (the slack keeps a few requests of
freedom when loads are small, where a ratio means little). The highest score wins; ties go to
the lower load, then to the replica chosen least recently (never chosen: the first in order),
so replicas that keep tying take turns, whatever the requests between the ties did. (A
rotation by call count would not: with two of four replicas tied on every other call, it gave
the first of them three ties in four.)
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Hashable, Sequence


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One replica as a policy sees it. `load`: requests routed there and not finished;
    `gpu_tokens` / `other_tokens`: leading prompt tokens it holds on the GPU / on a slower tier."""

    replica: Hashable
    load: int
    gpu_tokens: int = 0
    other_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("load", "gpu_tokens", "other_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Candidate.{name} must be an int >= 0, got {v!r}")


class RoutingPolicy(abc.ABC):
    name: str = ""

    def __init__(self) -> None:
        self._turn = 0  # calls of choose so far
        self._last: dict[Hashable, int] = {}  # replica -> the turn it was last chosen

    def choose(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> int:
        """Index into `candidates` (distinct replicas) of the replica that gets the request."""
        if not candidates:
            raise ValueError("no replica to route to")
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be a positive int, got {prompt_tokens!r}")
        if len({c.replica for c in candidates}) != len(candidates):
            raise ValueError(f"candidates must be distinct replicas, got {[c.replica for c in candidates]!r}")
        i = self._choose(prompt_tokens, candidates)
        self._last[candidates[i].replica] = self._turn
        self._turn += 1
        return i

    def _least_recent(self, tied: Sequence[int], candidates: Sequence[Candidate]) -> int:
        """Of equally good candidates, the one chosen least recently (never chosen first)."""
        last = self._last
        return min(tied, key=lambda i: last.get(candidates[i].replica, -1))

    @abc.abstractmethod
    def _choose(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> int: ...


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"

    def _choose(self, prompt_tokens, candidates):
        return self._turn % len(candidates)


class LeastLoadedPolicy(RoutingPolicy):
    name = "least-loaded"

    def _choose(self, prompt_tokens, candidates):
        least = min(c.load for c in candidates)
        return self._least_recent([i for i, c in enumerate(candidates) if c.load == least], candidates)


class KVAwarePolicy(RoutingPolicy):
    """Maximise cached-prefix overlap, balanced against load (see the module docstring)."""

    name = "kv-aware"

    def __init__(self, alpha: float = 0.5, imbalance_cap: float = 1.25, slack: int = 2, other_tier_weight: float = 0.8) -> None:
        super().__init__()
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {alpha!r}")
        if not imbalance_cap >= 1:
            raise ValueError(f"imbalance_cap must be >= 1, got {imbalance_cap!r}")
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ValueError(f"slack must be an int >= 0, got {slack!r}")
        if not 0 <= other_tier_weight <= 1:
            raise ValueError(f"other_tier_weight must be in [0, 1], got {other_tier_weight!r}")
        self.alpha = alpha
        self.imbalance_cap = imbalance_cap
        self.slack = slack
        self.other_tier_weight = other_tier_weight

    def scores(self, prompt_tokens: int, candidates: Sequence[Candidate]) -> list[float | None]:
        """Each candidate's score, None where the imbalance cap excludes it."""
        n = len(candidates)
        mean = (sum(c.load for c in candidates) + 1) / n
        limit = max(self.imbalance_cap * mean, min(c.load for c in candidates) + 1 + self.slack)
        out: list[float | None] = []
        for c in candidates:
            if c.load + 1 > limit:
                out.append(None)
                continue
            hit = min(1.0, (c.gpu_tokens + self.other_tier_weight * c.other_tokens) / prompt_tokens)
            out.append(hit - self.alpha * (c.load + 1) / mean)
        return out

    def _choose(self, prompt_tokens, candidates):
        scores = self.scores(prompt_tokens, candidates)
        eligible = {i: s for i, s in enumerate(scores) if s is not None}
        best = max(eligible.values())
        top = [i for i, s in eligible.items() if s == best]
        least = min(candidates[i].load for i in top)
        return self._least_recent([i for i in top if candidates[i].load == least], candidates)


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (KVAwarePolicy, RoundRobinPolicy, LeastLoadedPolicy)
}


def make_policy(name: str, **kwargs) -> RoutingPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"routing policy must be one of {sorted(POLICIES)}, got {name!r}") from None
    return cls(**kwargs)
