"""Publisher and subscriber over real ZeroMQ sockets on 127.0.0.1: the subscriber rebuilds the
ledger's cached blocks exactly, through a late join, a dropped message, a replay buffer too
short to fill a gap, a full send queue and a publisher restart."""
import queue
import time

import pytest
import zmq
from kv_helpers import RandomDriver, index_view, ledger_view, small_config

from kvjax import KVCacheManager
from kvjax.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    KVEventBatch,
    KVEventSubscriber,
    LedgerEventAdapter,
    ZmqEventPublisher,
    decode_batch,
    is_bind_endpoint,
)
from kvjax.router import PrefixIndex

ANY_PORT = "tcp://127.0.0.1:*"
TOPIC = "kv@r0"


def serve(led, pub, drv, steps):
    for _ in range(steps):
        drv.step()
        pub.publish_ledger_events(led.get_latest_events())
    assert pub.flush(5.0)


def drain(sub, index, want_seq, last=-1, timeout=5.0):
    """Poll until the batch numbered `want_seq` has been delivered (`last`: the newest one
    already applied); apply every batch, checking they come in order."""
    deadline = time.monotonic() + timeout
    while last < want_seq:
        assert time.monotonic() < deadline, f"no batch {want_seq} after {timeout} s (last {last}): {sub.stats()}"
        for seq, batch in sub.poll(0.05):
            assert seq == last + 1, (last, seq)
            index.apply("r0", batch)
            last = seq
    return last


def first_batches(sub, serve_one, timeout=5.0):
    """Keep the publisher busy until the subscriber receives something (a new SUB socket's
    subscription takes a moment to reach the publisher)."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"subscriber received nothing: {sub.stats()}"
        serve_one()
        got = sub.poll(0.1)
        if got:
            return got


@pytest.fixture
def replica():
    cfg = small_config(primary_blocks=16, secondary_blocks=8)
    led = KVCacheManager(cfg)
    pub = ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT, topic=TOPIC, data_parallel_rank=1,
                            adapter=LedgerEventAdapter(cfg))
    yield cfg, led, pub
    pub.close()


def test_endpoints_resolve_and_bind_rule():
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/x") and is_bind_endpoint("tcp://[::]:1")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")
    with ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        assert pub.replay_endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint != pub.endpoint
    with pytest.raises(ValueError, match="cannot open"):
        ZmqEventPublisher("tcp://127.0.0.1:notaport", bind=True)
    with pytest.raises(ValueError, match="buffer_steps"):
        ZmqEventPublisher(ANY_PORT, buffer_steps=0)


def test_late_subscriber_replays_from_the_start_and_matches_the_ledger(replica):
    cfg, led, pub = replica
    drv = RandomDriver(led, seed=5)
    serve(led, pub, drv, 60)  # published before anyone listens: lost on PUB, kept for replay
    sent = pub.published
    with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=TOPIC) as sub:
        index = PrefixIndex()
        got = first_batches(sub, lambda: serve(led, pub, drv, 1))
        assert [s for s, _ in got] == list(range(len(got)))
        for _, batch in got:
            index.apply("r0", batch)
        drain(sub, index, pub.published - 1, last=got[-1][0])
        assert index_view(index, "r0", 1) == ledger_view(led)
        assert sub.gaps == 1 and sub.replayed >= sent and sub.unrecovered_gaps == 0 and sub.missed_batches == 0
        assert all(b.data_parallel_rank == 1 for _, b in got)


def test_dropped_message_is_replayed(replica):
    cfg, led, pub = replica
    drv = RandomDriver(led, seed=6)
    with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=TOPIC) as sub:
        index = PrefixIndex()
        got = first_batches(sub, lambda: serve(led, pub, drv, 1))
        for _, batch in got:
            index.apply("r0", batch)
        last = drain(sub, index, pub.published - 1, last=got[-1][0])
        gaps = sub.gaps
        serve(led, pub, drv, 3)
        assert sub._sub.poll(5000)
        sub._sub.recv_multipart()  # the network loses this message
        serve(led, pub, drv, 30)
        drain(sub, index, pub.published - 1, last=last)
        assert sub.gaps == gaps + 1 and sub.unrecovered_gaps == 0
        assert index_view(index, "r0", 1) == ledger_view(led)
        assert pub.replays >= 1


def test_gap_older_than_the_replay_buffer_is_counted():
    cfg = small_config()
    led = KVCacheManager(cfg)
    lost = []
    with ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT, buffer_steps=3, adapter=LedgerEventAdapter(cfg)) as pub:
        drv = RandomDriver(led, seed=7)
        serve(led, pub, drv, 12)
        n = pub.published
        with KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, on_gap=lost.append) as sub:
            got = first_batches(sub, lambda: serve(led, pub, drv, 1))
            first_live = got[-1][0]
            # the buffer holds the last 3 batches, the live one included: 2 come back by replay
            assert sub.unrecovered_gaps == 1 and lost == [sub.missed_batches]
            assert sub.missed_batches == first_live - 2 >= n - 2
            assert [s for s, _ in got] == [first_live - 2, first_live - 1, first_live]


def test_without_replay_socket_a_gap_is_lost():
    with ZmqEventPublisher(ANY_PORT) as pub, KVEventSubscriber(pub.endpoint) as sub:
        got = first_batches(sub, lambda: pub.publish(KVEventBatch(1.0, [AllBlocksCleared()])))
        assert got[0][0] == sub.missed_batches and (sub.missed_batches == 0) == (sub.gaps == 0)


def test_replay_protocol_on_the_wire():
    """A bare DEALER speaks to the ROUTER socket exactly as vLLM's subscribers do."""
    with ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT, topic="t") as pub:
        for i in range(4):
            pub.publish(KVEventBatch(float(i), [AllBlocksCleared()]))
        assert pub.flush()
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", b"garbage"])  # malformed: ignored, the socket keeps serving
            dealer.send_multipart([b"", (2).to_bytes(8, "big")])
            frames = []
            while True:
                assert dealer.poll(5000)
                f = dealer.recv_multipart()
                frames.append(f)
                if f[3 - 1] == END_SEQ:
                    break
        finally:
            dealer.close()
            ctx.term()
        assert [f[:3] for f in frames] == [[b"", b"t", (2).to_bytes(8, "big")], [b"", b"t", (3).to_bytes(8, "big")],
                                           [b"", b"", END_SEQ]]
        assert frames[-1][3] == b""
        assert decode_batch(frames[0][3]).ts == 2.0 and pub.replays == 1


