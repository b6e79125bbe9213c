"""`RemoteKV`: disaggregated prefill/decode inside one `EngineCore` (kvjax.disagg wired in).

Producer (prefill engine, P). A request added with `kv_transfer_params={"do_remote_decode":
true}` runs its prompt as usual (vLLM's proxy sends it with max_tokens=1). When it finishes,
before it leaves the ledger, its blocks are stored for reuse and pinned
(`store_blocks_for_reuse(pin=True)`), the prompt's full blocks are gathered (a device copy)
and offered (`KVProducer.offer`); the request's `kv_transfer_params` are the offer's params.
The pins hold the blocks in the prefix cache until the offer ends (D reports the pull, the
lease expires, or close): `KVProducer.poll` runs at every step and unpins then.

Consumer (decode engine, D). A request added with a producer's params waits in the queue
(its offer kept alive by heartbeats). Its admission reserves its blocks as for any context
request and takes the local prefix hit first; it then waits for remote KV (`awaiting_kv`: no
prefill chunk is cut for it) while the offer is pulled. On arrival, the blocks beyond the
local hit are scattered into its reserved slots and its context position jumps to
min(offered tokens, prompt - 1): the last prompt token is always computed, for its logits.
Only then can its blocks enter the prefix tree (the ledger stores only materialised
positions), so a failed or late pull leaves nothing published to undo: with
`kv_load_failure_policy = "recompute"` the request prefills from its local hit, with "fail"
it ends with finish reason "error". An abort during a pull takes the request out at once,
but its ledger sequence (and so its blocks) is freed only when the pull reports.

The transport moves the whole offer (one pull of every offered block); the blocks the local
prefix hit already covers are dropped after the pull, not skipped by it. One attention
window and one device only (a sharded mesh or several windows is refused at start).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax

from kvjax.disagg import (
    GeometryMismatchError,
    KVConsumer,
    KVGeometry,
    KVProducer,
    KVTransferConfig,
    RemotePrefillParams,
    TransferConfigError,
    gather_blocks,
    parse_prefill_request,
    scatter_blocks,
)
from kvjax.engine.request_state import LiveRequest, Phase
from kvjax.errors import DuplicateRequestError, KVCacheError

log = logging.getLogger("kvjax.engine.remote_kv")


@dataclasses.dataclass
class RemoteKVCounters:
    """Cumulative totals (the server's Prometheus counters read them)."""

    offers: int = 0  # prompts offered by this producer
    offered_blocks: int = 0
    offer_failures: int = 0  # prompts that finished without an offer (e.g. CapacityError)
    released: dict[str, int] = dataclasses.field(default_factory=dict)  # offers ended, by reason
    pulls: int = 0  # pulls started by this consumer
    pulled_blocks: int = 0  # blocks the transport moved (the local prefix hit's included)
    transferred_tokens: int = 0  # prompt tokens whose KV came from the producer (never computed here)
    pull_failures: int = 0
    pull_seconds: float = 0.0  # summed over reported pulls: from start_pull to the step that saw the result
    recomputed: int = 0  # failed pulls whose requests prefilled locally instead
    failed: int = 0  # failed pulls whose requests ended with "error"


@dataclasses.dataclass
class _Pull:
    request: LiveRequest
    start: int  # the local prefix hit: the context position at admission
    end: int  # the context position once the pulled blocks are in
    started: float = 0.0  # time.perf_counter() at start_pull


class RemoteKV:
    """The producer and/or consumer of one core (see the module docstring). Driven by the
    core's thread only: `prepare`/`attach` at add_request, `admitted` after admissions,
    `finishing` before a finished request leaves the ledger, `poll` at every step."""

    def __init__(self, core: Any, config: KVTransferConfig) -> None:
        """`core`: the `EngineCore` this serves (not imported here: the core imports this module)."""
        if not isinstance(config, KVTransferConfig):
            raise TransferConfigError(f"kv_transfer must be a KVTransferConfig, got {type(config).__name__}")
        cc = core.cache_config
        if len(cc.windows) != 1 or len(cc.pools) != 1:
            raise TransferConfigError(f"disaggregated prefill/decode needs one attention window and one pool; "
                                      f"this cache has windows {list(cc.windows)}")
        if any(len(a.devices()) != 1 for a in core.pools.primary):
            raise TransferConfigError("disaggregated prefill/decode over a sharded mesh is not wired yet")
        self.core = core
        self.config = config
        self.policy = config.kv_load_failure_policy
        self.geometry = KVGeometry.from_cache_config(cc, model=core.engine.model.spec.name)
        self.counters = RemoteKVCounters()
        self.producer = KVProducer(config, self.geometry, on_release=self._released) if config.is_producer else None
        self.consumer = KVConsumer(config, self.geometry) if config.is_consumer else None
        self._pins: dict[str, list[int]] = {}  # producer: request -> its pinned block ids
        self._pulls: dict[str, _Pull] = {}  # consumer: pulls in flight
        self.draining: set[str] = set()  # aborted while pulling: ledger sequence freed when the pull reports
        self._not_started: list[tuple[LiveRequest, Exception]] = []  # admitted, start_pull refused

    # ------------------------------------------------------------------ requests
    def prepare(self, request_id: str, params: Any, prompt_len: int) -> tuple[bool, RemotePrefillParams | None]:
        """Check a request's `kv_transfer_params` before it is queued (nothing changes on error):
        (offer its prompt?, the producer's params to pull)."""
        if request_id in self.draining:
            raise DuplicateRequestError(f"request id {request_id!r} is still draining an aborted pull")
        if isinstance(params, dict) and params.get("do_remote_prefill") is True:
            if self.consumer is None:
                raise TransferConfigError(f"request {request_id!r} carries a producer's kv_transfer_params but this "
                                          f"engine's kv_role is {self.config.kv_role!r}, not a consumer")
            p = RemotePrefillParams.from_dict(params)
            if p.geometry_digest != self.geometry.digest:
                raise GeometryMismatchError(
                    f"request {request_id!r}: the producer's KV geometry digest {p.geometry_digest[:12]}... differs "
                    f"from this engine's {self.geometry.digest[:12]}... (model, dtype, block size, layers or heads)")
            if len(p.remote_block_ids) * self.core.cache_config.tokens_per_block > prompt_len:
                raise TransferConfigError(f"request {request_id!r}: {len(p.remote_block_ids)} offered blocks cover "
                                          f"more than its {prompt_len} prompt tokens")
            return False, p
        if parse_prefill_request(params):
            if self.producer is None:
                raise TransferConfigError(f"request {request_id!r} asks for do_remote_decode but this engine's "
                                          f"kv_role is {self.config.kv_role!r}, not a producer")
            return True, None
        return False, None

    def attach(self, r: LiveRequest, offer: bool, pull: RemotePrefillParams | None) -> None:
        r.remote_decode = offer
        if pull is not None:
            assert self.consumer is not None  # prepare checked the role
            r.remote_prefill = pull
            self.consumer.keep_alive(r.request_id, pull)

    def forget(self, r: LiveRequest) -> None:
        """A queued request left (aborted): stop keeping its offer alive."""
        if r.remote_prefill is not None and self.consumer is not None:
            self.consumer.drop(r.request_id)

    def hold_for_pull(self, r: LiveRequest) -> bool:
        """A running request is aborted: if its pull is in flight, keep its ledger sequence (its
        slots reserved) until the pull reports, so no slot is handed out again while bytes meant
        for it are in flight (the pulled arrays reach the slots only through the scatter here,
        so this order is the conservative one). True: held."""
        if r.request_id not in self._pulls:
            return False
        self.draining.add(r.request_id)
        return True

    # ------------------------------------------------------------------ consumer
    def admitted(self, chosen: list[LiveRequest]) -> None:
        """Start the pull of every admitted request that waits for remote KV."""
        for r in chosen:
            p = r.remote_prefill
            if p is None or len(r.admissions) != 1:
                continue
            assert self.consumer is not None
            r.remote_prefill = None
            tpb = self.core.cache_config.tokens_per_block
            nb = len(p.remote_block_ids)
            start, end = r.context_pos, min(nb * tpb, len(r.context) - 1)
            specs = self._specs(nb)
            try:
                self.consumer.start_pull(r.request_id, p, specs)
            except KVCacheError as e:  # CapacityError, a closed consumer: a failed pull, reported next step
                self.consumer.drop(r.request_id)
                log.warning("request %s: pull not started: %s", r.request_id, e)
                r.awaiting_kv = True
                self._not_started.append((r, e))
                continue
            self.counters.pulls += 1
            r.awaiting_kv = True
            self._pulls[r.request_id] = _Pull(r, start, max(start, end), time.perf_counter())

    def _specs(self, n: int) -> list[jax.ShapeDtypeStruct]:
        """The offered arrays' shapes for `n` blocks, landing on the pools' device."""
        pools = self.core.pools
        ba = pools.block_axis
        out = []
        for spec in pools.geometry.pools:
            for arr in (pools.primary[spec.index], pools.primary_scales[spec.index]):
                if arr is not None:
                    block = arr.shape[:ba] + arr.shape[ba + 1:]
                    sharding = jax.sharding.SingleDeviceSharding(next(iter(arr.devices())))
                    out.append(jax.ShapeDtypeStruct((n, *block), arr.dtype, sharding=sharding))
        return out

    def _arrived(self, pull: _Pull, arrays) -> None:
        """Scatter the blocks beyond the local hit into the request's reserved slots."""
        core, r = self.core, pull.request
        tpb = core.cache_config.tokens_per_block
        # a failed host-tier onboard may have cut the local hit back meanwhile (transfers_failed):
        # the offer covers the prompt from its start, so it fills that gap too
        pull.start = min(pull.start, r.context_pos)
        first, last = pull.start // tpb, -(-pull.end // tpb)
        self.counters.pulled_blocks += int(arrays[0].shape[0])
        if last > first:
            row = core.ledger.block_table([r.request_id])[0]  # [max_blocks] primary slots
            slots = [int(s) for s in row[first:last]]
            core.pools = scatter_blocks(core.pools, [slots], [a[first:last] for a in arrays])
        moved = pull.end - pull.start
        r.context_pos = pull.end
        core.ledger.set_context_position(r.request_id, pull.end)
        r.admissions[-1] = dataclasses.replace(r.admissions[-1], transferred=moved)
        self.counters.transferred_tokens += moved

    def _pull_failed(self, r: LiveRequest, error: Exception, outputs: list | None) -> Any:
        """Apply kv_load_failure_policy: prefill from the local hit, or end the request."""
        self.counters.pull_failures += 1
        if self.policy == "recompute":
            self.counters.recomputed += 1
            log.warning("request %s: KV pull failed (%s); recomputing its prompt", r.request_id, error)
            return None
        self.counters.failed += 1
        log.warning("request %s: KV pull failed (%s); failing it (kv_load_failure_policy=fail)", r.request_id, error)
        r.kv_error = f"{type(error).__name__}: {error}"
        out = self.core.abort_request(r.request_id, reason="error")
        if out is not None and outputs is not None:
            outputs.append(out)
        return out

    # ------------------------------------------------------------------ producer
    def finishing(self, r: LiveRequest) -> None:
        """A do_remote_decode request finished (still in the ledger): pin, gather, offer."""
        assert self.producer is not None  # prepare checked the role
        core, rid = self.core, r.request_id
        ids = core.ledger.store_blocks_for_reuse(rid, pin=True)
        assert isinstance(ids, list)  # one window (checked at start)
        nb = len(r.prompt) // core.cache_config.tokens_per_block
        keep, extra = ids[:nb], ids[nb:]
        if extra:
            core.ledger.unpin_blocks(extra)
        if not keep:
            return
        try:
            params = self.producer.offer(rid, gather_blocks(core.pools, [keep]), block_ids=keep, num_tokens=nb * (
                core.cache_config.tokens_per_block))
        except KVCacheError as e:
            core.ledger.unpin_blocks(keep)
            self.counters.offer_failures += 1
            log.warning("request %s: KV not offered: %s", rid, e)
            return
        self._pins[rid] = keep
        self.counters.offers += 1
        self.counters.offered_blocks += nb
        r.kv_transfer_params = params.to_dict()

    def _released(self, request_id: str, reason: str) -> None:
        ids = self._pins.pop(request_id, None)
        if ids is not None:
            self.core.ledger.unpin_blocks(ids)
        self.counters.released[reason] = self.counters.released.get(reason, 0) + 1

    # ------------------------------------------------------------------ every step
    def poll(self, outputs: list) -> None:
        """Deliver ended offers (unpin) and finished pulls (scatter, or the failure policy)."""
        if self.producer is not None:
            self.producer.poll()
        if self.consumer is None:
            return
        failed, self._not_started = self._not_started, []
        for r, e in failed:
            r.awaiting_kv = False
            if r.phase is Phase.CONTEXT:
                self._pull_failed(r, e, outputs)
        for res in self.consumer.poll():
            rid = res.request_id
            if rid in self.draining:  # aborted meanwhile: its slots are free to reuse only now
                self.draining.discard(rid)
                self._pulls.pop(rid, None)
                self.core.ledger.remove_sequence(rid, store_for_reuse=True)
                continue
            pull = self._pulls.pop(rid, None)
            if pull is None:  # a held request whose offer vanished while queued
                held = next((x for x in self.core.waiting if x.request_id == rid), None)
                if held is None or held.remote_prefill is None:
                    continue
                held.remote_prefill = None
                self._pull_failed(held, _error(res.value), outputs)
                continue
            self.counters.pull_seconds += time.perf_counter() - pull.started
            r = pull.request
            r.awaiting_kv = False
            if r.phase is not Phase.CONTEXT:
                continue
            if res.status == "ok":
                self._arrived(pull, res.value)
            else:
                self._pull_failed(r, _error(res.value), outputs)

    @property
    def busy(self) -> bool:
        """Pulls still to report (the core is not idle until they do)."""
        return bool(self._pulls or self._not_started)

    def close(self) -> None:
        """Abandon pulls (their connections poisoned and threads joined, bounded), free the
        sequences of aborted ones, end every offer (its pins dropped)."""
        if self.consumer is not None:
            self.consumer.close()
            for rid in sorted(self.draining):
                self.core.ledger.remove_sequence(rid, store_for_reuse=False)
            self.draining.clear()
            self._pulls.clear()
        if self.producer is not None:
            self.producer.close()


def _error(value: object) -> Exception:
    return value if isinstance(value, Exception) else RuntimeError(repr(value))
