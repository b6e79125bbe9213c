"""A serving engine's KV-cache events on the wire (vLLM's format, docs/kv_events.md).

`KVEventsConfig` says where to publish; `EventPublishing` owns the engine's
`ZmqEventPublisher` and sends the ledger's events once per engine step (and after aborts and
prefix-cache resets, which change the cache between steps). The first batch, sent when the
engine starts, is `AllBlocksCleared`: a consumer that sees it knows the replica starts empty.

The ledger only queues events when its `event_buffer_max_size` is > 0; an engine that
publishes gives it `event_buffer_size(config)` unless the cache configuration sets one.
"""
from __future__ import annotations

import dataclasses
import re

from kvjax.config import CacheConfig

_ENDPOINT = re.compile(r"^(tcp://(\[[^\]]+\]|[^:/\[\]]+):(\d+|\*)|ipc://.+|inproc://.+)$")


def check_endpoint(endpoint: str, what: str = "endpoint") -> str:
    """`endpoint` if it is a ZeroMQ address kvjax can bind (tcp://HOST:PORT, ipc://PATH,
    inproc://NAME), else ValueError naming `what`."""
    if not isinstance(endpoint, str) or not _ENDPOINT.match(endpoint):
        raise ValueError(f"{what} must look like tcp://HOST:PORT (or ipc://PATH), got {endpoint!r}")
    return endpoint


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """Where an engine publishes its KV events. `endpoint` is the PUB socket and
    `replay_endpoint` the optional ROUTER socket that serves missed batches (the last
    `buffer_steps` of them); both are bound (a `*` port lets the OS pick). `topic` prefixes
    every message; `data_parallel_rank` fills the batches' rank field."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    data_parallel_rank: int = 0
    buffer_steps: int = 10_000

    def __post_init__(self) -> None:
        check_endpoint(self.endpoint, "the KV-events endpoint")
        if self.replay_endpoint is not None:
            check_endpoint(self.replay_endpoint, "the KV-events replay endpoint")
        if not isinstance(self.topic, str):
            raise ValueError(f"topic must be a string, got {self.topic!r}")
        r = self.data_parallel_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"data_parallel_rank must be an int >= 0, got {r!r}")
        b = self.buffer_steps
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"buffer_steps must be a positive int, got {b!r}")


def event_buffer_size(config: CacheConfig) -> int:
    """A ledger event queue that one engine step cannot overflow: a step emits at most a few
    events per block (stored, removed, offloaded or onboarded, re-prioritised)."""
    blocks = sum(config.primary_blocks_for(w) + config.secondary_blocks_for(w) for w in config.windows)
    return max(8192, 4 * blocks)


def event_hash_kind(config: CacheConfig) -> str:
    """The block-hash formula of the ledger's events (`CacheConfig.event_hash`: "sha256" or
    "trtllm64"), as `prompt_block_hashes(hash_kind=...)` names it: a router must hash requests
    with the same one."""
    return config.event_hash


def with_events(config: CacheConfig) -> CacheConfig:
    """`config` with the ledger's event queue on (sized by `event_buffer_size` if it was off)."""
    if config.event_buffer_max_size > 0:
        return config
    return dataclasses.replace(config, event_buffer_max_size=event_buffer_size(config))


class EventPublishing:
    """The engine side of KV events: one publisher for one ledger, fed after each change."""

    def __init__(self, config: KVEventsConfig, cache_config: CacheConfig) -> None:
        from kvjax.kv_events import LedgerEventAdapter, ZmqEventPublisher

        if cache_config.event_buffer_max_size < 1:
            raise ValueError("publishing KV events needs a cache with event_buffer_max_size > 0 (see with_events)")
        self.config = config
        self.tokens_per_block = cache_config.tokens_per_block
        self.hash_kind = event_hash_kind(cache_config)
        self.publisher = ZmqEventPublisher(
            config.endpoint,
            replay_endpoint=config.replay_endpoint,
            topic=config.topic,
            data_parallel_rank=config.data_parallel_rank,
            buffer_steps=config.buffer_steps,
            bind=True,
            adapter=LedgerEventAdapter(cache_config, data_parallel_rank=config.data_parallel_rank),
        )

    def publish(self, ledger) -> None:
        """Send what changed in `ledger` since the last call (nothing if nothing did)."""
        ledger.flush_iteration_events()
        self.publisher.publish_ledger_events(ledger.get_latest_events())

    def publish_wire(self, events: list) -> None:
        """Send wire events that do not come from the ledger (the KV store's "STORAGE" blocks)."""
        if events:
            import time

            from kvjax.kv_events.wire import KVEventBatch

            self.publisher.publish(KVEventBatch(time.time(), list(events), None))

    def info(self) -> dict:
        """Where a consumer connects (resolved addresses: a `*` port is the one the OS picked)."""
        p = self.publisher
        return {"endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint, "topic": p.topic,
                "data_parallel_rank": p.data_parallel_rank, "published": p.published, "dropped": p.dropped}

    def close(self) -> None:
        self.publisher.close()
