"""`KVConsumer`: pulls offered KV blocks from producers, each pull bounded by kvjax's deadline.

`jax.experimental.transfer`'s own timeout does not bound a pull on the builds kvjax runs on:
`TransferConnection.pull` returns at once with arrays that never become ready when the id was
never offered, was already pulled, or the producer died. So a pull here is: a worker thread
that handshakes on the side channel, checks the geometry and the offer's shapes, opens its own
transfer connection, issues the pull and then watches the arrays become ready, sending lease
heartbeats meanwhile. The engine calls `poll()` each step; a pull still running past its
deadline is reported failed there and its connection is poisoned (`_poison_connection`), which
makes the stuck transfer end with an error, so the thread finishes soon after. Its destination
arrays are dropped, never returned. Threads that have not ended yet still count against
`max_pull_threads`, so a peer that hangs every pull cannot grow the thread count without
bound: new pulls are refused with `CapacityError` until they end. `close()` poisons every
open connection before the process exits (a process that exits with a pull still waiting in
the transfer library aborts).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax

from kvjax.disagg.config import KVTransferConfig, RemotePrefillParams
from kvjax.disagg.digest import KVGeometry
from kvjax.disagg.errors import (
    CapacityError,
    GeometryMismatchError,
    PeerError,
    PullTimeoutError,
    RoleError,
    SideChannelError,
    TransferConfigError,
)
from kvjax.disagg.side_channel import (
    Describe,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    OfferInfo,
    Pulled,
    SideChannelClient,
)
from kvjax.errors import DuplicateRequestError, KVCacheError

log = logging.getLogger(__name__)

_POLL_S = 0.002  # how often a worker looks at its arrays while a pull runs


class PullResult(NamedTuple):
    """One finished pull: `value` is the pulled arrays (status "ok") or the error ("failed")."""

    request_id: str
    status: Literal["ok", "failed"]
    value: tuple[jax.Array, ...] | Exception


@dataclasses.dataclass
class _Pull:
    request_id: str
    params: RemotePrefillParams
    specs: list[jax.ShapeDtypeStruct]
    deadline: float
    stage: str = "queued"  # queued -> handshake -> describe -> pulling -> notifying -> done
    cancelled: bool = False
    conn: Any = None
    result: PullResult | None = None
    reported: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def finish(self, result: PullResult) -> bool:
        with self.lock:
            if self.result is not None:
                return False
            self.result = result
            return True

    def poison(self) -> None:
        with self.lock:
            self.cancelled = True
            conn = self.conn
        if conn is not None:
            try:
                conn._poison_connection()
            except Exception as e:  # already closed or finished
                log.debug("poisoning the connection of %r: %r", self.request_id, e)


def _specs(specs: Sequence[jax.ShapeDtypeStruct]) -> list[jax.ShapeDtypeStruct]:
    if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence) or not specs:
        raise TransferConfigError("specs must be a non-empty sequence of jax.ShapeDtypeStruct")
    out = []
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for s in specs:
        if not isinstance(s, jax.ShapeDtypeStruct):
            raise TransferConfigError(f"every spec must be a jax.ShapeDtypeStruct, got {type(s).__name__}")
        out.append(s if s.sharding is not None else jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=default))
    return out


def wait_ready(arrays: Sequence[jax.Array], deadline: float, *, cancelled: Callable[[], bool] = lambda: False,
               every: float | None = None, beat: Callable[[], None] | None = None,
               clock: Callable[[], float] = time.monotonic) -> None:
    """Block until every array is ready, the deadline passes (`PullTimeoutError`) or
    `cancelled()` turns true (also `PullTimeoutError`); `beat` runs every `every` seconds."""
    next_beat = clock() + every if every is not None else float("inf")
    while not all(a.is_ready() for a in arrays):  # type: ignore[attr-defined]
        now = clock()
        if cancelled():
            raise PullTimeoutError("the pull was abandoned (deadline or close)")
        if now >= deadline:
            raise PullTimeoutError(f"the pull did not finish by its deadline ({now - deadline:.3f} s late)")
        if beat is not None and now >= next_beat:
            beat()
            next_beat = now + (every or 0.0)
        time.sleep(_POLL_S)


class KVConsumer:
    """The decode side: `start_pull` per request, `poll()` each engine step, `close()` at exit.

    `transfer_server`: an existing transfer server to pull through (its backend receives the
    arrays); by default one is started on `transfer_address`.
    """

    def __init__(self, config: KVTransferConfig, geometry: KVGeometry, *, transfer_server=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(config, KVTransferConfig):
            raise TransferConfigError(f"config must be a KVTransferConfig, got {type(config).__name__}")
        if not config.is_consumer:
            raise RoleError(f"a KVConsumer needs kv_role kv_consumer or kv_both, got {config.kv_role!r}")
        if not isinstance(geometry, KVGeometry):
            raise TransferConfigError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        self.config, self.geometry, self._clock = config, geometry, clock
        self._fields, self._digest = geometry.fields(), geometry.digest
        s = config.settings
        if transfer_server is None:
            from jax.experimental import transfer

            host = s.transfer_address.rpartition(":")[0]
            transfer_server = transfer.start_transfer_server(jax.devices()[0].client, s.transfer_address,
                                                             [f"{host}:0"])
        self._server = transfer_server
        self._lock = threading.Lock()
        self._pulls: dict[str, _Pull] = {}
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._holds: dict[str, RemotePrefillParams] = {}
        self._lost: list[PullResult] = []
        self._hold_wake = threading.Event()
        self._hold_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ side-channel helpers
    def _client(self, params: RemotePrefillParams) -> SideChannelClient:
        return SideChannelClient(params.remote_host, params.remote_port, self.config.settings.side_channel_timeout)

    def _hello(self, client: SideChannelClient) -> HelloReply:
        """Hello, then refuse a geometry mismatch naming the fields (whichever side saw it)."""
        try:
            reply = client.request(Hello(engine_id=self.config.engine_id, geometry=self._fields, digest=self._digest))
        except PeerError as e:
            remote = e.detail.get("geometry")
            if e.code != "geometry_mismatch" or not isinstance(remote, dict):
                raise
            self.geometry.check_compatible(remote, e.detail.get("digest"))
            raise GeometryMismatchError(f"the producer at {client.endpoint} refused our KV geometry: {e}") from None
        if not isinstance(reply, HelloReply):
            raise SideChannelError(f"expected HelloReply, got {type(reply).__name__}")
        self.geometry.check_compatible(reply.geometry, reply.digest)
        return reply

    def handshake(self, params: RemotePrefillParams | Mapping[str, Any]) -> HelloReply:
        """Synchronous handshake with the producer named by `params` (bounded by the side-channel
        timeout): returns its reply, or raises `GeometryMismatchError` naming the fields."""
        params = self._params(params)
        client = self._client(params)
        try:
            return self._hello(client)
        finally:
            client.close()

    def heartbeat(self, params: RemotePrefillParams | Mapping[str, Any]) -> bool:
        """Extend the lease of an offer this engine will pull later (while the request waits for
        blocks). False if the producer no longer has it; `SideChannelError` if unreachable."""
        params = self._params(params)
        client = self._client(params)
        try:
            reply = client.request(Heartbeat(transfer_ids=[params.transfer_id]))
        finally:
            client.close()
        return isinstance(reply, HeartbeatReply) and params.transfer_id in reply.alive

    @staticmethod
    def _params(params: RemotePrefillParams | Mapping[str, Any]) -> RemotePrefillParams:
        return params if isinstance(params, RemotePrefillParams) else RemotePrefillParams.from_dict(params)

    # ------------------------------------------------------------------ engine-facing API
    def start_pull(self, request_id: str, params: RemotePrefillParams | Mapping[str, Any],
                   specs: Sequence[jax.ShapeDtypeStruct], *, timeout: float | None = None) -> None:
        """Start pulling the offer named by `params` into arrays shaped and sharded like `specs`
        (a spec without a sharding lands on the default device). The result comes from `poll()`
        no later than `timeout` (default `pull_timeout`) seconds from now. Raises at once, having
        started nothing, on bad arguments, a duplicate request id or `CapacityError`."""
        if not isinstance(request_id, str) or not request_id:
            raise TransferConfigError(f"request_id must be a non-empty string, got {request_id!r}")
        p = self._params(params)
        specs_ = _specs(specs)
        limit = self.config.settings.pull_timeout if timeout is None else timeout
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < float("inf"):
            raise TransferConfigError(f"timeout must be a positive finite number, got {timeout!r}")
        with self._lock:
            if self._closed:
                raise RoleError("the consumer is closed")
            if request_id in self._pulls:
                raise DuplicateRequestError(f"request {request_id!r} already has a pull in flight")
            self._threads = {t for t in self._threads if t.is_alive()}
            if len(self._threads) >= self.config.settings.max_pull_threads:
                raise CapacityError(f"{len(self._threads)} pull threads are alive (max_pull_threads="
                                    f"{self.config.settings.max_pull_threads}); wait for them to end")
            pull = _Pull(request_id=request_id, params=p, specs=specs_, deadline=self._clock() + limit)
            t = threading.Thread(target=self._run, args=(pull,), name=f"kvjax-pull-{request_id}", daemon=True)
            self._pulls[request_id] = pull
            self._holds.pop(request_id, None)  # the pull's own thread heartbeats from here on
            self._threads.add(t)
        t.start()

    def poll(self) -> list[PullResult]:
        """Finished pulls since the last call, each reported once: successes with their arrays,
        failures (including pulls past their deadline, reported here) with their error."""
        now = self._clock()
        with self._lock:
            pulls = list(self._pulls.values())
            out, self._lost = self._lost, []
        for pull in pulls:
            if pull.result is None and now >= pull.deadline:
                if pull.finish(PullResult(pull.request_id, "failed", PullTimeoutError(
                        f"pull of {pull.request_id!r} (transfer {pull.params.transfer_id}) missed its deadline "
                        f"in stage {pull.stage!r}; its destination buffers are discarded"))):
                    pull.poison()
            if pull.result is not None:
                out.append(pull.result)
                with self._lock:
                    self._pulls.pop(pull.request_id, None)
        return out

    def keep_alive(self, request_id: str, params: RemotePrefillParams | Mapping[str, Any]) -> None:
        """Heartbeat `request_id`'s offer in the background, without blocking the caller, while
        the request waits for blocks; `start_pull` or `drop` ends it. If the producer no longer
        has the offer, `poll()` reports the request failed (`PeerError` "unknown_transfer")."""
        if not isinstance(request_id, str) or not request_id:
            raise TransferConfigError(f"request_id must be a non-empty string, got {request_id!r}")
        p = self._params(params)
        with self._lock:
            if self._closed:
                raise RoleError("the consumer is closed")
            if request_id in self._pulls or request_id in self._holds:
                raise DuplicateRequestError(f"request {request_id!r} is already held or pulling")
            self._holds[request_id] = p
            if self._hold_thread is None:
                self._hold_thread = threading.Thread(target=self._heartbeat_loop, name="kvjax-keep-alive", daemon=True)
                self._hold_thread.start()

    def drop(self, request_id: str) -> bool:
        """Stop heartbeating a held request (e.g. it was aborted); False if it was not held."""
        with self._lock:
            return self._holds.pop(request_id, None) is not None

    def _heartbeat_loop(self) -> None:
        """One thread for every held request: one batched Heartbeat per producer per interval."""
        clients: dict[tuple[str, int], SideChannelClient] = {}
        try:
            while not self._hold_wake.wait(self.config.settings.heartbeat_interval):
                with self._lock:
                    holds = dict(self._holds)
                by_peer: dict[tuple[str, int], dict[int, str]] = {}
                for rid, p in holds.items():
                    by_peer.setdefault((p.remote_host, p.remote_port), {})[p.transfer_id] = rid
                for peer, ids in by_peer.items():
                    if peer not in clients:
                        clients[peer] = SideChannelClient(*peer, self.config.settings.side_channel_timeout)
                    try:
                        reply = clients[peer].request(Heartbeat(transfer_ids=sorted(ids)))
                    except KVCacheError as e:  # unreachable for now: the lease decides
                        log.info("keep-alive to %s:%d failed: %s", *peer, e)
                        continue
                    if not isinstance(reply, HeartbeatReply):
                        continue
                    with self._lock:
                        for tid in reply.unknown:
                            rid = ids[tid]
                            if self._holds.get(rid) is holds[rid]:
                                del self._holds[rid]
                                self._lost.append(PullResult(rid, "failed", PeerError(
                                    "unknown_transfer", f"the producer no longer offers transfer {tid} "
                                    "(expired or aborted) while the request waited")))
        finally:
            for c in clients.values():
                c.close()

    def stage(self, request_id: str) -> str | None:
        """Where `request_id`'s pull is (None: not in flight): for metrics and tests."""
        with self._lock:
            pull = self._pulls.get(request_id)
        return None if pull is None else pull.stage

    @property
    def live_threads(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    def close(self, timeout: float = 5.0) -> None:
        """Abandon every pull (poisoning its connection) and join the threads, bounded."""
        with self._lock:
            self._closed = True
            pulls = list(self._pulls.values())
            threads = list(self._threads)
            if self._hold_thread is not None:
                threads.append(self._hold_thread)
            self._pulls.clear()
            self._holds.clear()
        self._hold_wake.set()
        for pull in pulls:
            pull.finish(PullResult(pull.request_id, "failed", PullTimeoutError("the consumer closed")))
            pull.poison()
        end = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))

    # ------------------------------------------------------------------ the worker
    def _run(self, pull: _Pull) -> None:
        p = pull.params
        client = self._client(p)
        notified = False
        try:
            pull.stage = "handshake"
            reply = self._hello(client)
            if p.geometry_digest != self._digest:
                raise GeometryMismatchError(f"kv_transfer_params carry geometry digest {p.geometry_digest}, "
                                            f"but this engine's is {self._digest}")
            pull.stage = "describe"
            info = client.request(Describe(transfer_id=p.transfer_id))
            if not isinstance(info, OfferInfo):
                raise SideChannelError(f"expected OfferInfo, got {type(info).__name__}")
            want = ([list(s.shape) for s in pull.specs], [str(s.dtype) for s in pull.specs])
            if (info.shapes, info.dtypes) != want:
                raise TransferConfigError(f"the offer holds shapes {info.shapes} dtypes {info.dtypes}, but the pull "
                                          f"asks for shapes {want[0]} dtypes {want[1]}")
            with pull.lock:
                if pull.cancelled:
                    raise PullTimeoutError("the pull was abandoned before it started")
                pull.conn = self._server.connect(reply.transfer_address)
            pull.stage = "pulling"
            arrays = pull.conn.pull(p.transfer_id, pull.specs)
            beat_every = self.config.settings.heartbeat_interval

            def beat() -> None:
                try:
                    r = client.request(Heartbeat(transfer_ids=[p.transfer_id]))
                except SideChannelError as e:  # a slow side channel is no reason to drop bytes in flight:
                    log.info("heartbeat for %r failed: %s", pull.request_id, e)  # the deadline still bounds us
                    return
                if isinstance(r, HeartbeatReply) and p.transfer_id in r.unknown:
                    raise PeerError("unknown_transfer", "the producer dropped the offer while it was being pulled")

            wait_ready(arrays, pull.deadline, cancelled=lambda: pull.cancelled, every=beat_every, beat=beat,
                       clock=self._clock)
            jax.block_until_ready(arrays)  # ready: raises at once if the producer sent error arrays
            pull.stage = "notifying"
            notified = True
            try:
                client.request(Pulled(transfer_id=p.transfer_id, ok=True))
            except KVCacheError as e:  # the bytes are here; the producer's lease frees its side
                log.warning("could not tell %s that %r was pulled: %s", client.endpoint, pull.request_id, e)
            if not pull.finish(PullResult(pull.request_id, "ok", tuple(arrays))):
                log.info("pull of %r finished after it was reported failed; discarding it", pull.request_id)
        except Exception as e:
            pull.finish(PullResult(pull.request_id, "failed", e))
            if not notified and pull.stage in ("describe", "pulling"):
                try:  # let the producer release (and reclaim) at once instead of at lease expiry
                    client.request(Pulled(transfer_id=p.transfer_id, ok=False, error=str(e)[:500]))
                except KVCacheError:
                    pass
        finally:
            pull.stage = "done"
            client.close()
