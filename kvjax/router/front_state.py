"""`RouterState`: what every handler of the router front shares: the configuration, the
`Router` and the tokenizer (built with the app), and the HTTP client, replica set and metrics
(made by the lifespan, which owns the client). The handler modules are plain functions of it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.router.config import RouterConfig
from kvjax.router.metrics import RouterMetrics
from kvjax.router.policy import make_policy
from kvjax.router.replicas import ReplicaSet, load_tokenizer
from kvjax.router.router import Router

if TYPE_CHECKING:
    import httpx


class RouterState:
    """One router front's shared state; `client`, `replicas` and `metrics` exist while the
    lifespan runs."""

    client: httpx.AsyncClient
    replicas: ReplicaSet
    metrics: RouterMetrics

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        policy = make_policy(config.policy, **dict(config.policy_options))
        self.router = Router(list(config.replicas), policy, tokens_per_block=config.tokens_per_block,
                             hash_kind=config.hash_kind or "sha256")
        self.tokenizer = None if config.tokenizer is None else load_tokenizer(config.tokenizer)

    def max_seq_len(self) -> int | None:
        """The longest context of a routed replica (None if none says)."""
        lens = [r.info.get("max_seq_len") for r in self.replicas.replicas.values() if r.available and r.info]
        ints = [n for n in lens if isinstance(n, int)]
        return max(ints) if ints else None
