"""Pools sharded over kv heads on 8 CPU devices: same results as one device, block tables
replicated, no collectives in the compiled gather/write."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_helpers import assert_pools_equal, fill, make_config, random_tables, snapshot

from kvjax import TransferPlan
from kvjax.device import allocate_pools, apply_transfers, apply_transfers_reference, gather_kv, paged_attention, write_kv
from kvjax.device import gather as gather_mod
from kvjax.device import write as write_mod

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\b")


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.fail("tests/conftest.py must provide 8 CPU devices")
    return jax.make_mesh((8,), ("kv",))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sharded_matches_single_device(mesh, impl):
    cfg = make_config(num_kv_heads=8, head_dim=8, attention_windows=None, primary_blocks=8, secondary_blocks=4)
    single = fill(allocate_pools(cfg), seed=7)
    sharded = allocate_pools(cfg, sharding=mesh)
    assert sharded.primary[0].sharding.spec[3] == "kv"
    assert sharded.secondary[0].sharding.memory_kind == "pinned_host"
    sharded = sharded.replace(
        primary=tuple(
            jax.device_put(np.asarray(a), b.sharding) + 0 for a, b in zip(single.primary, sharded.primary, strict=True)
        ),
        secondary=tuple(
            jax.device_put(np.asarray(a), b.sharding) for a, b in zip(single.secondary, sharded.secondary, strict=True)
        ),
    )
    assert sharded.primary[0].addressable_shards[0].data.shape[3] == 1
    rng = np.random.default_rng(0)
    pool = cfg.pools[0]
    k = jnp.asarray(rng.standard_normal((6, 8, 8)), jnp.float32)
    sm = np.array([0, 1, 5, 9, -1, 30], np.int32)
    table, lens = random_tables(rng, pool, 4, 4, cfg.tokens_per_block)
    q = jnp.asarray(rng.standard_normal((4, 2, 16, 8)), jnp.float32)
    plan = TransferPlan.from_ops([(0, 0, 2, 1, 4), (2, 0, 3, 6, 2), (1, 0, 0, 2, 4)])
    outs = []
    for pools in (single, sharded):
        ptrs = [s.data.unsafe_buffer_pointer() for s in pools.primary[0].addressable_shards]
        pools = write_kv(pools, 1, k, k * 2, sm, impl=impl)
        assert ptrs == [s.data.unsafe_buffer_pointer() for s in pools.primary[0].addressable_shards]
        expected = snapshot(apply_transfers_reference(pools, plan))
        pools = apply_transfers(pools, plan, impl=impl)
        assert_pools_equal(pools, expected)
        kk, vv = gather_kv(pools, 1, table, lens, impl=impl)
        o = paged_attention(q, pools, 1, table, lens, impl=impl)
        outs.append([np.asarray(x) for x in (*pools.primary, kk, vv, o)])
    for a, b in zip(*outs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_no_collectives_in_gather_and_write(mesh):
    cfg = make_config(num_kv_heads=8, head_dim=8, attention_windows=None)
    pools = allocate_pools(cfg, sharding=mesh)
    table = jnp.zeros((4, 4), jnp.int32)
    lens = jnp.zeros((4,), jnp.int32)
    arr = pools.primary[0]
    j = jnp.int32(0)  # the layer is a traced index
    for impl in ("xla", "pallas"):
        hlo = gather_mod._gather_kv.lower(arr, None, table, lens, j, meta=pools.meta, pool_index=0, impl=impl,
                                          checked=False, out_dtype=arr.dtype).compile().as_text()
        assert not COLLECTIVES.findall(hlo), f"gather ({impl}) has collectives"
        k = jnp.zeros((4, 8, 8), jnp.float32)
        hlo = write_mod._write_kv.lower(arr, None, k, k, jnp.zeros((4,), jnp.int32), j, meta=pools.meta, pool_index=0,
                                        impl=impl, checked=False).compile().as_text()
        assert not COLLECTIVES.findall(hlo), f"write ({impl}) has collectives"


def test_sharded_fp8_matches_single_device(mesh, impl="pallas"):
    """FP8 pools sharded over kv heads (their scale arrays too): writes that grow scales,
    transfers with partial copies, gather and attention equal the single-device run. The
    kernel path covers the XLA scale bookkeeping and the kernels' shard_map specs."""
    cfg = make_config(num_kv_heads=8, head_dim=8, attention_windows=None, primary_blocks=8, secondary_blocks=4,
                      dtype="float8_e4m3fn")
    rng = np.random.default_rng(1)
    k1 = jnp.asarray(rng.standard_normal((8, 8, 8)), jnp.float32)
    k2 = k1 * 50  # larger: the blocks written first must grow their scales
    sm1 = np.arange(8, dtype=np.int32) * 2  # offsets 0 and 2 of blocks 0-3
    sm2 = sm1 + 1
    table, lens = np.array([[0, 1], [2, 3]], np.int32), np.array([8, 6], np.int32)
    q = jnp.asarray(rng.standard_normal((2, 1, 16, 8)), jnp.float32)
    plan = TransferPlan.from_ops([(0, 0, 2, 1, 4), (2, 0, 1, 5, 2), (1, 0, 1, 6, 3)])
    outs = []
    for pools in (allocate_pools(cfg), allocate_pools(cfg, sharding=mesh)):
        for sm, k in ((sm1, k1), (sm2, k2)):
            pools = write_kv(pools, 1, k, -k, sm, impl=impl)
        pools = apply_transfers(pools, plan, impl=impl)
        kk, vv = gather_kv(pools, 1, table, lens, impl=impl)
        o = paged_attention(q, pools, 1, table, lens, impl=impl)
        arrays = (*pools.primary, *pools.secondary, *pools.primary_scales, *pools.secondary_scales)
        outs.append([np.asarray(x, np.float32) for x in (*arrays, kk, vv, o)])
    assert outs[0][2].max() > 1  # scales grew past the first write's
    for a, b in zip(*outs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
