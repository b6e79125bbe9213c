"""`StoreTier`: the one object the engine will drive for tier 3, from its scheduler thread.

It joins the pieces: block hashes become keys (`StoreNamespace`), `WritePolicy` decides which
host blocks are written, `PrefetchPolicy` which requests consult the store and when their
prefetch stops, and a `StoreWorker` runs the I/O. It never blocks and never touches the
ledger: the engine tells it what happened to host slots, calls `step()` once per engine step,
and acts on what comes back (vLLM's `SecondaryTierManager` has the same shape). Host slots are
ints the caller owns; `views[i]` is the writable numpy view of slot `slots[i]`.

Pinning rule: a host slot read by a put or written by a get stays pinned until that job's
result has been polled; `pinned_slots()` says which, `TierStep.released_slots` when they come
free. The caller must not reuse a pinned slot.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from kvjax.kv_store.errors import WorkerFullError
from kvjax.kv_store.interface import KVStore
from kvjax.kv_store.keys import StoreNamespace, block_store_keys
from kvjax.kv_store.policies import PrefetchDecision, PrefetchPolicy, WritePolicy
from kvjax.kv_store.worker import JobKind, JobResult, StoreWorker


class PrefetchState(enum.Enum):
    LOOKING = "looking"  # lookup in flight
    FOUND = "found"  # lookup done, worth fetching: the caller allocates `found` host slots
    FETCHING = "fetching"  # gets in flight
    DONE = "done"  # nothing (more) to wait for: `usable` blocks are in their host slots


@dataclasses.dataclass
class _Prefetch:
    keys: list[str]
    state: PrefetchState = PrefetchState.LOOKING
    found: int = 0
    started: float = 0.0
    chunk_ok: list[bool | None] = dataclasses.field(default_factory=list)  # per get job: None while in flight
    chunk_jobs: list[int] = dataclasses.field(default_factory=list)
    chunk_blocks: int = 1
    usable: int = 0


@dataclasses.dataclass
class TierStep:
    """What one `step()` polled: slots free to reuse, requests whose lookup finished (with the
    number of leading blocks worth fetching, 0 for none), keys whose put failed or succeeded,
    and keys a get did not find (or failed on)."""

    released_slots: list[int] = dataclasses.field(default_factory=list)
    lookups_done: dict[Hashable, int] = dataclasses.field(default_factory=dict)
    failed_puts: list[str] = dataclasses.field(default_factory=list)
    stored: list[str] = dataclasses.field(default_factory=list)
    failed_gets: list[str] = dataclasses.field(default_factory=list)
    errors: list[BaseException] = dataclasses.field(default_factory=list)


class StoreTier:
    """Tier 3 for one pool (one namespace). `get_chunk_blocks` blocks go in one get job, so a
    prefetch completes chunk by chunk and a `best_effort`/`timeout` stop can use the chunks
    already in. Counters: `puts_submitted`, `puts_dropped` (the worker was full: the block is
    simply not written), `blocks_restored`."""

    def __init__(
        self,
        store: KVStore,
        namespace: StoreNamespace,
        *,
        prefetch_policy: PrefetchPolicy,
        write_policy: WritePolicy | None = None,
        num_threads: int = 2,
        max_pending: int = 64,
        get_chunk_blocks: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(get_chunk_blocks, bool) or not isinstance(get_chunk_blocks, int) or get_chunk_blocks < 1:
            raise ValueError(f"get_chunk_blocks must be a positive int, got {get_chunk_blocks!r}")
        if prefetch_policy.tokens_per_block != namespace.tokens_per_block:
            raise ValueError(
                f"prefetch policy counts {prefetch_policy.tokens_per_block} tokens per block, "
                f"the namespace {namespace.tokens_per_block}"
            )
        self.namespace = namespace
        self.write_policy = write_policy if write_policy is not None else WritePolicy()
        self.prefetch_policy = prefetch_policy
        self.worker = StoreWorker(store, num_threads=num_threads, max_pending=max_pending)
        self.get_chunk_blocks = get_chunk_blocks
        self._clock = clock
        self._pins: Counter[int] = Counter()  # slot -> jobs in flight that read or write it
        self._job_slots: dict[int, list[int]] = {}
        self._lookups: dict[int, Hashable] = {}  # lookup job id -> request
        self._gets: dict[int, tuple[Hashable, int]] = {}  # get job id -> (request, chunk index)
        self._prefetches: dict[Hashable, _Prefetch] = {}
        self.puts_submitted = 0
        self.puts_dropped = 0
        self.blocks_restored = 0

    # ------------------------------------------------------------------ helpers
    def keys(self, block_hashes: Sequence[bytes] | Sequence[int]) -> list[str]:
        return block_store_keys(self.namespace, list(block_hashes))  # type: ignore[arg-type]

    def _pin(self, job_id: int, slots: list[int]) -> None:
        self._job_slots[job_id] = slots
        self._pins.update(slots)

    def _unpin(self, job_id: int, out: list[int]) -> None:
        for s in self._job_slots.pop(job_id, ()):
            self._pins[s] -= 1
            if self._pins[s] == 0:
                del self._pins[s]
                out.append(s)

    def pinned_slots(self) -> set[int]:
        """Host slots a job in flight (or finished but not yet polled) reads or writes."""
        return set(self._pins)

    def _put(self, want: list[str], keys: list[str], slots: Sequence[int], views: Sequence[Any]) -> None:
        if not want:
            return
        pos = {k: i for i, k in enumerate(keys)}
        idx = [pos[k] for k in want]
        try:
            h = self.worker.put(want, [views[i] for i in idx])
        except WorkerFullError:
            self.write_policy.on_store_result(want, [False] * len(want))
            self.puts_dropped += len(want)
            return
        self._pin(h.job_id, [slots[i] for i in idx])
        self.puts_submitted += len(want)

    @staticmethod
    def _check(hashes: Sequence[Any], slots: Sequence[int], views: Sequence[Any]) -> None:
        if not len(hashes) == len(slots) == len(views):
            raise ValueError(f"{len(hashes)} hashes, {len(slots)} slots and {len(views)} views: one of each per block")

    # ------------------------------------------------------------------ host-tier events
    def host_stored(self, block_hashes: Sequence[Any], slots: Sequence[int], views: Sequence[Any], *,
                    from_store: bool = False) -> None:
        """Blocks whose host copies are complete (an offload was applied, or a restore)."""
        self._check(block_hashes, slots, views)
        keys = self.keys(block_hashes)
        self._put(self.write_policy.on_host_stored(keys, from_store=from_store), keys, slots, views)

    def host_hit(self, block_hashes: Sequence[Any], slots: Sequence[int], views: Sequence[Any]) -> None:
        """Host blocks a request reused."""
        self._check(block_hashes, slots, views)
        keys = self.keys(block_hashes)
        self._put(self.write_policy.on_hit(keys), keys, slots, views)

    def host_evicting(self, block_hashes: Sequence[Any], slots: Sequence[int], views: Sequence[Any]) -> set[int]:
        """Blocks the host tier wants to evict; returns the slots among them that must stay
        pinned (a put reads them) until `step()` releases them."""
        self._check(block_hashes, slots, views)
        keys = self.keys(block_hashes)
        self._put(self.write_policy.on_host_evicted(keys), keys, slots, views)
        return {s for s in slots if s in self._pins}

    # ------------------------------------------------------------------ prefetch
    def consult(self, request_id: Hashable, block_hashes: Sequence[Any], missing_tokens: int) -> bool:
        """Start looking up a request's blocks after its local hit (`block_hashes`: the chain
        past the local hit). False when the policy says not to, or the worker is full."""
        if request_id in self._prefetches:
            raise ValueError(f"request {request_id!r} already has a prefetch")
        if not block_hashes or not self.prefetch_policy.should_consult(missing_tokens):
            return False
        keys = self.keys(block_hashes)
        try:
            h = self.worker.lookup(keys)
        except WorkerFullError:
            return False
        self._lookups[h.job_id] = request_id
        self._prefetches[request_id] = _Prefetch(keys)
        return True

    def state(self, request_id: Hashable) -> tuple[PrefetchState, int]:
        """(state, blocks): `found` while FOUND, usable blocks when DONE, 0 otherwise."""
        p = self._prefetches[request_id]
        return p.state, (p.found if p.state is PrefetchState.FOUND else p.usable if p.state is PrefetchState.DONE else 0)

    def fetch(self, request_id: Hashable, slots: Sequence[int], views: Sequence[Any]) -> None:
        """Read the FOUND blocks into host slots the caller allocated (the first `len(slots)`
        of them: fewer when the pool is short); the slots are pinned until their jobs are polled."""
        p = self._prefetches[request_id]
        if p.state is not PrefetchState.FOUND:
            raise ValueError(f"request {request_id!r} is {p.state.value}, not found")
        if not 0 < len(slots) == len(views) <= p.found:
            raise ValueError(f"fetch takes 1..{p.found} slots with one view each, got {len(slots)} and {len(views)}")
        n, c = len(slots), self.get_chunk_blocks
        chunks = [(i, min(i + c, n)) for i in range(0, n, c)]
        if self.worker.pending + len(chunks) > self.worker.max_pending:
            raise WorkerFullError(f"a fetch of {len(chunks)} jobs does not fit in the worker; retry after a step")
        p.state, p.found, p.started, p.chunk_blocks = PrefetchState.FETCHING, n, self._clock(), c
        for ci, (a, b) in enumerate(chunks):
            h = self.worker.get_into(p.keys[a:b], list(views[a:b]))
            self._pin(h.job_id, list(slots[a:b]))
            self._gets[h.job_id] = (request_id, ci)
            p.chunk_jobs.append(h.job_id)
            p.chunk_ok.append(None)

    def decide(self, request_id: Hashable, scheduler_ready: bool) -> PrefetchDecision:
        """Ask the prefetch policy about a FETCHING request; on stop the request is DONE with
        `use_blocks` usable blocks (chunks still in flight keep their slots pinned)."""
        p = self._prefetches[request_id]
        if p.state is not PrefetchState.FETCHING:
            raise ValueError(f"request {request_id!r} is {p.state.value}, not fetching")
        done = 0
        for ci, ok in enumerate(p.chunk_ok):
            if ok is not True:
                break
            done = min((ci + 1) * p.chunk_blocks, p.found)
        failed = any(ok is False for ok in p.chunk_ok)
        if failed:  # blocks past a failed chunk can never join the prefix
            d = PrefetchDecision(True, done)
        else:
            d = self.prefetch_policy.decide(elapsed_s=self._clock() - p.started, blocks=p.found, done_prefix=done,
                                            scheduler_ready=scheduler_ready)
        if d.stop:
            p.state, p.usable = PrefetchState.DONE, d.use_blocks
            self.blocks_restored += d.use_blocks
        return d

    def forget(self, request_id: Hashable) -> None:
        """Drop a request's prefetch (finished or aborted); its jobs in flight still release
        their slots through `step()`."""
        self._prefetches.pop(request_id, None)

    # ------------------------------------------------------------------ the step
    def step(self) -> TierStep:
        """Poll the worker once (never blocks) and apply what finished."""
        out = TierStep()
        for r in self.worker.poll():
            self._apply(r, out)
        return out

    def _apply(self, r: JobResult, out: TierStep) -> None:
        jid = r.handle.job_id
        if r.error is not None:
            out.errors.append(r.error)
        if r.handle.kind is JobKind.PUT:
            ok = list(r.ok) if r.ok is not None else [False] * len(r.keys)
            self.write_policy.on_store_result(r.keys, ok)
            out.failed_puts.extend(k for k, good in zip(r.keys, ok, strict=True) if not good)
            out.stored.extend(k for k, good in zip(r.keys, ok, strict=True) if good)
        elif r.handle.kind is JobKind.LOOKUP:
            rid = self._lookups.pop(jid)
            p = self._prefetches.get(rid)
            if p is not None and p.state is PrefetchState.LOOKING:
                hits = r.hits or 0
                if self.prefetch_policy.should_fetch(hits):
                    p.state, p.found = PrefetchState.FOUND, hits
                else:
                    p.state = PrefetchState.DONE
                out.lookups_done[rid] = p.found
        else:
            got = list(r.ok) if r.ok is not None else [False] * len(r.keys)
            out.failed_gets.extend(k for k, good in zip(r.keys, got, strict=True) if not good)
            rid, ci = self._gets.pop(jid)
            p = self._prefetches.get(rid)
            if p is not None and p.state is PrefetchState.FETCHING:
                p.chunk_ok[ci] = r.succeeded
        self._unpin(jid, out.released_slots)

    def close(self, *, cancel: bool = True) -> None:
        """Stop the worker (cancelling queued jobs by default); the store stays open."""
        self.worker.close(cancel=cancel)
        out = TierStep()
        for r in self.worker.poll():
            self._apply(r, out)
