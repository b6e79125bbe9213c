"""`RouterConfig`: what the router front (`kvjax router`) is told, checked when it is made, and
`REPLICA_HEADER`, the response header naming the replica that answered. A module of its own so
that the CLI reads them without loading the HTTP stack."""
from __future__ import annotations

import dataclasses

from kvjax.router.policy import make_policy
from kvjax.router.replicas import normalise_url

REPLICA_HEADER = "x-kvjax-replica"


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """`replicas`: the `kvjax serve` URLs; `policy` ("kv-aware", "round-robin", "least-loaded")
    with `policy_options` (kv-aware: alpha, imbalance_cap, slack, other_tier_weight);
    `tokenizer`: a tokenizer directory or built-in model name (None: the one the replicas
    report); `tokens_per_block` / `hash_kind`: how to hash prompts (None: learned from the first
    replica, the others must agree); `health_interval` seconds between health rounds;
    `request_timeout` seconds a replica may take to answer (or between two stream chunks).

    Disaggregated prefill/decode (`prefill_replicas` and `decode_replicas`, both or neither):
    every request runs vLLM's two steps, a prefill on a prefill replica (max_tokens 1,
    `kv_transfer_params.do_remote_decode`) and then the request itself on a decode replica with
    the prefill's `kv_transfer_params` (`pd_flow.py`); each step is routed by `policy` among its
    side's replicas only. `replicas` is then both sides (leave it empty)."""

    replicas: tuple[str, ...]
    policy: str = "kv-aware"
    policy_options: tuple[tuple[str, float], ...] = ()
    tokenizer: str | None = None
    tokens_per_block: int | None = None
    hash_kind: str | None = None
    health_interval: float = 2.0
    health_timeout: float = 2.0
    connect_timeout: float = 2.0
    request_timeout: float = 600.0
    max_body_bytes: int = 32 << 20
    prefill_replicas: tuple[str, ...] = ()
    decode_replicas: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if bool(self.prefill_replicas) != bool(self.decode_replicas):
            raise ValueError("P/D mode needs both --prefill-replica and --decode-replica URLs")
        if self.prefill_replicas:
            if self.replicas:
                raise ValueError("give either --replica or --prefill-replica / --decode-replica, not both")
            prefill = tuple(normalise_url(u) for u in self.prefill_replicas)
            decode = tuple(normalise_url(u) for u in self.decode_replicas)
            object.__setattr__(self, "prefill_replicas", prefill)
            object.__setattr__(self, "decode_replicas", decode)
            object.__setattr__(self, "replicas", prefill + decode)
        if not self.replicas:
            raise ValueError("the router needs at least one --replica URL")
        urls = tuple(normalise_url(u) for u in self.replicas)
        if len(set(urls)) != len(urls):
            raise ValueError(f"replica URLs must be distinct, got {list(self.replicas)}")
        object.__setattr__(self, "replicas", urls)
        for name in ("health_interval", "health_timeout", "connect_timeout", "request_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if (self.tokens_per_block is None) != (self.hash_kind is None):
            raise ValueError("give both tokens_per_block and hash_kind, or neither (learned from the replicas)")
        make_policy(self.policy, **dict(self.policy_options))  # fails here on a bad name or option

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_replicas)
