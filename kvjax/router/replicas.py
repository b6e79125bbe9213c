"""`ReplicaSet`: what the router front knows about its replicas, kept current by health checks.

Every `kvjax serve` replica answers `GET /kv_events_info` (its instance id, whether it takes
requests, where it publishes KV events, the block size and hash kind its ledger hashes with,
its tokenizer's fingerprint). A health round asks every replica at once:

- a replica that answers, takes requests and is compatible (same block size, hash kind and
  tokenizer as the router) becomes available: the router subscribes to its KV events (one
  `KVEventSubscriber` per replica feeding `router.index`, catching up on what the replica's
  replay buffer holds) and routes to it;
- a replica that does not answer, drains, or turns incompatible becomes unavailable: its
  subscription is closed and the index forgets its blocks (`Router.set_available(False)`);
- a replica whose instance id changed restarted (counted, whether the old process was still
  routed to or had already been marked down): its old blocks are forgotten and a new
  subscription reads the new process's stream from its start.

Request handlers call `mark_down` when a replica refuses connections, so a dead replica stops
getting requests at once instead of at the next health round. Subscriber threads apply
batches under a per-replica lock and a generation number, so a batch read just before a
replica was marked down can never re-populate the index afterwards.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

from kvjax.router.router import Router

if TYPE_CHECKING:
    from kvjax.kv_events.subscriber import KVEventSubscriber

log = logging.getLogger("kvjax.router")

_SUB_STATS = ("received", "replayed", "gaps", "unrecovered_gaps", "missed_batches", "restarts", "decode_errors")
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::", "")


def normalise_url(url: str) -> str:
    """`http(s)://host:port[/prefix]` without a trailing slash; ValueError otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a replica is an http(s)://HOST:PORT URL, got {url!r}")
    return url.strip().rstrip("/")


