"""Producer and consumer in one process: leases, heartbeats, exactly-once release, deadlines,
bounds, refusals, gathering blocks from KVPools and pulling into another sharding."""
from __future__ import annotations

import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from disagg_helpers import cache_config, geometry, host_arrays, transfer_config
from jax.experimental import transfer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.device.pools import allocate_pools
from kvjax.disagg import (
    CapacityError,
    GeometryMismatchError,
    KVConsumer,
    KVProducer,
    PeerError,
    PullTimeoutError,
    RoleError,
    TransferConfigError,
    gather_blocks,
    scatter_blocks,
)
from kvjax.disagg.consumer import wait_ready
from kvjax.errors import DuplicateRequestError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def server():
    """One transfer server shared by the consumers of this module (cheaper than one per test)."""
    return transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])


@pytest.fixture(scope="module")
def pserver():
    return transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])


class Side:
    def __init__(self, pserver, cserver, clock=time.monotonic, **extra) -> None:
        self.released: list[tuple[str, str]] = []
        self.producer = KVProducer(transfer_config("kv_producer", **extra), geometry(),
                                   on_release=lambda r, why: self.released.append((r, why)),
                                   transfer_server=pserver, clock=clock)
        self.consumer = KVConsumer(transfer_config("kv_consumer", **extra), geometry(), transfer_server=cserver)

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()


@pytest.fixture
def side(pserver, server):
    s = Side(pserver, server)
    yield s
    s.close()


@pytest.fixture
def clocked(pserver, server):
    clock = Clock()
    s = Side(pserver, server, clock)
    s.clock = clock  # type: ignore[attr-defined]
    yield s
    s.close()


def _arrays(seed=0):
    shapes, dtypes = [(2, 3, 4), (5,)], [jnp.float32, jnp.int32]
    return [jnp.asarray(a) for a in host_arrays(seed, shapes, dtypes)]


def _specs(arrays, sharding=None):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in arrays]


