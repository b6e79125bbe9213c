"""`EngineLoop`: the server's engine thread, the only code that touches the engine and ledger.

HTTP handlers talk to it through a command queue (`submit`, `abort`, `reset_prefix_cache`) and
read each request's `OutputStream`, which the engine thread fills with the request's latest
cumulative `RequestOutput` (one slot per request, so a slow client holds one output, not a
backlog). The thread steps the engine while requests are unfinished and blocks on the command
queue when idle.

Admission control: at most `max_pending` requests are in the server at once (queued or
running); `submit` beyond that raises `QueueFull` (HTTP 429), so memory is bounded by that
number and the pools. `drain` stops accepting (`ShuttingDown`, HTTP 503), lets in-flight
requests finish for up to a timeout and aborts the rest (their streams end normally, with
finish reason "abort"); `shutdown` drains, stops the thread, closes the engine (its KV-event
publisher) and checks that the ledger is empty and consistent.

Isolation: a failure that belongs to one request fails that request alone, with `RequestFailed`
on its stream: its output could not be made (`LLMEngine.step` ends it with finish reason
"error"), or handing its output over raised. The request leaves the engine like an abort (its
blocks freed), the others keep running, and the ledger's integrity is checked at once. Any
other error in the engine thread (the batched step itself, a broken ledger) cannot be pinned
on a request: every in-flight request fails with `EngineFailed`, the loop takes nothing more,
and `on_death` is called so that the server exits and a supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kvjax.engine.llm_engine import LLMEngine
from kvjax.engine.outputs import RequestOutput
from kvjax.engine.sampling import SamplingParams
from kvjax.errors import KVCacheError

log = logging.getLogger("kvjax.server")


class QueueFull(KVCacheError):
    """The server holds `max_pending` requests already."""


class ShuttingDown(KVCacheError):
    """The server is shutting down (or its engine stopped) and takes no new request."""


class RequestFailed(KVCacheError, RuntimeError):
    """This request failed inside the server (an internal error); the others were not affected."""


class EngineFailed(KVCacheError, RuntimeError):
    """The engine thread died with this request in flight (an error no single request explains)."""


class OutputStream:
    """One request's outputs, handed from the engine thread to an asyncio handler."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.arrival = time.perf_counter()
        self.last_token_time: float | None = None  # engine thread only
        self.tokens_seen = 0  # engine thread only
        self._event = asyncio.Event()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self.finished = False

    # engine thread -> event loop
    def _deliver(self, output: RequestOutput | None, error: BaseException | None) -> None:
        def put():
            if error is not None:
                self._error = error
            else:
                self._latest = output
            self._event.set()

        try:
            self.loop.call_soon_threadsafe(put)
        except RuntimeError:  # the handler's loop is closed: nobody is listening
            pass

    # event loop side
    async def next(self) -> RequestOutput:
        """The latest output (waits for a new one); raises the engine's error for this request."""
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            raise self._error
        out = self._latest
        assert out is not None  # the event is set only after an output (or an error) arrived
        if out.finished:
            self.finished = True
        return out

    async def outputs(self):
        while not self.finished:
            yield await self.next()