def test_full_send_queue_drops_and_clears(monkeypatch):
    with ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT) as pub, \
            KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
        warm = first_batches(sub, lambda: pub.publish(KVEventBatch(0.0, [])))
        drain(sub, PrefixIndex(), pub.published - 1, last=warm[-1][0])
        real_put = pub._queue.put_nowait
        calls = []

        def full_once(item):
            calls.append(item)
            if len(calls) == 1:
                raise queue.Full
            real_put(item)

        monkeypatch.setattr(pub._queue, "put_nowait", full_once)
        assert pub.publish(KVEventBatch(1.0, [])) is False and pub.dropped == 1
        assert pub.publish(KVEventBatch(2.0, [])) is True
        assert pub.flush()
        deadline = time.monotonic() + 5.0
        got = []
        while not got:
            assert time.monotonic() < deadline
            got = sub.poll(0.1)
        (seq, batch), = got
        assert seq == pub.published - 1 and batch.ts == 2.0 and batch.events == [AllBlocksCleared()]


def test_publisher_restart_is_detected_and_relearned():
    cfg = small_config()
    led = KVCacheManager(cfg)
    pub = ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT, adapter=LedgerEventAdapter(cfg))
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    index = PrefixIndex()
    restarts = []
    sub = KVEventSubscriber(endpoint, replay_endpoint=replay, on_restart=lambda: (restarts.append(1), index.clear_replica("r0")))
    try:
        drv = RandomDriver(led, seed=8)
        got = first_batches(sub, lambda: serve(led, pub, drv, 1))
        for _, b in got:
            index.apply("r0", b)
        serve(led, pub, drv, 30)
        drain(sub, index, pub.published - 1, last=got[-1][0])
        assert index_view(index, "r0", 1) == ledger_view(led) != {}
        pub.close()
        # the replica comes back on the same endpoints with an empty cache
        led2 = KVCacheManager(cfg)
        pub = ZmqEventPublisher(endpoint, replay_endpoint=replay, bind=True, adapter=LedgerEventAdapter(cfg))
        drv2 = RandomDriver(led2, seed=9)
        deadline = time.monotonic() + 10.0
        got = []
        while not got:
            assert time.monotonic() < deadline and pub.published < 25, "subscriber did not reconnect"
            serve(led2, pub, drv2, 1)
            got = sub.poll(0.1)
        for _, b in got:
            index.apply("r0", b)
        drain(sub, index, pub.published - 1, last=got[-1][0])
        assert restarts == [1] and sub.restarts == 1
        assert index_view(index, "r0", 1) == ledger_view(led2)
    finally:
        sub.close()
        pub.close()


def test_subscriber_thread_delivers_in_order():
    with ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT) as pub:
        seen = []
        sub = KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        sub.start(lambda seq, batch: seen.append((seq, batch.ts)))
        try:
            deadline = time.monotonic() + 5.0
            i = 0
            while len(seen) < 20:
                assert time.monotonic() < deadline
                pub.publish(KVEventBatch(float(i), []))
                i += 1
                time.sleep(0.005)
        finally:
            sub.close()
        assert [s for s, _ in seen] == list(range(len(seen))) and [t for _, t in seen] == [float(s) for s, _ in seen]
