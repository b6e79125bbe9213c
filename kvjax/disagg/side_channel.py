"""The ZeroMQ side channel between a producer and its consumers, messages as msgspec structs.

The producer binds a ROUTER socket served by one thread; each consumer thread talks through
its own DEALER socket (ZeroMQ sockets are not thread-safe). Every frame is an `Envelope`
carrying the protocol version, a sequence number (a reply that arrives after its request timed
out is recognised and dropped) and one tagged message. Every send and receive is bounded by a
timeout and every socket closes with linger 0, so nothing here can hang a caller.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec
import zmq

from kvjax.disagg.errors import PeerError, SideChannelError

PROTOCOL_VERSION = 1


class Msg(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Base of the side-channel messages; the tag is the class name."""


class Hello(Msg):
    engine_id: str
    geometry: dict[str, Any]
    digest: str


class HelloReply(Msg):
    engine_id: str
    transfer_address: str
    geometry: dict[str, Any]
    digest: str
    lease_seconds: float


class Describe(Msg):
    transfer_id: int


class OfferInfo(Msg):
    transfer_id: int
    request_id: str
    shapes: list[list[int]]
    dtypes: list[str]
    lease_left: float


class Heartbeat(Msg):
    transfer_ids: list[int]


class HeartbeatReply(Msg):
    alive: list[int]
    unknown: list[int]


class Pulled(Msg):
    transfer_id: int
    ok: bool
    error: str = ""


class Ack(Msg):
    transfer_id: int
    released: bool


class ErrorReply(Msg):
    code: str
    message: str
    detail: dict[str, Any] = {}


Message = Hello | HelloReply | Describe | OfferInfo | Heartbeat | HeartbeatReply | Pulled | Ack | ErrorReply


class Envelope(msgspec.Struct, array_like=True):
    v: int
    seq: int
    body: Message


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Envelope)
_context_lock = threading.Lock()


def _context() -> zmq.Context:
    with _context_lock:
        return zmq.Context.instance()


class SideChannelServer:
    """A ROUTER socket and the thread that answers it with `handler(message) -> reply`.

    `handler` runs on the server thread and must not block; an exception in it becomes an
    `ErrorReply("internal", ...)` so a consumer never waits for a reply that cannot come.
    `tick` (optional) runs on the same thread every `tick_interval` seconds (lease expiry).
    """

    def __init__(self, host: str, port: int, handler: Callable[[Msg], Msg], *,
                 tick: Callable[[], None] | None = None, tick_interval: float = 0.05, send_timeout: float = 1.0) -> None:
        self._handler = handler
        self._tick = tick
        self._tick_ms = max(1, int(tick_interval * 1000))
        self._sock = _context().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_timeout * 1000)))
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise SideChannelError(f"cannot bind the side channel on {host}:{port}: {e}") from None
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvjax-side-channel-{self.port}", daemon=True)
        self._thread.start()

    def _reply(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"":
            return  # not a DEALER-with-delimiter frame: nothing sensible to answer
        ident, payload = frames[0], frames[2]
        try:
            env = _DEC.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            out = Envelope(PROTOCOL_VERSION, -1, ErrorReply("malformed", str(e)))
        else:
            if env.v != PROTOCOL_VERSION:
                out = Envelope(PROTOCOL_VERSION, env.seq, ErrorReply(
                    "version", f"side-channel protocol {env.v} is not {PROTOCOL_VERSION}"))
            else:
                try:
                    reply = self._handler(env.body)
                except Exception as e:  # the consumer gets an answer whatever happened
                    reply = ErrorReply("internal", f"{type(e).__name__}: {e}")
                out = Envelope(PROTOCOL_VERSION, env.seq, cast(Message, reply))
        try:
            self._sock.send_multipart([ident, b"", _ENC.encode(out)])
        except zmq.ZMQError:
            pass  # the consumer is gone or slow; its own timeout reports it

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(self._tick_ms))
            except zmq.ZMQError:
                break
            if self._sock in ready:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.ZMQError:
                    frames = []
                if frames:
                    self._reply(frames)
            if self._tick is not None:
                self._tick()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (it notices within one tick) and close the socket."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._sock.close(0)


class SideChannelClient:
    """One DEALER socket to one producer, for one thread at a time; `request` is bounded."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.endpoint = f"tcp://{host}:{port}"
        self.timeout = timeout
        self._seq = 0
        self._sock = _context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        self._sock.connect(self.endpoint)

    def request(self, msg: Msg, timeout: float | None = None) -> Msg:
        """Send `msg` and return the reply; `SideChannelError` on timeout or a bad frame,
        `PeerError` when the peer answered with an `ErrorReply`."""
        limit = self.timeout if timeout is None else timeout
        self._seq += 1
        seq = self._seq
        try:
            self._sock.send_multipart([b"", _ENC.encode(Envelope(PROTOCOL_VERSION, seq, cast(Message, msg)))])
        except zmq.ZMQError as e:
            raise SideChannelError(f"side channel send to {self.endpoint} failed: {e}") from None
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, math.ceil(left * 1000)), zmq.POLLIN):
                raise SideChannelError(f"no side-channel reply from {self.endpoint} within {limit:.3g} s "
                                       f"to {type(msg).__name__}")
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 2 or frames[0] != b"":
                raise SideChannelError(f"malformed side-channel frame from {self.endpoint}")
            try:
                env = _DEC.decode(frames[1])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise SideChannelError(f"malformed side-channel reply from {self.endpoint}: {e}") from None
            if env.seq != seq and env.seq != -1:
                continue  # a late reply to an earlier request that timed out
            if isinstance(env.body, ErrorReply):
                raise PeerError(env.body.code, env.body.message, env.body.detail)
            return env.body

    def close(self) -> None:
        self._sock.close(0)