ONE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _one(consumer, limit=10.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        out = consumer.poll()
        if out:
            assert len(out) == 1
            return out[0]
        time.sleep(0.005)
    raise AssertionError("no result")


def _steal(pserver, params, arrays):
    """Pull an offer behind the producer's back, so its id is gone from the transfer server."""
    out = pserver.connect(pserver.address()).pull(params.transfer_id, _specs(arrays, ONE))
    jax.block_until_ready(out)


def test_pull_in_process_is_exact_and_releases_once(side):
    arrays = _arrays(1)
    params = side.producer.offer("r", arrays, block_ids=[0, 1], num_tokens=8)
    side.consumer.start_pull("d", params.to_dict(), _specs(arrays))
    res = _one(side.consumer)
    assert res.status == "ok", res.value
    chex.assert_trees_all_equal(tuple(res.value), tuple(arrays))
    end = time.monotonic() + 5
    while not side.released and time.monotonic() < end:
        side.producer.poll()
        time.sleep(0.005)
    assert side.released == [("r", "pulled")]
    assert side.producer.poll() == [] and side.released == [("r", "pulled")]
    assert side.consumer.poll() == [] and side.consumer.live_threads == 0


def test_lease_expiry_releases_once_and_the_offer_is_gone(clocked):
    arrays = _arrays(2)
    params = clocked.producer.offer("r", arrays)
    clocked.clock.t += 9.9
    assert clocked.producer.poll() == []
    clocked.clock.t += 0.2
    assert clocked.producer.poll() == [("r", "expired")]
    assert clocked.producer.poll() == [] and clocked.released == [("r", "expired")]
    assert clocked.producer.live_offers == 0 and clocked.producer.abort("r") is False
    assert clocked.consumer.heartbeat(params) is False
    clocked.consumer.start_pull("d", params, _specs(arrays))
    res = _one(clocked.consumer)
    assert res.status == "failed" and isinstance(res.value, PeerError) and res.value.code == "unknown_transfer"


def test_heartbeats_extend_the_lease(clocked):
    params = clocked.producer.offer("r", _arrays(3))
    for _ in range(3):  # 3 x 8 s > one 10 s lease
        clocked.clock.t += 8.0
        assert clocked.consumer.heartbeat(params) is True
        assert clocked.producer.lease_left("r") == pytest.approx(10.0)
        assert clocked.producer.poll() == []
    clocked.clock.t += 10.0
    assert clocked.producer.poll() == [("r", "expired")]
    assert clocked.released == [("r", "expired")]


def test_abort_and_close_release_once(side):
    side.producer.offer("a", _arrays(4))
    side.producer.offer("b", _arrays(5))
    assert side.producer.abort("a") is True and side.producer.abort("a") is False
    assert side.producer.poll() == [("a", "aborted")]
    side.producer.close()
    assert side.released == [("a", "aborted"), ("b", "closed")]
    with pytest.raises(RoleError):
        side.producer.offer("c", _arrays(6))


def test_offer_bounds_and_bad_input_leave_state_unchanged(pserver, server):
    s = Side(pserver, server, max_offers=2)
    try:
        s.producer.offer("a", _arrays())
        with pytest.raises(DuplicateRequestError):
            s.producer.offer("a", _arrays())
        s.producer.offer("b", _arrays())
        with pytest.raises(CapacityError):
            s.producer.offer("c", _arrays())
        for bad in ([], [np.zeros(3)], jnp.zeros(3)):
            with pytest.raises(TransferConfigError):
                s.producer.offer("d", bad)
        assert s.producer.live_offers == 2 and s.released == []
        with pytest.raises(RoleError):
            KVProducer(transfer_config("kv_consumer"), geometry(), on_release=print, transfer_server=pserver)
        with pytest.raises(RoleError):
            KVConsumer(transfer_config("kv_producer"), geometry(), transfer_server=server)
    finally:
        s.close()


def test_geometry_mismatch_is_refused_naming_fields(pserver, server, side):
    arrays = _arrays(7)
    params = side.producer.offer("r", arrays)
    other = KVConsumer(transfer_config("kv_consumer"), geometry(head_dim=16), transfer_server=server)
    try:
        with pytest.raises(GeometryMismatchError, match="head_dim_per_layer") as e:
            other.handshake(params)
        assert set(e.value.fields) == {"head_dim_per_layer", "pools"}
        other.start_pull("d", params, _specs(arrays))
        res = _one(other)
        assert res.status == "failed" and isinstance(res.value, GeometryMismatchError)
    finally:
        other.close()
    assert side.producer.live_offers == 1  # a refused consumer never touched the offer


def test_shape_mismatch_is_refused_before_pulling(side):
    arrays = _arrays(8)
    params = side.producer.offer("r", arrays)
    side.consumer.start_pull("d", params, [jax.ShapeDtypeStruct((2, 3, 5), jnp.float32), _specs(arrays)[1]])
    res = _one(side.consumer)
    assert res.status == "failed" and isinstance(res.value, TransferConfigError) and "shapes" in str(res.value)


def test_never_offered_id_times_out_by_kvjax_deadline(server, pserver):
    """The transfer library's pull of an unknown id never completes: kvjax's deadline ends it."""
    conn = server.connect(pserver.address())
    out = conn.pull(987654321, [jax.ShapeDtypeStruct((4,), jnp.float32, sharding=ONE)])
    t0 = time.monotonic()
    with pytest.raises(PullTimeoutError, match="deadline"):
        wait_ready(out, t0 + 0.5)
    assert 0.5 <= time.monotonic() - t0 < 3.0  # returned at the deadline (slack for a loaded box)
    conn._poison_connection()  # ends the transfer with an error, so the process can exit cleanly
    with pytest.raises(jax.errors.JaxRuntimeError):  # "Connection closed" or "InjectFailure"
        jax.block_until_ready(out)


def test_pull_of_an_id_already_taken_fails_at_the_deadline_and_frees_its_thread(pserver, server):
    s = Side(pserver, server, max_pull_threads=1, side_channel_timeout=0.5)
    try:
        arrays = _arrays(9)
        params = s.producer.offer("r", arrays)
        _steal(pserver, params, arrays)  # the producer still believes it is on offer
        t0 = time.monotonic()
        s.consumer.start_pull("d", params, _specs(arrays), timeout=1.0)
        with pytest.raises(CapacityError):  # one thread at most, and it is busy
            s.consumer.start_pull("e", params, _specs(arrays))
        res = _one(s.consumer)
        assert res.status == "failed" and isinstance(res.value, PullTimeoutError)
        assert 1.0 <= time.monotonic() - t0 < 3.0
        end = time.monotonic() + 5
        while s.consumer.live_threads and time.monotonic() < end:
            time.sleep(0.01)
        assert s.consumer.live_threads == 0  # the poisoned connection ended the stuck transfer
    finally:
        s.close()


def test_gather_blocks_copies_the_named_slots():
    cfg = cache_config(primary_blocks=6)
    pools = allocate_pools(cfg)
    (arr,) = pools.primary
    rng = np.random.default_rng(0)
    data = rng.standard_normal(arr.shape).astype(np.float32)
    pools = pools.with_primary(0, jnp.asarray(data))
    (got,) = gather_blocks(pools, [[4, 0, 4]])
    chex.assert_shape(got, (3, *arr.shape[1:]))
    np.testing.assert_array_equal(np.asarray(got), data[[4, 0, 4]])
    for bad in ([[6]], [[-1]], [[1.0]], [1, 2], "x"):
        with pytest.raises(TransferConfigError):
            gather_blocks(pools, bad)


def _random_pools(cfg, seed):
    pools = allocate_pools(cfg)
    rng = np.random.default_rng(seed)
    for spec in pools.geometry.pools:
        arr, sc = pools.primary[spec.index], pools.primary_scales[spec.index]
        data = jnp.asarray(rng.integers(0, 255, arr.shape).astype(np.uint8)) if arr.dtype == jnp.uint8 \
            else jnp.asarray(rng.standard_normal(arr.shape), arr.dtype)
        scales = None if sc is None else jnp.asarray(rng.uniform(0.5, 2.0, sc.shape), sc.dtype)
        pools = pools.with_primary(spec.index, data, scales)
    return pools


def _blocks(pools, spec, slots):
    ba = pools.block_axis
    out = [np.take(np.asarray(jnp.copy(pools.primary[spec.index])), slots, axis=ba)]
    if pools.primary_scales[spec.index] is not None:
        out.append(np.take(np.asarray(jnp.copy(pools.primary_scales[spec.index])), slots, axis=ba))
    return out


@pytest.mark.parametrize("kw", [dict(layout="block_first"), dict(layout="layer_first", attention_windows=(8, 64)),
                                dict(dtype="float8_e4m3fn")])
def test_scatter_blocks_inverts_gather_blocks(kw):
    cfg = cache_config(primary_blocks=6, **kw)
    src, dst = _random_pools(cfg, 1), allocate_pools(cfg)
    n_pools = len(cfg.pools)
    src_slots, dst_slots = [[5, 2]] * n_pools, [[0, 3]] * n_pools
    arrays = gather_blocks(src, src_slots)
    dst = scatter_blocks(dst, dst_slots, arrays)
    for spec in cfg.pools:
        for got, want in zip(_blocks(dst, spec, [0, 3]), _blocks(src, spec, [5, 2]), strict=True):
            np.testing.assert_array_equal(got, want)
        for rest in _blocks(dst, spec, [1, 2, 4, 5]):
            assert not rest.any()  # untouched slots stay zero
    for bad_slots, bad_arrays in [([[0, 0]] * n_pools, arrays), (dst_slots, arrays[:-1]),
                                  (dst_slots, (arrays[0][:1],) + tuple(arrays[1:]))]:
        with pytest.raises(TransferConfigError):
            scatter_blocks(dst, bad_slots, bad_arrays)


def test_blocks_travel_from_pools_to_pools(side):
    """gather on P -> offer -> pull on D -> scatter into D's pools: the same bytes."""
    cfg = cache_config(primary_blocks=6)
    src, dst = _random_pools(cfg, 2), allocate_pools(cfg)
    arrays = gather_blocks(src, [[1, 4, 2]])
    params = side.producer.offer("r", arrays, block_ids=[1, 4, 2], num_tokens=12)
    side.consumer.start_pull("d", params, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dst.primary[0].sharding)
                                           for a in arrays])
    res = _one(side.consumer)
    assert res.status == "ok", res.value
    dst = scatter_blocks(dst, [[5, 0, 3]], res.value)
    np.testing.assert_array_equal(_blocks(dst, cfg.pools[0], [5, 0, 3])[0], _blocks(src, cfg.pools[0], [1, 4, 2])[0])


