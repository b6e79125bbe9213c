"""The side channel: bounded requests, versioned envelopes, malformed frames answered."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvjax.disagg.errors import PeerError, SideChannelError
from kvjax.disagg.side_channel import (
    PROTOCOL_VERSION,
    Ack,
    Describe,
    Envelope,
    ErrorReply,
    Heartbeat,
    HeartbeatReply,
    SideChannelClient,
    SideChannelServer,
)


@pytest.fixture
def echo():
    def handler(msg):
        if isinstance(msg, Heartbeat):
            return HeartbeatReply(alive=msg.transfer_ids, unknown=[])
        if isinstance(msg, Describe) and msg.transfer_id == 0:
            raise RuntimeError("boom")
        return ErrorReply("unexpected", type(msg).__name__)

    srv = SideChannelServer("127.0.0.1", 0, handler)
    yield srv
    srv.close()


def test_request_reply_and_errors(echo):
    c = SideChannelClient("127.0.0.1", echo.port, 2.0)
    try:
        assert c.request(Heartbeat(transfer_ids=[1, 2])) == HeartbeatReply(alive=[1, 2], unknown=[])
        with pytest.raises(PeerError, match="internal: RuntimeError: boom"):
            c.request(Describe(transfer_id=0))
        with pytest.raises(PeerError) as e:
            c.request(Ack(transfer_id=1, released=True))
        assert e.value.code == "unexpected"
    finally:
        c.close()


def test_no_peer_times_out():
    ctx = zmq.Context.instance()
    probe = ctx.socket(zmq.ROUTER)  # a bound socket that never answers
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    c = SideChannelClient("127.0.0.1", port, 0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(SideChannelError, match="no side-channel reply"):
            c.request(Heartbeat(transfer_ids=[1]))
        assert 0.3 <= time.monotonic() - t0 < 2.0
    finally:
        c.close()
        probe.close(0)


def test_wrong_version_and_garbage_are_answered(echo):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{echo.port}")
    dec = msgspec.msgpack.Decoder(Envelope)
    try:
        sock.send_multipart([b"", msgspec.msgpack.encode(Envelope(PROTOCOL_VERSION + 1, 7, Heartbeat(transfer_ids=[])))])
        assert sock.poll(2000)
        env = dec.decode(sock.recv_multipart()[1])
        assert env.seq == 7 and isinstance(env.body, ErrorReply) and env.body.code == "version"
        sock.send_multipart([b"", b"\x93not an envelope"])
        assert sock.poll(2000)
        env = dec.decode(sock.recv_multipart()[1])
        assert isinstance(env.body, ErrorReply) and env.body.code == "malformed"
    finally:
        sock.close(0)


def test_late_replies_are_dropped(echo):
    """A reply that arrives after its request timed out is not taken for the next one's."""
    slow = {"n": 0}

    def handler(msg):
        slow["n"] += 1
        if slow["n"] == 1:
            time.sleep(0.4)
        return HeartbeatReply(alive=list(msg.transfer_ids), unknown=[])

    srv = SideChannelServer("127.0.0.1", 0, handler)
    c = SideChannelClient("127.0.0.1", srv.port, 0.2)
    try:
        with pytest.raises(SideChannelError):
            c.request(Heartbeat(transfer_ids=[1]))
        assert c.request(Heartbeat(transfer_ids=[2]), timeout=2.0) == HeartbeatReply(alive=[2], unknown=[])
    finally:
        c.close()
        srv.close()
