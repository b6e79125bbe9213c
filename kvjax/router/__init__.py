"""KV-aware routing across replicas (docs/routing.md).

`PrefixIndex` learns which block hashes each replica holds from its KV events; `Router` hashes
a prompt the way the replicas' ledgers do, looks it up and asks a `RoutingPolicy`
(`KVAwarePolicy`, `RoundRobinPolicy`, `LeastLoadedPolicy`). `kvjax.router.sim` replays a
workload through simulated replicas to compare the policies.
"""
from kvjax.router.index import PrefixIndex, PrefixMatch
from kvjax.router.policy import (
    POLICIES,
    Candidate,
    KVAwarePolicy,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
)
from kvjax.router.router import RouteDecision, Router

__all__ = [
    "POLICIES",
    "Candidate",
    "KVAwarePolicy",
    "LeastLoadedPolicy",
    "PrefixIndex",
    "PrefixMatch",
    "RoundRobinPolicy",
    "RouteDecision",
    "Router",
    "RoutingPolicy",
    "make_policy",
]