def test_pull_lands_in_the_consumer_sharding(side):
    """The puller picks the destination devices, shard for shard: 2-way on P's devices lands
    2-way on D's own devices; a different shard count is not resharded by the transfer (it
    fails, bounded), so D pulls with P's shard layout and reshards locally (TP 2 -> TP 4)."""
    devs = jax.devices()
    assert len(devs) >= 8

    def tp(devices):
        return NamedSharding(Mesh(np.array(devices), ("tp",)), PartitionSpec(None, "tp"))

    x = jax.device_put(jnp.arange(3 * 8 * 5, dtype=jnp.float32).reshape(3, 8, 5), tp(devs[:2]))
    params = side.producer.offer("r", [x])
    side.consumer.start_pull("d", params, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tp(devs[2:4]))])
    res = _one(side.consumer)
    assert res.status == "ok", res.value
    (y,) = res.value
    assert y.sharding == tp(devs[2:4])
    z = jax.device_put(y, tp(devs[4:8]))
    chex.assert_trees_all_equal(np.asarray(z), np.asarray(x))

    params = side.producer.offer("r2", [x])
    side.consumer.start_pull("d2", params, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=tp(devs[4:8]))])
    res = _one(side.consumer)
    assert res.status == "failed" and "slic" in str(res.value)


