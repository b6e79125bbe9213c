"""`KVProducer`: offers a request's gathered KV blocks on a JAX transfer server, under a lease.

Lifecycle of one offer: `offer()` gathers nothing itself (pass the arrays, e.g. from
`gather_blocks`), registers them with `TransferServer.await_pull` under a fresh one-shot
transfer id, and returns the `kv_transfer_params` for the decode side. The offer then lives
until exactly one of: the consumer reports "pulled" (or a failed pull) on the side channel, the
lease runs out (`kv_lease_duration` after the offer or after the last consumer heartbeat), the
engine calls `abort()`, or `close()`. That end is reported once per offer through
`on_release(request_id, reason)`, called from `poll()` on the caller's thread (the engine
unpins the request's blocks there, so the ledger is never touched from the side-channel thread).

An offer that ends without a pull still sits in the transfer server's table, holding its copy
of the blocks (uuids are one-shot and the server has no withdraw call). The producer reclaims it
by pulling it once from itself, in a background thread bounded by `side_channel_timeout`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer
from jaxtyping import Array, Int

from kvjax.device.pools import KVPools
from kvjax.device.transfers import put_blocks, take_blocks
from kvjax.disagg.config import MAX_TRANSFER_ID, KVTransferConfig, RemotePrefillParams
from kvjax.disagg.digest import KVGeometry
from kvjax.disagg.errors import CapacityError, RoleError, TransferConfigError
from kvjax.disagg.side_channel import (
    Ack,
    Describe,
    ErrorReply,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    Msg,
    OfferInfo,
    Pulled,
    SideChannelServer,
)
from kvjax.errors import DuplicateRequestError
from kvjax.validation import check_int

log = logging.getLogger(__name__)

#: Why an offer ended (the `reason` given to `on_release`).
RELEASE_PULLED = "pulled"
RELEASE_CONSUMER_FAILED = "consumer_failed"
RELEASE_EXPIRED = "expired"
RELEASE_ABORTED = "aborted"
RELEASE_CLOSED = "closed"


# ----------------------------------------------------------------------------- gathering
@functools.partial(jax.jit, static_argnames=("ba",))
def _gather_slots(arr, idx: Int[Array, " n"], *, ba: int):
    return take_blocks(arr, idx, ba)


def gather_blocks(pools: KVPools, slots: Sequence[Sequence[int]]) -> tuple[jax.Array, ...]:
    """Copies of the primary blocks `slots[p]` of each pool `p`, block axis first.

    Returns, per pool, `[n_p, *block]` (and, for FP8 pools, its `[n_p, *scale_block]` scales
    right after it): the arrays to `offer`. Read-only: the pools are neither donated nor
    changed, so the engine may unpin and reuse the blocks as soon as this returns. Slot ids
    must name real blocks (`0 <= slot < primary_blocks`; the null slot is refused).
    """
    if not isinstance(pools, KVPools):
        raise TransferConfigError(f"pools must be KVPools, got {type(pools).__name__}")
    idxs = _check_slots(pools, slots, unique=False)
    specs = pools.geometry.pools
    out: list[jax.Array] = []
    ba = pools.block_axis
    for spec, idx in zip(specs, idxs, strict=True):
        arr, scales = pools.primary[spec.index], pools.primary_scales[spec.index]
        out.append(_gather_slots(arr, jnp.asarray(idx), ba=ba))
        if scales is not None:
            out.append(_gather_slots(scales, jnp.asarray(idx), ba=ba))
    return tuple(out)


@functools.partial(jax.jit, static_argnames=("ba",), donate_argnums=(0,))
def _scatter_slots(arr, blocks, idx: Int[Array, " n"], *, ba: int):
    return put_blocks(arr, blocks, idx, ba)


def _check_slots(pools: KVPools, slots: Sequence[Sequence[int]], *, unique: bool) -> list[np.ndarray]:
    specs = pools.geometry.pools
    if isinstance(slots, (str, bytes)) or not isinstance(slots, Sequence) or len(slots) != len(specs):
        raise TransferConfigError(f"slots must hold one sequence of slot ids per pool ({len(specs)}), got {slots!r}")
    idxs = []
    for spec, ids in zip(specs, slots, strict=True):
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TransferConfigError(f"slots of pool {spec.index} must be a sequence of ints, got {ids!r}")
        checked = [check_int(f"slot of pool {spec.index}", s, 0, spec.primary_blocks - 1,
                             error=TransferConfigError) for s in ids]
        if unique and len(set(checked)) != len(checked):
            raise TransferConfigError(f"slots of pool {spec.index} repeat a slot: {checked}")
        idxs.append(np.asarray(checked, np.int32))
    return idxs


def scatter_blocks(pools: KVPools, slots: Sequence[Sequence[int]], arrays: Sequence[jax.Array]) -> KVPools:
    """Write pulled blocks into the primary slots `slots[p]` of each pool: the inverse of
    `gather_blocks` (same array order: per pool its blocks, then its FP8 scales if any).

    Every shape and dtype is checked before anything is written; the pools are donated, so
    rebind (`pools = scatter_blocks(pools, ...)`). Slots must be distinct within a pool."""
    if not isinstance(pools, KVPools):
        raise TransferConfigError(f"pools must be KVPools, got {type(pools).__name__}")
    idxs = _check_slots(pools, slots, unique=True)
    want: list[tuple[tuple[int, ...], np.dtype]] = []
    ba = pools.block_axis
    for spec, idx in zip(pools.geometry.pools, idxs, strict=True):
        for arr in (pools.primary[spec.index], pools.primary_scales[spec.index]):
            if arr is not None:
                block = arr.shape[:ba] + arr.shape[ba + 1:]
                want.append(((len(idx), *block), np.dtype(arr.dtype)))
    if isinstance(arrays, jax.Array) or not isinstance(arrays, Sequence) or len(arrays) != len(want):
        raise TransferConfigError(f"arrays must be {len(want)} arrays (blocks, then scales, per pool)")
    for i, (a, (shape, dtype)) in enumerate(zip(arrays, want, strict=True)):
        if not isinstance(a, jax.Array) or tuple(a.shape) != shape or np.dtype(a.dtype) != dtype:
            got = (tuple(a.shape), a.dtype) if isinstance(a, jax.Array) else type(a).__name__
            raise TransferConfigError(f"array {i} must be {dtype}{list(shape)}, got {got}")
    it = iter(arrays)
    for spec, idx in zip(pools.geometry.pools, idxs, strict=True):
        dst = jnp.asarray(idx)
        arr = _scatter_slots(pools.primary[spec.index], next(it), dst, ba=ba)
        scales = pools.primary_scales[spec.index]
        if scales is not None:
            scales = _scatter_slots(scales, next(it), dst, ba=ba)
        pools = pools.with_primary(spec.index, arr, scales)
    return pools


# ----------------------------------------------------------------------------- producer
@dataclasses.dataclass
class _Offer:
    request_id: str
    transfer_id: int
    shapes: list[list[int]]
    dtypes: list[str]
    specs: list[jax.ShapeDtypeStruct]
    expires_at: float
    released: str | None = None


class KVProducer:
    """The prefill side: offers, leases, the side-channel server, exactly-once release.

    `transfer_server`: an existing `jax.experimental.transfer.TransferServer` to share (one per
    process is plenty); by default one is started on `transfer_address`. `clock` is the lease
    clock (monotonic seconds; tests may pass their own). `advertise_host`: the host put in
    `remote_host` (default: the side-channel bind host).
    """

    def __init__(self, config: KVTransferConfig, geometry: KVGeometry, *,
                 on_release: Callable[[str, str], None], transfer_server=None,
                 clock: Callable[[], float] = time.monotonic, advertise_host: str | None = None) -> None:
        if not isinstance(config, KVTransferConfig):
            raise TransferConfigError(f"config must be a KVTransferConfig, got {type(config).__name__}")
        if not config.is_producer:
            raise RoleError(f"a KVProducer needs kv_role kv_producer or kv_both, got {config.kv_role!r}")
        if not isinstance(geometry, KVGeometry):
            raise TransferConfigError(f"geometry must be a KVGeometry, got {type(geometry).__name__}")
        if not callable(on_release):
            raise TransferConfigError("on_release must be callable")
        s = config.settings
        self.config, self.geometry, self._on_release, self._clock = config, geometry, on_release, clock
        self._fields, self._digest = geometry.fields(), geometry.digest
        self._lock = threading.Lock()
        self._offers: dict[int, _Offer] = {}
        self._by_request: dict[str, int] = {}
        self._released: collections.deque[tuple[str, str]] = collections.deque()
        self._reclaims: set[threading.Thread] = set()
        self._reclaim_lock = threading.Lock()
        self._closed = False
        host = s.transfer_address.rpartition(":")[0]
        if transfer_server is None:
            transfer_server = transfer.start_transfer_server(
                jax.devices()[0].client, s.transfer_address, [f"{host}:0"])
        self._server = transfer_server
        self.transfer_address: str = transfer_server.address()
        self._sc = SideChannelServer(s.side_channel_host, s.side_channel_port, self._handle, tick=self._tick,
                                     send_timeout=s.side_channel_timeout)
        self.host = advertise_host or s.side_channel_host
        self.port = self._sc.port

    # ------------------------------------------------------------------ engine-facing API
    def offer(self, request_id: str, arrays: Sequence[jax.Array], *, block_ids: Sequence[int] = (),
              num_tokens: int = 0) -> RemotePrefillParams:
        """Offer `arrays` (one pull, all of them) for `request_id`; returns the params for D.

        Raises `CapacityError` when `max_offers` offers are live, `DuplicateRequestError` when
        the request already has a live offer; nothing is registered then."""
        if not isinstance(request_id, str) or not request_id:
            raise TransferConfigError(f"request_id must be a non-empty string, got {request_id!r}")
        if isinstance(arrays, jax.Array) or not isinstance(arrays, Sequence) or not arrays:
            raise TransferConfigError("arrays must be a non-empty sequence of jax.Array")
        for a in arrays:
            if not isinstance(a, jax.Array):
                raise TransferConfigError(f"every offered array must be a jax.Array, got {type(a).__name__}")
        blocks = tuple(check_int("block id", b, 0, error=TransferConfigError) for b in block_ids)
        num_tokens = check_int("num_tokens", num_tokens, 0, error=TransferConfigError)
        with self._lock:
            if self._closed:
                raise RoleError("the producer is closed")
            self._expire_locked()
            if request_id in self._by_request:
                raise DuplicateRequestError(f"request {request_id!r} already has a live offer")
            if len(self._offers) >= self.config.settings.max_offers:
                raise CapacityError(f"{len(self._offers)} offers are live (max_offers="
                                    f"{self.config.settings.max_offers}); release or abort some first")
            tid = secrets.randbits(53) or 1
            while tid in self._offers or tid > MAX_TRANSFER_ID:
                tid = secrets.randbits(53) or 1
            offer = _Offer(
                request_id=request_id, transfer_id=tid,
                shapes=[list(a.shape) for a in arrays], dtypes=[str(a.dtype) for a in arrays],
                specs=[jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in arrays],
                expires_at=self._clock() + self.config.settings.kv_lease_duration)
            self._server.await_pull(tid, list(arrays))
            self._offers[tid] = offer
            self._by_request[request_id] = tid
        return RemotePrefillParams(
            remote_engine_id=self.config.engine_id, remote_request_id=request_id, remote_block_ids=blocks,
            remote_host=self.host, remote_port=self.port, transfer_id=tid, geometry_digest=self._digest,
            remote_num_tokens=num_tokens)

    def abort(self, request_id: str) -> bool:
        """End `request_id`'s offer (reason "aborted"); False if it has none live."""
        with self._lock:
            tid = self._by_request.get(request_id)
            if tid is None:
                return False
            self._release_locked(self._offers[tid], RELEASE_ABORTED, reclaim=True)
            return True

    def poll(self) -> list[tuple[str, str]]:
        """Expire leases and call `on_release` for every offer that ended since the last poll
        (on this thread, once per offer). Returns the `(request_id, reason)` pairs delivered.
        If a callback raises, the remaining ones still run and the first error is re-raised."""
        with self._lock:
            self._expire_locked()
            out = list(self._released)
            self._released.clear()
        first: BaseException | None = None
        for rid, reason in out:
            try:
                self._on_release(rid, reason)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first
        return out

    @property
    def live_offers(self) -> int:
        with self._lock:
            return len(self._offers)

    @property
    def pending_reclaims(self) -> int:
        """Reclaim threads still running (each ends within `side_channel_timeout`)."""
        with self._reclaim_lock:
            return sum(t.is_alive() for t in self._reclaims)

    def lease_left(self, request_id: str) -> float | None:
        """Seconds until `request_id`'s lease runs out (None: no live offer)."""
        with self._lock:
            tid = self._by_request.get(request_id)
            return None if tid is None else self._offers[tid].expires_at - self._clock()

    def close(self) -> None:
        """Stop the side channel, end every live offer (reason "closed", delivered now) and wait
        a bounded time for reclaim threads. The transfer server lives as long as its object."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._sc.close()
        with self._lock:
            for offer in list(self._offers.values()):
                self._release_locked(offer, RELEASE_CLOSED, reclaim=True)
        try:
            self.poll()
        finally:
            with self._reclaim_lock:
                pending = list(self._reclaims)
            for t in pending:
                t.join(self.config.settings.side_channel_timeout + 1.0)

    # ------------------------------------------------------------------ internals
    def _release_locked(self, offer: _Offer, reason: str, *, reclaim: bool) -> None:
        if offer.released is not None:
            return
        offer.released = reason
        del self._offers[offer.transfer_id]
        del self._by_request[offer.request_id]
        self._released.append((offer.request_id, reason))
        if reclaim:
            self._start_reclaim(offer)

    def _expire_locked(self) -> None:
        now = self._clock()
        for offer in [o for o in self._offers.values() if o.expires_at <= now]:
            self._release_locked(offer, RELEASE_EXPIRED, reclaim=True)

    def _start_reclaim(self, offer: _Offer) -> None:
        """Pull the unpulled offer from ourselves so the transfer server drops its copy."""
        def run() -> None:
            conn = None
            try:
                conn = self._server.connect(self.transfer_address)
                out = conn.pull(offer.transfer_id, offer.specs)
                deadline = time.monotonic() + self.config.settings.side_channel_timeout
                while not all(a.is_ready() for a in out):
                    if time.monotonic() > deadline:
                        # Already pulled by a late consumer: nothing left to reclaim.
                        conn._poison_connection()
                        break
                    time.sleep(0.005)
                del out
            except Exception as e:  # the copy is gone either way
                log.debug("reclaim of transfer %d ended with %r", offer.transfer_id, e)
            finally:
                with self._reclaim_lock:
                    self._reclaims.discard(threading.current_thread())

        t = threading.Thread(target=run, name=f"kvjax-reclaim-{offer.transfer_id}", daemon=True)
        with self._reclaim_lock:
            self._reclaims.add(t)
        t.start()

    def _tick(self) -> None:
        with self._lock:
            self._expire_locked()

    def _handle(self, msg: Msg) -> Msg:
        """Side-channel requests (runs on the side-channel thread)."""
        if isinstance(msg, Hello):
            diff = self.geometry.diff(msg.geometry)
            if diff or msg.digest != self._digest:
                names = ", ".join(f"{n} (producer {a!r}, consumer {b!r})" for n, (a, b) in sorted(diff.items()))
                return ErrorReply("geometry_mismatch", f"KV geometry differs: {names or 'digest'}",
                                  {"geometry": self._fields, "digest": self._digest})
            return HelloReply(engine_id=self.config.engine_id, transfer_address=self.transfer_address,
                              geometry=self._fields, digest=self._digest,
                              lease_seconds=self.config.settings.kv_lease_duration)
        with self._lock:
            self._expire_locked()
            if isinstance(msg, Describe):
                offer = self._offers.get(msg.transfer_id)
                if offer is None:
                    return ErrorReply("unknown_transfer", f"no live offer {msg.transfer_id} (never offered, "
                                      "already pulled, expired or aborted)")
                return OfferInfo(transfer_id=offer.transfer_id, request_id=offer.request_id, shapes=offer.shapes,
                                 dtypes=offer.dtypes, lease_left=offer.expires_at - self._clock())
            if isinstance(msg, Heartbeat):
                alive, unknown = [], []
                until = self._clock() + self.config.settings.kv_lease_duration
                for tid in msg.transfer_ids:
                    offer = self._offers.get(tid)
                    if offer is None:
                        unknown.append(tid)
                    else:
                        offer.expires_at = max(offer.expires_at, until)
                        alive.append(tid)
                return HeartbeatReply(alive=alive, unknown=unknown)
            if isinstance(msg, Pulled):
                offer = self._offers.get(msg.transfer_id)
                if offer is None:
                    return Ack(transfer_id=msg.transfer_id, released=False)
                reason = RELEASE_PULLED if msg.ok else RELEASE_CONSUMER_FAILED
                # A failed pull may have left the offer in the table: reclaim it then.
                self._release_locked(offer, reason, reclaim=not msg.ok)
                return Ack(transfer_id=msg.transfer_id, released=True)
        return ErrorReply("unexpected", f"a producer does not answer {type(msg).__name__}")
