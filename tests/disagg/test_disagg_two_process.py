"""A producer and a consumer in two processes on 127.0.0.1: bit-exact pulls, a killed producer."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from disagg_helpers import ProducerProcess, geometry, host_arrays, transfer_config

from kvjax.disagg import KVConsumer, PullTimeoutError, RemotePrefillParams, SideChannelError

SHAPES = [[2, 2, 2, 4, 8], [3, 5]]
DTYPES = ["float32", "bfloat16"]


def _specs(shapes, dtypes):
    return [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d)) for s, d in zip(shapes, dtypes, strict=True)]


def _wait(consumer: KVConsumer, limit: float):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        out = consumer.poll()
        if out:
            return out, time.monotonic()
        time.sleep(0.005)
    raise AssertionError("no pull result within the test's limit")


@pytest.fixture
def consumer():
    c = KVConsumer(transfer_config("kv_consumer", pull_timeout=4.0), geometry())
    yield c
    c.close()


def test_pull_between_processes_is_bit_exact(consumer):
    prod = ProducerProcess("--seed", "11")
    try:
        params = RemotePrefillParams.from_dict(prod.params)
        assert params.remote_block_ids == (3, 1) and params.remote_num_tokens == 7
        consumer.start_pull("d-1", prod.params, _specs(SHAPES, DTYPES))
        (result,), _ = _wait(consumer, 20)
        assert result.request_id == "d-1" and result.status == "ok", result
        want = host_arrays(11, SHAPES, [jnp.dtype(d) for d in DTYPES])
        for got, exp in zip(result.value, want, strict=True):
            assert got.shape == exp.shape and got.dtype == exp.dtype
            assert np.asarray(got).tobytes() == exp.tobytes()
        assert prod.read_line() == "released pulled"  # the "pulled" notification reached P
        assert prod.proc.wait(20) == 0
    finally:
        prod.stop()


def test_producer_killed_before_the_pull_fails_within_deadline(consumer):
    prod = ProducerProcess("--seed", "3")
    try:
        consumer.handshake(prod.params)  # the producer was alive and compatible
        prod.kill()
        t0 = time.monotonic()
        consumer.start_pull("d-2", prod.params, _specs(SHAPES, DTYPES), timeout=3.0)
        (result,), t1 = _wait(consumer, 10)
        assert result.status == "failed"
        assert isinstance(result.value, (SideChannelError, PullTimeoutError)), result.value
        assert t1 - t0 < 3.0 + 1.5  # the deadline, plus slack for a loaded box
    finally:
        prod.stop()


def test_producer_killed_mid_pull_never_yields_partial_data(consumer):
    """A 32 MiB offer; P is killed as soon as D's worker has issued the pull. The result is a
    failure within the deadline or, if every byte had already arrived, bit-exact data."""
    shapes, dtypes = [[8 * 1024 * 1024]], ["float32"]
    prod = ProducerProcess("--seed", "5", "--shapes", "[[8388608]]", "--dtypes", '["float32"]')
    try:
        t0 = time.monotonic()
        consumer.start_pull("d-3", prod.params, _specs(shapes, dtypes), timeout=4.0)
        while consumer.stage("d-3") not in ("pulling", "notifying", "done", None):
            assert time.monotonic() - t0 < 10
            time.sleep(0.0005)
        prod.kill()
        (result,), t1 = _wait(consumer, 10)
        assert t1 - t0 < 4.0 + 1.5
        if result.status == "ok":
            (want,) = host_arrays(5, shapes, dtypes)
            assert np.asarray(result.value[0]).tobytes() == want.tobytes()
        else:
            assert isinstance(result.value, Exception)
        deadline = time.monotonic() + 5  # a failed pull's thread ends once its connection is poisoned
        while consumer.live_threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert consumer.live_threads == 0
    finally:
        prod.stop()