def test_heartbeats_during_a_pull_keep_the_lease(pserver, server):
    """A pull that outlives the lease keeps its offer alive by heartbeats; when it then fails
    at its deadline the producer hears of it (consumer_failed), never expired."""
    s = Side(pserver, server, kv_lease_duration=0.8, heartbeat_interval=0.1, side_channel_timeout=0.5)
    try:
        arrays = _arrays(10)
        params = s.producer.offer("r", arrays)
        _steal(pserver, params, arrays)  # the pull below can never complete
        s.consumer.start_pull("d", params, _specs(arrays), timeout=2.0)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.6:  # twice the lease
            assert s.producer.poll() == []
            time.sleep(0.05)
        res = _one(s.consumer)
        assert res.status == "failed" and isinstance(res.value, PullTimeoutError)
        end = time.monotonic() + 3
        while not s.released and time.monotonic() < end:
            s.producer.poll()
            time.sleep(0.01)
        assert s.released == [("r", "consumer_failed")]
    finally:
        s.close()


def test_an_ended_offer_is_reclaimed_from_the_transfer_server(pserver, server):
    s = Side(pserver, server, side_channel_timeout=8.0)
    try:
        s.producer.offer("r", _arrays(11))
        assert s.producer.abort("r")
        end = time.monotonic() + 4.0  # well inside the 8 s bound: the self-pull found the offer
        while s.producer.pending_reclaims and time.monotonic() < end:
            time.sleep(0.01)
        assert s.producer.pending_reclaims == 0
    finally:
        s.close()


def test_close_abandons_a_stuck_pull_and_its_thread_ends(pserver, server):
    s = Side(pserver, server, side_channel_timeout=0.5)
    arrays = _arrays(12)
    params = s.producer.offer("r", arrays)
    _steal(pserver, params, arrays)
    s.consumer.start_pull("d", params, _specs(arrays), timeout=60.0)
    while s.consumer.stage("d") != "pulling":
        time.sleep(0.005)
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 3.0 and s.consumer.live_threads == 0
    with pytest.raises(RoleError):
        s.consumer.start_pull("e", params, _specs(arrays))


def test_bad_pull_arguments_start_nothing(side):
    arrays = _arrays(13)
    params = side.producer.offer("r", arrays)
    good = _specs(arrays)
    bad_calls = [
        dict(request_id="", params=params, specs=good),
        dict(request_id="d", params={"do_remote_prefill": True}, specs=good),
        dict(request_id="d", params=params, specs=[]),
        dict(request_id="d", params=params, specs=[np.zeros(3)]),
        dict(request_id="d", params=params, specs=good, timeout=float("nan")),
        dict(request_id="d", params=params, specs=good, timeout=0),
    ]
    for kw in bad_calls:
        with pytest.raises(TransferConfigError):
            side.consumer.start_pull(**kw)
    assert side.consumer.live_threads == 0 and side.consumer.poll() == []
    assert side.producer.live_offers == 1
    side.consumer.start_pull("d", params, good)
    with pytest.raises(DuplicateRequestError):
        side.consumer.start_pull("d", params, good)
    assert _one(side.consumer).status == "ok"


def test_keep_alive_holds_the_lease_in_the_background_until_dropped(pserver, server):
    s = Side(pserver, server, kv_lease_duration=0.8, heartbeat_interval=0.1, side_channel_timeout=0.5)
    try:
        kept = s.producer.offer("kept", _arrays(14))
        lost = s.producer.offer("lost", _arrays(15))
        s.consumer.keep_alive("d-kept", kept)
        s.consumer.keep_alive("d-lost", lost.to_dict())
        with pytest.raises(DuplicateRequestError):
            s.consumer.keep_alive("d-kept", kept)
        assert s.producer.abort("lost")
        t0 = time.monotonic()
        results = []
        while time.monotonic() - t0 < 1.6:  # twice the lease
            results += s.consumer.poll()
            assert s.producer.live_offers == 1 and s.producer.lease_left("kept") is not None
            time.sleep(0.05)
        (res,) = results  # the aborted offer is reported once, the kept one not at all
        assert res.request_id == "d-lost" and res.status == "failed" and res.value.code == "unknown_transfer"
        assert s.consumer.drop("d-kept") is True and s.consumer.drop("d-kept") is False
        end = time.monotonic() + 3
        while s.producer.live_offers and time.monotonic() < end:
            s.producer.poll()
            time.sleep(0.05)
        s.producer.poll()
        assert ("kept", "expired") in s.released
    finally:
        s.close()