class EngineLoop:
    def __init__(self, engine: LLMEngine, *, max_pending: int, metrics=None, stats=None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        """`stats` logs the periodic stats line; `on_death(error)` is called on the engine thread
        once it died of `error` (every in-flight request was failed first)."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.engine = engine
        self.metrics = metrics
        self.stats = stats  # a `StatsLogger` (log lines), or None
        self.max_pending = max_pending
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._pending = 0  # requests submitted and not finished (guarded by _lock)
        self._accepting = True
        self.error: BaseException | None = None
        self.on_death = on_death
        self._thread = threading.Thread(target=self._run, name="kvjax-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    @property
    def accepting(self) -> bool:
        with self._lock:
            return self._accepting and self.error is None

    def submit(self, request_id: str, prompt: str | None, prompt_ids: Sequence[int], params: SamplingParams,
               loop: asyncio.AbstractEventLoop, *, kv_transfer_params: dict | None = None) -> OutputStream:
        """Hand a checked request to the engine thread; its outputs arrive on the returned stream."""
        with self._lock:
            if not self._accepting or self.error is not None:
                raise ShuttingDown("the server is shutting down")
            if self._pending >= self.max_pending:
                raise QueueFull(f"the server is at its limit of {self.max_pending} requests; retry later")
            self._pending += 1
        stream = OutputStream(request_id, loop)
        self._commands.put(("add", stream, prompt, list(prompt_ids), params, kv_transfer_params))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; a finished one is left alone)."""
        self._commands.put(("abort", request_id))

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Reset the prefix cache between two steps; the future fails with `EngineBusyError`
        while requests run."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:  # nobody would answer
            fut.set_exception(ShuttingDown("the engine is not running"))
            return fut
        self._commands.put(("reset", fut))
        return fut

    def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.pending and self._thread.is_alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def drain(self, timeout: float = 10.0) -> None:
        """Stop taking requests; give in-flight ones `timeout` seconds to finish, then abort
        the rest (each stream gets a final output with finish reason "abort")."""
        with self._lock:
            self._accepting = False
        if not self._wait_idle(timeout):
            self._commands.put(("abort_all", None))
            self._wait_idle(10.0)

    def shutdown(self, timeout: float = 10.0) -> None:
        """`drain`, stop the thread, check the ledger (errors are logged, never raised)."""
        if self._thread.is_alive():
            self.drain(timeout)
        self._commands.put(("stop", None))
        if self._thread.ident is not None:
            self._thread.join(timeout=30.0)
        if self._thread.is_alive():
            log.error("the engine thread did not stop")
            return
        try:
            self.engine.close()  # stops publishing KV events, if the engine does
        except Exception:
            log.exception("closing the engine failed")
        try:
            self.engine.core.verify_idle()
            log.info("engine stopped: ledger empty, integrity holds")
        except Exception as e:  # a bug: report it, shutdown goes on
            log.error("ledger check at shutdown failed: %s", e)
            self.error = self.error or e

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                idle = not eng.has_unfinished_requests()
                if not self._drain(block=idle):
                    break
                elif (remote := getattr(getattr(eng, "core", None), "remote_kv", None)) is not None:
                    remote.poll([])  # idle: offers still end (unpinned) between requests
                if eng.has_unfinished_requests():
                    outputs = eng.step()
                    now = time.perf_counter()
                    failed = False
                    for out in outputs:
                        failed |= not self._deliver_isolated(out, now)
                    if failed:  # the failed requests left the ledger: the rest of it must hold
                        eng.core.ledger.verify_integrity()
                if self.metrics is not None:
                    self.metrics.publish(eng.core)
                if self.stats is not None:
                    self.stats.step(eng.core, time.perf_counter())
        except BaseException as e:  # no request explains it: fail them all, take no new ones, die
            log.critical("the engine thread died (%s: %s); failing %d in-flight request(s)", type(e).__name__, e,
                         len(self._streams), exc_info=e)
            self.error = e
            with self._lock:
                self._accepting = False
            for stream in list(self._streams.values()):
                stream._deliver(None, EngineFailed(f"the engine failed ({type(e).__name__}); the server restarts"))
            self._streams.clear()
            with self._lock:
                self._pending = 0
        finally:
            try:
                self._abort_all()
            except Exception:  # the engine is broken; its streams were failed above
                log.exception("aborting requests at engine stop failed")
        if self.error is not None and self.on_death is not None:
            try:
                self.on_death(self.error)
            except Exception:
                log.exception("the engine's on_death hook failed")

    def _deliver_isolated(self, out: RequestOutput, now: float) -> bool:
        """Hand one output over; False if its request failed (it alone is ended)."""
        rid = out.request_id
        error: Exception | None = None
        if out.finished and out.outputs[0].finish_reason == "error":  # LLMEngine ended it (and logged why)
            why = out.outputs[0].stop_reason  # a failed KV pull says why (kvjax.engine.remote_kv); else a bug
            error = RequestFailed(f"the prompt's KV could not be pulled from the prefill engine "
                                  f"(kv_load_failure_policy=fail): {why}" if isinstance(why, str) else
                                  "this request failed inside the server (an internal error, logged)")
        else:
            try:
                self._deliver(out, now)
                return True
            except Exception as e:
                log.exception("handing over the output of request %s failed", rid)
                error = RequestFailed(f"this request failed inside the server ({type(e).__name__}, logged)")
                self.engine.abort_request(rid)  # blocks freed; None if it had finished
        stream = self._streams.pop(rid, None)
        if stream is not None:
            self._release()
            stream._deliver(None, error)
            if self.metrics is not None:
                self.metrics.request_finished("error", now - stream.arrival)
        return False

    def _drain(self, block: bool) -> bool:
        """Run queued commands (waiting for one when `block`). False once told to stop."""
        while True:
            try:
                cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            kind, *args = cmd
            if kind == "add":
                self._add(*args)
            elif kind == "abort":
                out = self.engine.abort_request(args[0])
                if out is not None:
                    self._deliver(out, time.perf_counter())
            elif kind == "reset":
                fut = args[0]
                try:
                    fut.set_result(self.engine.reset_prefix_cache())
                    if self.metrics is not None:
                        self.metrics.resets.labels(self.metrics.model_name).inc()
                except Exception as e:
                    fut.set_exception(e)
            elif kind == "abort_all":
                self._abort_live()
            elif kind == "stop":
                self._abort_all()
                return False

    def _add(self, stream: OutputStream, prompt, prompt_ids, params, kv_transfer_params=None) -> None:
        try:
            extra = {} if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
            self.engine.add_request(stream.request_id, prompt if prompt is not None else prompt_ids, params,
                                    prompt_token_ids=prompt_ids, **extra)
        except Exception as e:  # checked by the handler already; a race or a bug ends up here
            self._release()
            stream._deliver(None, e)
            return
        self._streams[stream.request_id] = stream
        if self.stats is not None:
            self.stats.request_added(stream.request_id, len(prompt_ids), params.max_tokens, stream.arrival)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        n = len(out.outputs[0].token_ids)
        if self.metrics is not None and n:
            last = stream.last_token_time
            first = last is None
            since = now - (stream.arrival if last is None else last)
            new = n - stream.tokens_seen
            if new > 0:
                self.metrics.request_tokens(first, since, new)
                stream.last_token_time = now
        stream.tokens_seen = n
        if self.stats is not None:
            self.stats.request_output(out, now)
        stream._deliver(out, None)
        if out.finished:
            del self._streams[out.request_id]
            self._release()
            if self.metrics is not None:
                self.metrics.request_finished(out.outputs[0].finish_reason or "abort", now - stream.arrival)

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def _abort_live(self) -> None:
        for rid in list(self._streams):
            out = self.engine.abort_request(rid)
            if out is not None:
                self._deliver(out, time.perf_counter())

    def _abort_all(self) -> None:
        """Abort every live request and refuse the requests still queued as commands."""
        self._abort_live()
        while True:
            try:
                kind, *args = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._release()
                args[0]._deliver(None, ShuttingDown("the server is shutting down"))
            elif kind == "reset":
                args[0].set_exception(ShuttingDown("the server is shutting down"))
