"""`KVEventSubscriber`: one publisher's KV-event stream, in order, gaps replayed.

SUB receives `[topic, seq, payload]`. The subscriber expects consecutive sequence numbers; when
one jumps it asks the publisher's ROUTER replay socket (through a DEALER) for the batches from
the first missing one, delivers the missing ones in order, then the batch that revealed the gap.
Batches the publisher no longer buffers (or a publisher without a replay socket) are counted
and logged as an unrecovered gap. A subscriber that joins late replays from 0, so it can
rebuild a publisher's whole state while the replay buffer still holds it.

A sequence number that goes *backwards* means the publisher restarted (a new process counts
from 0 again): `restarts` is counted, `on_restart` is called (a router forgets that replica's
blocks), and the new stream is read from its start. `on_gap(lost)` is called after a gap that
replay could not fill (a router may then distrust what it knows of that replica).

A subscriber learns nothing from SUB until the publisher sends again, which an idle replica
may not do for a long time: `catch_up()` (run first by `start` when there is a replay socket)
asks for every buffered batch at once. Batches that SUB had queued meanwhile arrive again
afterwards; they are recognised by their sequence number and payload and dropped.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from kvjax.kv_events.publisher import END_SEQ, seq_bytes
from kvjax.kv_events.wire import KVEventBatch, WireFormatError, decode_batch

log = logging.getLogger(__name__)


class KVEventSubscriber:
    """Read one publisher. `poll(timeout)` returns `[(seq, batch), ...]` in order; `start(callback)`
    runs the same loop on a thread and calls `callback(seq, batch)` for each batch."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        name: str = "",
        on_restart: Callable[[], None] | None = None,
        on_gap: Callable[[int], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.name = name or endpoint
        self.replay_timeout_s = replay_timeout_s
        self.on_restart = on_restart
        self.on_gap = on_gap
        self._topic = topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._dealer = None
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot connect a KV-event subscriber to {endpoint!r}: {e}") from None
        self._next: int | None = None  # the sequence number expected next
        self._caught_up: dict[int, int] = {}  # seq -> payload hash of batches delivered by catch_up
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.received = 0  # batches delivered (live or replayed)
        self.replayed = 0  # of which came from replay
        self.gaps = 0  # sequence jumps seen
        self.unrecovered_gaps = 0  # jumps replay could not fill completely
        self.missed_batches = 0  # batches lost for good
        self.restarts = 0
        self.decode_errors = 0

    # ------------------------------------------------------------------ reading
    def poll(self, timeout: float = 0.0) -> list[tuple[int, KVEventBatch]]:
        """Everything available now (waiting up to `timeout` seconds for the first message)."""
        out: list[tuple[int, KVEventBatch]] = []
        wait_ms = int(timeout * 1000)
        while self._sub.poll(wait_ms):
            wait_ms = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                log.warning("%s: ignoring a malformed KV-event message (%d frames)", self.name, len(frames))
                continue
            self._accept(int.from_bytes(frames[1], "big"), frames[2], out)
        return out

    def catch_up(self) -> list[tuple[int, KVEventBatch]]:
        """Every batch the publisher's replay buffer holds from the next expected one on, in
        order (nothing without a replay socket or if the publisher does not answer in time).
        Call it from the thread that polls."""
        out: list[tuple[int, KVEventBatch]] = []
        if self.replay_endpoint is None:
            return out
        expected = 0 if self._next is None else self._next
        lost = 0
        for s, payload in self._request_replay(expected):
            if s < expected:
                continue
            lost += s - expected  # gone from the publisher's buffer before we asked
            self._deliver(s, payload, out, replayed=True)
            self._caught_up[s] = hash(payload)
            expected = s + 1
        if lost:
            self.gaps += 1
            self.unrecovered_gaps += 1
            self.missed_batches += lost
            log.warning("%s: %d KV-event batch(es) lost before catching up (not in the publisher's replay buffer)",
                        self.name, lost)
            if self.on_gap is not None:
                self.on_gap(lost)
        return out

    def _accept(self, seq: int, payload: bytes, out: list) -> None:
        nxt = self._next
        if self._caught_up:
            if nxt is not None and seq < nxt and self._caught_up.get(seq) == hash(payload):
                del self._caught_up[seq]
                return  # queued on SUB while catch_up replayed it
            self._caught_up.clear()  # SUB delivers in order: nothing older can follow
        if nxt is not None and seq < nxt:
            self.restarts += 1
            log.warning("%s: KV-event sequence went back from %d to %d: publisher restarted", self.name, nxt - 1, seq)
            if self.on_restart is not None:
                self.on_restart()
            nxt = None
        start = 0 if nxt is None else nxt
        if seq > start:
            self._recover(start, seq, out)
        self._deliver(seq, payload, out, replayed=False)

    def _deliver(self, seq: int, payload: bytes, out: list, replayed: bool) -> None:
        self._next = seq + 1
        try:
            batch = decode_batch(payload)
        except WireFormatError as e:
            self.decode_errors += 1
            log.warning("%s: undecodable KV-event batch %d: %s", self.name, seq, e)
            return
        self.received += 1
        self.replayed += replayed
        out.append((seq, batch))

    def _recover(self, start: int, stop: int, out: list) -> None:
        """Deliver batches [start, stop) from the replay socket; count what it cannot give."""
        self.gaps += 1
        expected, lost = start, 0
        if self.replay_endpoint is not None:
            for s, payload in self._request_replay(start):
                if s < expected or s >= stop:
                    continue  # already delivered, or SUB will deliver it
                lost += s - expected  # older than the publisher's buffer
                self._deliver(s, payload, out, replayed=True)
                expected = s + 1
        lost += stop - expected
        if lost:
            self.unrecovered_gaps += 1
            self.missed_batches += lost
            self._next = stop
            log.warning("%s: %d KV-event batch(es) in [%d, %d) lost (not in the publisher's replay buffer)",
                        self.name, lost, start, stop)
            if self.on_gap is not None:
                self.on_gap(lost)

    def _request_replay(self, start: int) -> list[tuple[int, bytes]]:
        """The publisher's buffered batches from `start` ([] on timeout: the socket is reset so
        a late answer cannot be mistaken for the next one)."""
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.replay_endpoint)
        dealer = self._dealer
        dealer.send_multipart((b"", seq_bytes(start)))
        deadline = time.monotonic() + self.replay_timeout_s
        got: list[tuple[int, bytes]] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not dealer.poll(int(remaining * 1000) + 1):
                log.warning("%s: KV-event replay request timed out after %.1f s", self.name, self.replay_timeout_s)
                dealer.close(linger=0)
                self._dealer = None
                return got
            frames = dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:  # [topic, seq, payload]
                frames = frames[1:]
            if len(frames) != 2 or len(frames[0]) != 8:
                log.warning("%s: malformed KV-event replay frame (%d parts)", self.name, len(frames))
                continue
            if frames[0] == END_SEQ:
                return got
            got.append((int.from_bytes(frames[0], "big"), frames[1]))

    # ------------------------------------------------------------------ background thread
    def start(self, callback: Callable[[int, KVEventBatch], None], poll_interval_s: float = 0.05,
              catch_up: bool = True) -> None:
        """Read on a daemon thread, calling `callback(seq, batch)` for each batch in order;
        with `catch_up` (and a replay socket) the thread first replays what the publisher buffers."""
        if self._thread is not None:
            raise RuntimeError("subscriber already started")

        def deliver(batches) -> None:
            for seq, batch in batches:
                try:
                    callback(seq, batch)
                except Exception:
                    log.exception("%s: KV-event callback failed on batch %d", self.name, seq)

        def loop() -> None:
            if catch_up:
                deliver(self.catch_up())
            while not self._stop.is_set():
                deliver(self.poll(poll_interval_s))

        self._thread = threading.Thread(target=loop, name=f"kvjax-kv-sub-{self.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
            if self._thread.is_alive():
                log.warning("%s: subscriber thread did not stop", self.name)
                return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._sub, self._dealer):
            if s is not None:
                s.close(linger=0)
        self._dealer = None
        self._ctx.term()

    def __enter__(self) -> "KVEventSubscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in
                ("received", "replayed", "gaps", "unrecovered_gaps", "missed_batches", "restarts", "decode_errors")}
