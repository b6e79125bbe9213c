"""`ZmqEventPublisher`: KV-event batches on a ZeroMQ PUB socket, missed ones replayed on ROUTER.

The protocol is vLLM's:

- PUB sends each batch as the multipart message `[topic, seq, payload]`: `seq` counts batches
  from 0 as an 8-byte big-endian unsigned int, `payload` is `encode_batch(batch)`.
- ROUTER (optional) answers a request `[client id, b"", start seq (8 bytes big-endian)]` with
  `[client id, b"", topic, seq, payload]` for every buffered batch whose seq >= start, then the
  end marker `[client id, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]`. The last
  `buffer_steps` batches are kept for this.

Sends happen on the publisher's own thread, fed by a bounded queue, so the serving loop never
waits on the network. If the queue is full a batch is dropped (and counted); the next batch
that gets through starts with `AllBlocksCleared`, so subscribers forget what they can no
longer trust instead of keeping hashes whose removal they never saw.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Iterable

import zmq

from kvjax.kv_events.adapter import LedgerEventAdapter
from kvjax.kv_events.wire import AllBlocksCleared, KVEventBatch, encode_batch
from kvjax.ledger.events import KVCacheEvent

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's convention: wildcard hosts / ports and ipc / inproc endpoints are bound, any other
    address is connected to ("bind stable, connect volatile")."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publish `KVEventBatch`es (or a ledger's raw events, through a `LedgerEventAdapter`).

    `endpoint` is bound or connected per `bind` (None: vLLM's convention, see
    `is_bind_endpoint`); `replay_endpoint` is always bound. `endpoint` / `replay_endpoint`
    attributes hold the resolved addresses (a `*` port becomes the port the OS picked).
    """

    SHUTDOWN_TIMEOUT_S = 2.0

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        max_queue_size: int = 10_000,
        hwm: int = 100_000,
        bind: bool | None = None,
        adapter: LedgerEventAdapter | None = None,
    ) -> None:
        for name, v in (("buffer_steps", buffer_steps), ("max_queue_size", max_queue_size), ("hwm", hwm)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int) or data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}")
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self.adapter = adapter
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()  # publish() may be called from several threads
        self._clear_next = False
        self._closed = False
        self.published = 0  # batches sent on PUB
        self.dropped = 0  # batches dropped because the send queue was full
        self.replays = 0  # replay requests answered
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if is_bind_endpoint(endpoint) if bind is None else bind:
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot open KV-event sockets ({endpoint!r}, replay {replay_endpoint!r}): {e}") from None
        self._thread = threading.Thread(target=self._run, name="kvjax-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    def publish(self, batch: KVEventBatch) -> bool:
        """Queue one batch (its `data_parallel_rank` is filled in if None). Returns False if the
        queue was full and the batch was dropped."""
        if not isinstance(batch, KVEventBatch):
            raise TypeError(f"expected a KVEventBatch, got {type(batch).__name__}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the KV-event publisher is closed")
            if batch.data_parallel_rank is None:
                batch.data_parallel_rank = self.data_parallel_rank
            if self._clear_next:
                batch = KVEventBatch(batch.ts, [AllBlocksCleared(), *batch.events], batch.data_parallel_rank)
            try:
                self._queue.put_nowait(batch)
            except queue.Full:
                self.dropped += 1
                self._clear_next = True
                log.warning("KV-event send queue full (%d batches): batch dropped, the next one clears "
                            "subscribers' state", self._queue.maxsize)
                return False
            self._clear_next = False
            return True

    def publish_ledger_events(self, events: Iterable[KVCacheEvent]) -> bool:
        """Convert a ledger's events (`KVCacheManager.get_latest_events()`) and queue the batch.
        Returns True if there was nothing to send or the batch was queued."""
        if self.adapter is None:
            raise RuntimeError("publish_ledger_events needs a publisher built with adapter=LedgerEventAdapter(...)")
        batch = self.adapter.convert(events)
        return True if batch is None else self.publish(batch)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch has been sent (True) or `timeout` seconds passed."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        """Send what is queued (for up to SHUTDOWN_TIMEOUT_S), stop the thread, close the sockets."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put(_STOP, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            log.warning("KV-event publisher closing with %d batches unsent", self._queue.qsize())
        self._stop_now = True
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("KV-event publisher thread did not stop within %.1f s", self.SHUTDOWN_TIMEOUT_S)
            return  # its sockets are still in use: leave them to the daemon thread
        self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the sending thread
    _stop_now = False

    def _run(self) -> None:
        seq = 0
        wait = 0.005 if self._replay is not None else 0.1
        while True:
            if self._replay is not None:
                try:
                    self._serve_replays()
                except Exception:  # a replay failure must not stop live publishing
                    log.exception("KV-event publisher failed to serve a replay request")
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                if self._stop_now:
                    break
                continue
            try:
                if item is _STOP:
                    break
                payload = encode_batch(item)
                header = seq_bytes(seq)
                self._pub.send_multipart((self._topic, header, payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.published += 1
            except Exception:  # a failed send must not kill the thread: log, keep serving
                log.exception("KV-event publisher failed to send batch %d", seq)
            finally:
                self._queue.task_done()
        if self._replay is not None:
            self._serve_replays()

    def _serve_replays(self) -> None:
        sock = self._replay
        assert sock is not None  # only called when the replay socket is bound
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replays += 1  # counted before the answer, so a client that has it sees the count
            for s, payload in list(self._buffer):
                if s >= start_seq:
                    sock.send_multipart((client, b"", self._topic, seq_bytes(s), payload))
            sock.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()