def connect_endpoint(endpoint: str, replica_url: str) -> str:
    """A published endpoint as the router connects to it: a wildcard bind address
    (tcp://*:PORT, tcp://0.0.0.0:PORT) is reached on the replica's own host."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in _WILDCARD_HOSTS:
        replica_host = urlsplit(replica_url).hostname
        if replica_host is None:
            raise ValueError(f"replica URL {replica_url!r} names no host to reach {endpoint} on")
        if ":" in replica_host:
            replica_host = f"[{replica_host}]"
        return f"tcp://{replica_host}:{port}"
    return endpoint


def load_tokenizer(spec: str):
    """A tokenizer from a directory, or the built-in tokenizer of a built-in model name."""
    from kvjax.tokenizer import Tokenizer

    if Path(spec).is_dir():
        return Tokenizer.from_pretrained(spec)
    from kvjax.model_catalog import load_model_spec

    return Tokenizer.builtin(load_model_spec(spec).vocab_size)


@dataclasses.dataclass(eq=False)
class Replica:
    url: str
    available: bool = False
    problem: str | None = "not checked yet"  # why it is not routed to
    instance_id: str | None = None  # of the process that last answered a health check
    info: dict | None = None
    subscriber: KVEventSubscriber | None = None
    generation: int = 0  # bumped whenever the index must stop taking this replica's batches
    restarts: int = 0  # instance id changes seen by health checks
    marked_down: int = 0
    closed_stats: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(_SUB_STATS, 0))
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def event_stats(self) -> dict[str, int]:
        """Subscriber counters over every subscription this replica had."""
        live = self.subscriber.stats() if self.subscriber is not None else {}
        return {k: self.closed_stats[k] + live.get(k, 0) for k in _SUB_STATS}


class ReplicaSet:
    def __init__(self, router: Router, client, *, tokenizer=None, tokenizer_spec: str | None = None,
                 health_timeout: float = 2.0) -> None:
        self.router = router
        self.client = client  # an httpx.AsyncClient
        # a ReplicaSet's router is built on the replicas' base URLs
        self.replicas = {url: Replica(url) for url in cast(list[str], router.replicas)}
        for url in router.replicas:
            router.set_available(url, False)  # nothing is routed before a health check says so
        self.tokenizer = tokenizer
        self.tokenizer_spec = tokenizer_spec
        self.health_timeout = health_timeout
        self._closing = False

    # ------------------------------------------------------------------ health rounds
    async def refresh(self) -> None:
        """One health round: every replica is asked at once, and the answers are applied in
        the order the replicas were given, so the block size and hash kind a router learns
        come from the first healthy replica in that order, never from whichever answered
        first."""
        reps = list(self.replicas.values())
        answers = await asyncio.gather(*(self._ask(r) for r in reps))
        for rep, answer in zip(reps, answers, strict=True):
            await self._apply_answer(rep, answer)

    async def run(self, interval: float) -> None:
        """Health rounds every `interval` seconds until cancelled."""
        while True:
            try:
                await self.refresh()
            except Exception:  # a bug in one round must not stop the checks
                log.exception("health round failed")
            await asyncio.sleep(interval)

    async def _ask(self, rep: Replica) -> dict | str:
        """The replica's `/kv_events_info` answer, or why it is unavailable."""
        import httpx

        try:
            resp = await self.client.get(rep.url + "/kv_events_info", timeout=self.health_timeout)
        except httpx.HTTPError as e:
            return f"unreachable ({type(e).__name__})"
        if resp.status_code != 200:
            return f"GET /kv_events_info answered {resp.status_code}"
        try:
            info = resp.json()
            info["instance_id"], info["status"]
        except (ValueError, KeyError, TypeError):
            return "GET /kv_events_info did not answer kvjax's JSON"
        return info

    async def _apply_answer(self, rep: Replica, info: dict | str) -> None:
        if isinstance(info, str):
            self.mark_down(rep, info)
            return
        instance = info["instance_id"]
        if rep.instance_id is not None and instance != rep.instance_id:
            # a new process behind the same URL: between two rounds (still routed to), or after
            # the old one died and was marked down (the usual case: its requests failed first)
            rep.restarts += 1
            log.warning("replica %s restarted (instance %s -> %s): relearning its cache", rep.url, rep.instance_id, instance)
            if rep.available:
                self.mark_down(rep, "restarted")
        rep.instance_id = instance  # the process last seen, routed to or not
        if info["status"] != "ok":
            self.mark_down(rep, f"not taking requests ({info['status']})")
            return
        problem = await self._compatibility(info)
        if problem is not None:
            self.mark_down(rep, problem)
            return
        if rep.available:  # the same process, already routed to
            return
        if self._closing:
            return
        self._bring_up(rep, info)

    def _bring_up(self, rep: Replica, info: dict) -> None:
        events = info.get("kv_events")
        sub = None
        if events:
            from kvjax.kv_events import KVEventSubscriber

            with rep.lock:
                gen = rep.generation
            replay = events.get("replay_endpoint")
            try:
                sub = KVEventSubscriber(
                    connect_endpoint(events["endpoint"], rep.url),
                    replay_endpoint=None if replay is None else connect_endpoint(replay, rep.url),
                    topic=events.get("topic", ""), name=rep.url,
                    on_restart=self._forget(rep, gen, "its event stream restarted"),
                    on_gap=self._forget(rep, gen, "KV-event batches were lost"),
                )
            except (ValueError, KeyError, TypeError) as e:
                log.error("replica %s: cannot subscribe to its KV events (%s); routing to it without them", rep.url, e)
                sub = None
            else:
                sub.start(self._apply(rep, gen))
        rep.subscriber = sub
        rep.instance_id = info["instance_id"]
        rep.info = info
        rep.available = True
        rep.problem = None
        self.router.set_available(rep.url, True)
        log.info("replica %s available (instance %s, KV events %s)", rep.url, rep.instance_id,
                 "subscribed" if sub is not None else "not published")

    def mark_down(self, rep: Replica, reason: str) -> None:
        """Stop routing to `rep` and forget its blocks (it may come back empty)."""
        if rep.available:
            rep.marked_down += 1
            log.warning("replica %s unavailable: %s", rep.url, reason)
        rep.problem = reason
        rep.available = False
        with rep.lock:
            rep.generation += 1
            self.router.set_available(rep.url, False)  # clears its blocks from the index
        sub, rep.subscriber = rep.subscriber, None
        if sub is not None:
            for k, v in sub.stats().items():
                rep.closed_stats[k] += v
            threading.Thread(target=sub.close, name="kvjax-router-unsubscribe", daemon=True).start()

    async def _compatibility(self, info: dict) -> str | None:
        """None if requests hashed by the router match this replica's events, else why not."""
        router = self.router
        tpb, kind = info.get("tokens_per_block"), info.get("hash_kind")
        if router.tokens_per_block is None:
            if not isinstance(tpb, int) or not isinstance(kind, str):
                return f"incompatible: cannot hash like it (tokens_per_block {tpb!r}, hash_kind {kind!r})"
            try:
                router.configure_hashing(tpb, kind)
            except (ValueError, TypeError) as e:
                return f"incompatible: cannot hash like it ({e})"
            log.info("hashing prompts in blocks of %d tokens with the %r hash (learned from the replicas)", tpb, kind)
        elif (tpb, kind) != (router.tokens_per_block, router.hash_kind):
            return (f"incompatible: its ledger hashes blocks of {tpb} tokens with the {kind!r} hash, the router "
                    f"{router.tokens_per_block} tokens with {router.hash_kind!r}")
        tok = info.get("tokenizer")
        if tok is None:
            return None  # token-id prompts only: hashing them needs no tokenizer
        if self.tokenizer is None:
            spec = self.tokenizer_spec or tok.get("source")
            if spec:
                try:
                    self.tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, spec)
                    self.tokenizer_spec = spec
                    log.info("tokenising requests with %s", spec)
                except Exception as e:  # noqa: BLE001 - any loading error: say so, route on
                    log.error("cannot load the tokenizer %r (%s); pass kvjax router --tokenizer", spec, e)
                    return f"incompatible: the router cannot load its tokenizer {spec!r}"
        if self.tokenizer is not None and tok.get("fingerprint") != self.tokenizer.fingerprint():
            return "incompatible: its tokenizer (or chat template) differs from the router's"
        return None

    # ------------------------------------------------------------------ subscriber threads
    def _apply(self, rep: Replica, gen: int):
        index = self.router.index

        def apply(seq, batch) -> None:
            with rep.lock:
                if rep.generation == gen:
                    index.apply(rep.url, batch)

        return apply

    def _forget(self, rep: Replica, gen: int, why: str):
        index = self.router.index

        def forget(*_args) -> None:
            with rep.lock:
                if rep.generation == gen:
                    log.warning("replica %s: %s; forgetting its cached blocks", rep.url, why)
                    index.clear_replica(rep.url)

        return forget

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Close every subscription (waits for their threads)."""
        self._closing = True
        for rep in self.replicas.values():
            sub, rep.subscriber = rep.subscriber, None
            if sub is not None:
                sub.close()

    def status(self) -> list[dict]:
        return [{"url": r.url, "available": r.available, "problem": r.problem, "instance_id": r.instance_id,
                 "in_flight": self.router.loads[r.url], "cached_blocks": self.router.index.num_blocks(r.url),
                 "kv_events": r.event_stats() if r.info and r.info.get("kv_events") else None}
                for r in self.replicas.values()]
