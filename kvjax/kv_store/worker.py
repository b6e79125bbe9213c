"""`StoreWorker`: runs blocking store calls on a few threads so the engine only submits and polls.

The engine thread never waits on disk or network: it submits `lookup`, `put` and `get_into`
jobs, gets a `JobHandle` back at once, and collects finished jobs with `poll()` once per step
(vLLM's secondary tiers and SGLang's cache controller work the same way). The ledger stays
free of I/O: the engine turns polled results into ledger calls.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvjax.kv_store.errors import StoreClosedError, WorkerFullError
from kvjax.kv_store.interface import KVStore, check_batch, check_keys


class JobKind(enum.Enum):
    LOOKUP = "lookup"
    PUT = "put"
    GET = "get"


@dataclasses.dataclass(frozen=True)
class JobHandle:
    """What `submit` returns: compare it with `JobResult.handle` to match a result to its job."""

    job_id: int
    kind: JobKind
    num_keys: int


@dataclasses.dataclass(frozen=True)
class JobResult:
    """A finished job. Exactly one of these holds:
    `error` is set (the store raised: no key of the job may be trusted), `cancelled` is True
    (closed before it ran: nothing was read or written), or the job ran: `hits` is the
    longest present prefix (lookup) and `ok[i]` says whether key i was written or read (put,
    get; a False get buffer holds undefined bytes)."""

    handle: JobHandle
    keys: tuple[str, ...]
    hits: int | None = None
    ok: tuple[bool, ...] | None = None
    error: BaseException | None = None
    cancelled: bool = False
    seconds: float = 0.0

    @property
    def succeeded(self) -> bool:
        """True when the job ran and every key is done (a lookup always counts as done)."""
        if self.error is not None or self.cancelled:
            return False
        return self.ok is None or all(self.ok)

    def ok_prefix(self) -> int:
        """Number of leading keys done: how many blocks of a chain are usable after a get."""
        if self.ok is None:
            return 0
        n = 0
        for x in self.ok:
            if not x:
                break
            n += 1
        return n


@dataclasses.dataclass
class _Job:
    handle: JobHandle
    keys: list[str]
    buffers: list[Any] | None


_STOP = object()


class StoreWorker:
    """A pool of `num_threads` threads running jobs on one `KVStore`.

    Back-pressure: at most `max_pending` jobs are in flight at once, counting a job from
    `submit` until `poll` returns its result; a submit beyond that raises `WorkerFullError`
    and queues nothing, so neither the queue nor the held buffers grow without bound.

    Buffers: a put or get job keeps references to its buffers until its result is polled.
    The caller must keep the host blocks behind them pinned (not reallocated, not
    overwritten) until then: a host block reused while its put is in flight would be stored
    with another block's bytes, and one reused during a get would be overwritten by the store
    (SGLang's partial restores when L2 evicts before the L3 backup finished).

    Jobs run in submission order per thread but complete in any order; `poll` returns them in
    completion order. `close()` stops the threads; the store itself stays open (its owner
    closes it).
    """

    def __init__(self, store: KVStore, *, num_threads: int = 2, max_pending: int = 64) -> None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        self.store = store
        self.max_pending = max_pending
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._done: queue.Queue[JobResult] = queue.Queue()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending = 0
        self._held: dict[int, list[Any]] = {}  # job id -> its buffers, until its result is polled
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kvjax-store-{i}", daemon=True) for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet returned by `poll` (queued, running or finished)."""
        return self._pending

    # ------------------------------------------------------------------ submit
    def _submit(self, kind: JobKind, keys: list[str], buffers: list[Any] | None) -> JobHandle:
        with self._lock:
            if self._closed:
                raise StoreClosedError("StoreWorker is closed")
            if self._pending >= self.max_pending:
                raise WorkerFullError(f"{self._pending} store jobs pending (max_pending={self.max_pending}); poll first")
            handle = JobHandle(next(self._ids), kind, len(keys))
            self._pending += 1
            if buffers is not None:
                self._held[handle.job_id] = buffers
            self._jobs.put(_Job(handle, keys, buffers))
        return handle

    def lookup(self, keys: Sequence[str]) -> JobHandle:
        """Find the longest present prefix of `keys` (`JobResult.hits`)."""
        return self._submit(JobKind.LOOKUP, check_keys(keys), None)

    def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> JobHandle:
        """Store the buffers' bytes; keep the buffers' host blocks pinned until polled."""
        ks, _ = check_batch(keys, buffers, writable=False)
        return self._submit(JobKind.PUT, ks, list(buffers))

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> JobHandle:
        """Fill the caller's writable buffers; read them only after the result is polled."""
        ks, _ = check_batch(keys, buffers, writable=True)
        return self._submit(JobKind.GET, ks, list(buffers))

    # ------------------------------------------------------------------ collect
    def poll(self, timeout: float = 0.0) -> list[JobResult]:
        """Finished jobs since the last poll; waits up to `timeout` seconds for the first one
        when none is ready (0: never blocks, what the engine step uses)."""
        out: list[JobResult] = []
        try:
            out.append(self._done.get(timeout=timeout) if timeout > 0 else self._done.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._pending -= len(out)
            for r in out:
                self._held.pop(r.handle.job_id, None)
        return out

    def wait(self, handles: Sequence[JobHandle], timeout: float) -> tuple[list[JobResult], list[JobResult]]:
        """Poll until every handle in `handles` has finished or `timeout` seconds passed;
        returns (results of `handles`, other results polled meanwhile). For tests and for a
        `wait_complete` prefetch; the engine step polls instead."""
        want = {h.job_id for h in handles}
        mine: list[JobResult] = []
        others: list[JobResult] = []
        deadline = time.monotonic() + timeout
        while want:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for r in self.poll(timeout=min(left, 0.05)):
                if r.handle.job_id in want:
                    want.discard(r.handle.job_id)
                    mine.append(r)
                else:
                    others.append(r)
        return mine, others

    # ------------------------------------------------------------------ threads
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            self._done.put(self._execute(job))

    def _execute(self, job: _Job) -> JobResult:
        t0 = time.perf_counter()
        keys = tuple(job.keys)
        try:
            if job.handle.kind is JobKind.LOOKUP:
                hits = self.store.batch_exists(job.keys)
                if isinstance(hits, bool) or not isinstance(hits, int) or not 0 <= hits <= len(keys):
                    raise TypeError(f"store batch_exists returned {hits!r} for {len(keys)} keys")
                return JobResult(job.handle, keys, hits=hits, seconds=time.perf_counter() - t0)
            assert job.buffers is not None
            if job.handle.kind is JobKind.PUT:
                ok = self.store.batch_put(job.keys, job.buffers)
            else:
                ok = self.store.batch_get_into(job.keys, job.buffers)
            if len(ok) != len(keys) or not all(isinstance(x, bool) for x in ok):
                raise TypeError(f"store returned {ok!r} for {len(keys)} keys (want one bool per key)")
            return JobResult(job.handle, keys, ok=tuple(ok), seconds=time.perf_counter() - t0)
        except Exception as e:  # reported to the poller, never lost in a thread
            return JobResult(job.handle, keys, error=e, seconds=time.perf_counter() - t0)
        finally:
            job.buffers = None  # `_held` keeps them until the result is polled

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting jobs, then either let the queued ones run (default) or cancel them
        (their results come back with `cancelled=True`, nothing read or written), and join
        the threads. Running jobs always finish. Results stay pollable after close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if cancel:
                while True:
                    try:
                        job = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    self._done.put(JobResult(job.handle, tuple(job.keys), cancelled=True))
            for _ in self._threads:
                self._jobs.put(_STOP)
        for t in self._threads:
            t.join(timeout)
