"""`Router`: the transport-free core of KV-aware routing.

It hashes a request's prompt exactly as the replicas' ledgers do
(`kvjax.ledger.block_hashing.prompt_block_hashes`: the full blocks admission can reuse), looks the
chain up in a `PrefixIndex` fed by the replicas' KV events, and lets a `RoutingPolicy` choose
from each replica's cached prefix and load. Load is what the router itself knows: requests it
sent to a replica that have not finished. The HTTP front and the route simulation both drive
this class.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Hashable, Sequence

from kvjax.ledger.block_hashing import prompt_block_hashes
from kvjax.router.index import PrefixIndex, PrefixMatch
from kvjax.router.policy import Candidate, RoutingPolicy


@dataclasses.dataclass(frozen=True)
class RouteDecision:
    replica: Hashable
    match: PrefixMatch  # the chosen replica's cached prefix (blocks)
    num_hashes: int  # full blocks of the prompt that a replica could reuse


class Router:
    def __init__(
        self,
        replicas: Sequence[Hashable],
        policy: RoutingPolicy,
        *,
        tokens_per_block: int | None,
        hash_kind: str = "sha256",
        index: PrefixIndex | None = None,
    ) -> None:
        """`tokens_per_block` None: not known yet (a front that learns it from the replicas
        calls `configure_hashing`); until then no prompt is hashed and the policy sees no
        cached prefix anywhere."""
        if not replicas:
            raise ValueError("a router needs at least one replica")
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"replica ids must be unique, got {list(replicas)!r}")
        self.replicas = list(replicas)
        self.policy = policy
        self.tokens_per_block: int | None = None
        self.hash_kind = hash_kind
        self.index = PrefixIndex() if index is None else index
        self.loads: dict[Hashable, int] = {r: 0 for r in self.replicas}
        self.available: dict[Hashable, bool] = {r: True for r in self.replicas}
        if tokens_per_block is not None:
            self.configure_hashing(tokens_per_block, hash_kind)

    def configure_hashing(self, tokens_per_block: int, hash_kind: str) -> None:
        """Hash prompts as replicas with this block size and hash kind do (both checked here)."""
        prompt_block_hashes((1,), tokens_per_block, hash_kind=hash_kind)  # validates both
        self.tokens_per_block = tokens_per_block
        self.hash_kind = hash_kind

    def request_hashes(self, prompt: Sequence[int], *, lora_task_id: int | None = None,
                       cache_salt: str | int | None = None) -> list:
        if self.tokens_per_block is None:
            return []
        return prompt_block_hashes(prompt, self.tokens_per_block, lora_task_id=lora_task_id,
                                   cache_salt=cache_salt, hash_kind=self.hash_kind)

    def route(self, prompt: Sequence[int], *, lora_task_id: int | None = None,
              cache_salt: str | int | None = None, exclude: Collection[Hashable] = ()) -> RouteDecision:
        """Pick a replica for the request (never one in `exclude`, e.g. replicas that already
        refused it) and count it as that replica's load."""
        if not prompt:
            raise ValueError("cannot route an empty prompt")
        live = [r for r in self.replicas if self.available[r] and r not in exclude]
        if not live:
            raise RuntimeError("no replica is available")
        hashes = self.request_hashes(prompt, lora_task_id=lora_task_id, cache_salt=cache_salt)
        matches = self.index.match(hashes, live)
        tpb = self.tokens_per_block or 0  # not known yet: no prompt was hashed, nothing matched
        candidates = [
            Candidate(r, self.loads[r], matches[r].gpu_blocks * tpb, matches[r].other_blocks * tpb) for r in live
        ]
        chosen = live[self.policy.choose(len(prompt), candidates)]
        self.loads[chosen] += 1
        return RouteDecision(chosen, matches[chosen], len(hashes))

    def finished(self, replica: Hashable) -> None:
        """A request routed to `replica` finished (or failed): its load drops."""
        if self.loads.get(replica, 0) <= 0:
            raise ValueError(f"replica {replica!r} has no request in flight")
        self.loads[replica] -= 1

    def set_available(self, replica: Hashable, available: bool) -> None:
        """Take a replica out of routing (unreachable) or put it back; an unavailable replica's
        cached blocks are forgotten, since a restarted replica comes back empty."""
        if replica not in self.available:
            raise ValueError(f"unknown replica {replica!r}")
        self.available[replica] = available
        if not available:
            self.index.clear_replica(replica)
