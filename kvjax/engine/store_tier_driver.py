"""The third KV tier in the engine: `StoreTierDriver` drives a `kvjax.kv_store.StoreTier`
from `EngineCore`'s step, so host blocks survive in a disk / Redis / memory store and a
restarted engine, or another replica sharing the store, finds them again.

Data goes device <-> host pool <-> numpy staging <-> store; the ledger does no I/O:

- **Writes.** The ledger's host notices (`enable_host_notices`) come with the transfer plan
  they belong to. Before the plan is applied, the blocks it may overwrite that a notice names
  (`HIT`, `EVICTING`) are staged (copied out of the host pool, `kvjax.device.host_blocks`);
  after it applied, the blocks it offloaded (`STORED`) are. The write policy decides which
  staged blocks are put (`write_through`, `write_through_selective`, `write_back`: the latter
  puts an `EVICTING` block from its staged copy). A put reads only its staging copy, so the
  host slot is free again as soon as the copy is taken: the copy is the "pinned" host block,
  held until the store acknowledges the put. A block whose bytes are not in its slot at the
  time a notice is handled (stored and evicted by one plan; a failed plan's offloads) is
  simply not written: a store never gets bytes that are not the block's.
- **Restores.** A new request, after its local prefix match, consults the store for the blocks
  that follow (not below `prefetch_min_tokens`); it waits outside the queue (`parked`) while
  the lookup and the gets run. The gets fill staging buffers for host blocks the ledger
  reserved (`reserve_restore`); when the prefetch policy stops it, the leading blocks that
  arrived are written into their host slots and committed (`commit_restore`), the rest freed;
  the request then queues again and its admission onboards them through the transfer plan
  like any host hit. A failed or late get only shortens what is committed (the blocks after
  it are recomputed): requests are never lost and never read bytes of a failed get.

Limits: one attention window (no sliding-window or recurrent-state caches), no mesh (sharded
pools), prompts without extra ids or multimodal items are the only ones consulted (their keys
are `prompt_block_hashes`).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.config import CacheConfig
from kvjax.errors import InvalidArgumentError, InvalidRequestError, OutOfBlocksError
from kvjax.kv_store import (
    KVStore,
    PrefetchPolicy,
    PrefetchState,
    StoreTier,
    WorkerFullError,
    WritePolicy,
    load_store,
    namespace_for_pool,
)
from kvjax.ledger.block_hashing import prompt_block_hashes
from kvjax.ledger.host_notices import HostNotice, HostNoticeKind

if TYPE_CHECKING:
    from kvjax.device.pools import KVPools
    from kvjax.engine.request_state import LiveRequest
    from kvjax.ledger.tier3 import Restore


@dataclasses.dataclass(frozen=True)
class KVStoreConfig:
    """How an engine uses a third tier. `url` (`kvjax.kv_store.load_store`) or `store` (an
    object with the `KVStore` methods; the engine closes it on `close` unless `close_store` is
    False); `model_id` names the weights in the keys' namespace (same weights, same id: an
    engine with other weights must never read these blocks); policies as in docs/kv_store.md."""

    url: str | None = None
    store: Any = None
    model_id: str = ""
    write_policy: str = "write_through"
    prefetch_policy: str = "timeout"
    prefetch_min_tokens: int = 256
    prefetch_timeout_s: float = 0.5
    prefetch_timeout_per_block_s: float = 0.002
    threads: int = 2
    max_pending: int = 64
    close_store: bool = True

    def __post_init__(self) -> None:
        if (self.url is None) == (self.store is None):
            raise InvalidArgumentError("a KV store needs exactly one of url and store")
        if not isinstance(self.model_id, str) or not self.model_id:
            raise InvalidArgumentError("a KV store needs the model's identity (model_id) for its keys' namespace")
        WritePolicy(self.write_policy)  # the policies' own checks, at configuration time
        PrefetchPolicy(self.prefetch_policy, tokens_per_block=1, min_hit_tokens=self.prefetch_min_tokens,
                       timeout_base_s=self.prefetch_timeout_s, timeout_per_block_s=self.prefetch_timeout_per_block_s)

    def open(self) -> KVStore:
        return load_store(self.url) if self.url is not None else self.store


def check_store_cache(cache_config: CacheConfig) -> None:
    """A cache a third tier can serve, else `InvalidArgumentError` saying why."""
    cc = cache_config
    if len(cc.windows) != 1:
        raise InvalidArgumentError(f"a KV store needs a cache with one attention window, this one has {cc.windows}")
    if not cc.enable_block_reuse:
        raise InvalidArgumentError("a KV store needs block reuse (restored blocks are cached)")
    if cc.secondary_blocks_for(cc.windows[0]) == 0:
        raise InvalidArgumentError(
            "a KV store sits under the host tier: give the cache host blocks (secondary_blocks > 0)")


class _LazyBlocks(Sequence[np.ndarray]):
    """Staged copies of host slots, read from the pools on first access (a notice the write
    policy does not want costs no copy)."""

    def __init__(self, read: Callable[[list[int]], np.ndarray], slots: list[int]) -> None:
        self._read, self._slots = read, slots
        self._data: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, i: Any) -> Any:
        if self._data is None:
            self._data = self._read(self._slots)  # [slots, block_bytes]
        return self._data[i]


@dataclasses.dataclass
class _Parked:
    request: LiveRequest
    first: int  # blocks of the local prefix match when the store was consulted
    hashes: list[Any]
    restore: Restore | None = None
    staging: np.ndarray | None = None  # [blocks, block_bytes] uint8, filled by the gets


@dataclasses.dataclass
class StoreCounters:
    """Totals since the engine started (Prometheus counters read them)."""

    lookups: int = 0  # requests that consulted the store
    lookup_hit_blocks: int = 0  # blocks lookups found
    restored_blocks: int = 0  # blocks committed into the host tier from the store
    restored_tokens: int = 0
    restore_aborts: int = 0  # prefetches given up (no host block, the prefix changed, worker full)
    failed_puts: int = 0
    errors: int = 0


class StoreTierDriver:
    """One engine's third tier (see the module docstring); called from `EngineCore` only."""

    def __init__(self, config: KVStoreConfig, core: Any) -> None:  # core: the EngineCore (no import: a cycle)
        cc = core.cache_config
        check_store_cache(cc)
        if getattr(core.engine.runner, "mesh", None) is not None or core.rank_digest is not None:
            raise InvalidArgumentError("a KV store is not wired for sharded pools (a mesh) yet")
        self.config = config
        self.window = cc.windows[0]
        self.pool_indices = [p.index for p in cc.pools if p.window == self.window]
        pools = [cc.pools[i] for i in self.pool_indices]
        extra = (("pools", repr([(tuple(p.layers), p.num_kv_heads, p.head_dim) for p in pools])),) if len(pools) > 1 else ()
        ns = namespace_for_pool(cc, pools[0], model=config.model_id, extra=extra)
        self.tokens_per_block = cc.tokens_per_block
        self.hash_kind = cc.event_hash
        self.store = config.open()
        self.tier = StoreTier(
            self.store, ns,
            prefetch_policy=PrefetchPolicy(config.prefetch_policy, tokens_per_block=cc.tokens_per_block,
                                           min_hit_tokens=config.prefetch_min_tokens,
                                           timeout_base_s=config.prefetch_timeout_s,
                                           timeout_per_block_s=config.prefetch_timeout_per_block_s),
            write_policy=WritePolicy(config.write_policy), num_threads=config.threads, max_pending=config.max_pending)
        self.parked: dict[Hashable, _Parked] = {}
        self.counters = StoreCounters()
        self._post: list[HostNotice] = []  # STORED notices staged once their plan is applied
        self._core = core
        self._closed = False
        # tier-3 KV events (medium "STORAGE"), collected only when the engine publishes events
        self._events: list[Any] | None = [] if core.events is not None else None
        core.ledger.enable_host_notices()

    # ------------------------------------------------------------------ host blocks
    def _read(self, pools: KVPools, slots: list[int]) -> np.ndarray:
        from kvjax.device.host_blocks import read_host_blocks

        return read_host_blocks(pools, self.pool_indices, slots)

    def _feed(self, pools: KVPools, kind: HostNoticeKind, notices: list[HostNotice]) -> None:
        notices = [n for n in notices if n.block_hash is not None]
        if not notices:
            return
        hashes = [n.block_hash for n in notices]
        slots = [n.host_slot for n in notices]
        views = _LazyBlocks(lambda s: self._read(pools, s), slots)
        if kind is HostNoticeKind.STORED:
            self.tier.host_stored(hashes, slots, views)
        elif kind is HostNoticeKind.HIT:
            self.tier.host_hit(hashes, slots, views)
        else:
            self.tier.host_evicting(hashes, slots, views)  # staged copies: no slot stays pinned

    def before_transfers(self, pools: KVPools) -> None:
        """The ledger's notices for the plan about to be applied: stage what it may overwrite
        (hits, evictions), keep the offloads for `after_transfers`."""
        notices = self._core.ledger.take_host_notices()
        if not notices:
            return
        last: dict[int, int] = {}  # host slot -> index of the last offload into it in this plan
        for i, n in enumerate(notices):
            if n.kind is HostNoticeKind.STORED:
                last[n.host_slot] = i
        dirty: set[int] = set()  # slots this plan writes before the notice's point
        pre: dict[HostNoticeKind, list[HostNotice]] = {HostNoticeKind.HIT: [], HostNoticeKind.EVICTING: []}
        for i, n in enumerate(notices):
            if n.kind is HostNoticeKind.STORED:
                dirty.add(n.host_slot)
                if last[n.host_slot] == i:  # no later offload overwrites it: its bytes are there after the plan
                    self._post.append(n)
            elif n.host_slot not in dirty:  # bytes there now: stage them before the plan runs
                pre[n.kind].append(n)
        for kind, ns in pre.items():
            self._feed(pools, kind, ns)

    def after_transfers(self, pools: KVPools, applied: bool) -> None:
        """The plan ran (`applied`) or failed: write its offloaded blocks per the policy, or
        drop their notices (their bytes may be missing)."""
        post, self._post = self._post, []
        if applied:
            self._feed(pools, HostNoticeKind.STORED, post)

    # ------------------------------------------------------------------ the step
    def before_step(self) -> None:
        """Poll the store; finish lookups and prefetches; consult it for new requests."""
        core = self._core
        st = self.tier.step()
        self.counters.failed_puts += len(st.failed_puts)
        self.counters.errors += len(st.errors)
        if self._events is not None:
            self._storage_events(st.stored, st.failed_gets)
        for rid, found in st.lookups_done.items():
            p = self.parked.get(rid)
            if p is None:
                continue
            self.counters.lookup_hit_blocks += found
            if found:
                self._start_fetch(p, found)
            else:
                self._release(p)
        for p in list(self.parked.values()):
            rid = p.request.request_id
            if p.restore is not None and self.tier.state(rid)[0] is PrefetchState.FETCHING:
                d = self.tier.decide(rid, scheduler_ready=True)
                if d.stop:
                    self._finish_restore(p, d.use_blocks)
        for r in list(core.waiting):
            if not r.admissions and not r.store_checked:
                r.store_checked = True
                self._consult(r)
        if self.parked and not core.waiting and not core.running:
            time.sleep(0.0005)  # every request waits on the store: do not spin the engine thread

    def _consult(self, r: LiveRequest) -> None:
        req = r.ledger_request()
        if req.extra_ids is not None or req.mm_items:
            return
        tpb = self.tokens_per_block
        first = self._core.ledger.analyze_prefix_reuse(req).total_matched_tokens // tpb
        hashes = list(prompt_block_hashes(req.prompt, tpb, lora_task_id=req.lora_task_id, cache_salt=req.cache_salt,
                                          hash_kind=self.hash_kind))[first:]
        if not self.tier.consult(r.request_id, hashes, len(req.prompt) - first * tpb):
            return
        self.counters.lookups += 1
        self._core.waiting.remove(r)
        self.parked[r.request_id] = _Parked(r, first, hashes)

    def _start_fetch(self, p: _Parked, found: int) -> None:
        led = self._core.ledger
        rid = p.request.request_id
        try:
            restore = led.reserve_restore(p.request.ledger_request(), found)
        except (OutOfBlocksError, InvalidRequestError):
            self._give_up(p)
            return
        self._stage_evicted()
        if restore.first != p.first:  # the local prefix changed meanwhile: the keys no longer line up
            led.abort_restore(restore)
            self._give_up(p)
            return
        n = restore.num_blocks
        staging = np.empty((n, self._block_bytes()), np.uint8)  # [blocks, block_bytes]
        try:
            self.tier.fetch(rid, restore.host_slots[self.window], [staging[i] for i in range(n)])
        except WorkerFullError:
            led.abort_restore(restore)
            self._give_up(p)
            return
        p.restore, p.staging = restore, staging

    def _stage_evicted(self) -> None:
        """`reserve_restore` may evict cached host blocks: their bytes are staged now, before
        the restore overwrites their slots (notices of plan ops not applied yet wait)."""
        notices = self._core.ledger.take_host_notices()
        dirty = {n.host_slot for n in notices if n.kind is HostNoticeKind.STORED}
        now = [n for n in notices if n.kind is HostNoticeKind.EVICTING and n.host_slot not in dirty]
        self._feed(self._core.pools, HostNoticeKind.EVICTING, now)
        self._post.extend(n for n in notices if n.kind is HostNoticeKind.STORED)

    def _block_bytes(self) -> int:
        from kvjax.device.host_blocks import host_block_bytes

        return host_block_bytes(self._core.pools, self.pool_indices)

    def _finish_restore(self, p: _Parked, usable: int) -> None:
        from kvjax.device.host_blocks import write_host_blocks

        core = self._core
        assert p.restore is not None and p.staging is not None
        slots = p.restore.host_slots[self.window][:usable]
        if usable:
            core.pools = write_host_blocks(core.pools, self.pool_indices, slots, p.staging[:usable])
        core.ledger.commit_restore(p.restore, usable)
        if usable:  # in the store already: never written back
            self.tier.host_stored(p.hashes[:usable], slots, [p.staging[i] for i in range(usable)], from_store=True)
        self.counters.restored_blocks += usable
        self.counters.restored_tokens += usable * self.tokens_per_block
        p.restore = None
        self._release(p)

    def _give_up(self, p: _Parked) -> None:
        self.counters.restore_aborts += 1
        self._release(p)

    def _release(self, p: _Parked) -> None:
        """Back into the queue, after the paused requests (which resume first)."""
        self.tier.forget(p.request.request_id)
        del self.parked[p.request.request_id]
        waiting = self._core.waiting
        waiting.insert(sum(1 for x in waiting if x.admissions), p.request)

    # ------------------------------------------------------------------ events
    def _hash_of(self, key: str) -> bytes | int:
        digits = key[key.rindex("-") + 1:]  # keys end in the block hash's hex (kvjax.kv_store.keys)
        return bytes.fromhex(digits) if self.hash_kind == "sha256" else int(digits, 16)

    def _storage_events(self, stored: list[str], missing: list[str]) -> None:
        """`BlockStored` / `BlockRemoved` with medium "STORAGE" (vLLM's offloading tiers' form:
        hashes only, no parent or tokens) for acknowledged puts and gets that found nothing."""
        from kvjax.kv_events.wire import MEDIUM_STORAGE, BlockRemoved, BlockStored

        assert self._events is not None
        if stored:
            self._events.append(BlockStored(block_hashes=[self._hash_of(k) for k in stored], parent_block_hash=None,
                                            token_ids=[], block_size=self.tokens_per_block, lora_id=None,
                                            medium=MEDIUM_STORAGE, lora_name=None))
        if missing:
            self._events.append(BlockRemoved(block_hashes=[self._hash_of(k) for k in missing], medium=MEDIUM_STORAGE))

    def take_events(self) -> list[Any]:
        """The tier-3 wire events since the last call (empty unless the engine publishes events)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out

    # ------------------------------------------------------------------ requests and shutdown
    def drop(self, request_id: Hashable) -> bool:
        """An aborted request: give its reserved host blocks back. True if it was parked."""
        p = self.parked.pop(request_id, None)
        if p is None:
            return False
        if p.restore is not None:
            self._core.ledger.abort_restore(p.restore)
        self.tier.forget(request_id)
        return True

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    def stats(self) -> dict[str, int]:
        """Counters of the driver, the tier and the store (`StoreStats` where it keeps one)."""
        out = {f"driver_{k}": v for k, v in dataclasses.asdict(self.counters).items()}
        out.update(puts_submitted=self.tier.puts_submitted, puts_dropped=self.tier.puts_dropped)
        st = getattr(self.store, "stats", None)
        if st is not None and hasattr(st, "as_dict"):
            out.update({f"store_{k}": v for k, v in st.as_dict().items()})
        return out

    def close(self) -> None:
        """Finish the puts in flight (a restart must find them), then close the store."""
        if self._closed:
            return
        self._closed = True
        for p in list(self.parked.values()):
            self.drop(p.request.request_id)
        self.tier.close(cancel=False)
        if self.config.close_store:
            self.store.close()


#: keyword options (`kvjax.LLM`, `LLMEngine.from_options`) -> `KVStoreConfig` fields; `kv_store`
#: is a URL or a store object
STORE_OPTIONS = {
    "kv_store": "url", "kv_store_model_id": "model_id", "kv_store_write_policy": "write_policy",
    "kv_store_prefetch_policy": "prefetch_policy", "kv_store_prefetch_min_tokens": "prefetch_min_tokens",
    "kv_store_prefetch_timeout": "prefetch_timeout_s", "kv_store_prefetch_timeout_per_block": "prefetch_timeout_per_block_s",
    "kv_store_threads": "threads", "kv_store_max_pending": "max_pending",
}


def pop_store_options(options: dict[str, Any], default_model_id: str | None = None) -> KVStoreConfig | None:
    """Take the `kv_store*` keys out of `options`: a `KVStoreConfig`, or None without
    `kv_store` (the other keys alone are refused: they would silently do nothing)."""
    given = {k: options.pop(k) for k in list(options) if k in STORE_OPTIONS}
    target = given.pop("kv_store", None)
    if target is None:
        if given:
            raise InvalidArgumentError(f"{sorted(given)[0]} needs kv_store (a store URL or object)")
        return None
    fields = {STORE_OPTIONS[k]: v for k, v in given.items()}
    fields.setdefault("model_id", default_model_id or "")
    if not fields["model_id"]:
        raise InvalidArgumentError("kv_store needs kv_store_model_id: the identity of the weights, which the keys hold")
    if isinstance(target, str):
        return KVStoreConfig(url=target, **fields)
    return KVStoreConfig(store=target, close_store=False, **fields)


def model_identity(name: str, *parts: Any) -> str:
    """A namespace `model_id` from a model's name and what fixes its weights (seed, revision)."""
    return "@".join([name] + [str(x) for x in parts])
