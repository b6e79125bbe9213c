"""Pool allocation: shapes per layout, memory kinds, the null slot, bucketing helpers."""
import jax
import numpy as np
import pytest
from device_helpers import make_config

from kvjax.device import allocate_pools, bucket, pad_block_table, pad_seq_lens, pad_slot_mapping
from kvjax.device.pools import KVPools


@pytest.mark.parametrize("layout", ["block_first", "layer_first"])
def test_shapes_and_memory_kinds(layout):
    cfg = make_config(layout=layout, dtype="bfloat16")
    pools = allocate_pools(cfg)
    assert isinstance(pools, KVPools) and len(pools.primary) == len(cfg.pools) == 2
    for pool, prim, sec in zip(cfg.pools, pools.primary, pools.secondary, strict=True):
        inner = (2, pool.num_kv_heads, 4, pool.head_dim)
        lead = (pool.num_slots, pool.num_layers) if layout == "block_first" else (pool.num_layers, pool.num_slots)
        assert prim.shape == lead + inner and prim.dtype == np.dtype("bfloat16")
        assert prim.sharding.memory_kind == "device"
        assert sec.sharding.memory_kind == "pinned_host"
        assert sec.shape[pools.block_axis] == pool.secondary_blocks
        assert not np.asarray(prim).any()
    assert pools.locate(1) == (cfg.pools[cfg.layer_to_pool[1][0]], cfg.layer_to_pool[1][1])
    leaves = jax.tree_util.tree_leaves(pools)
    assert len(leaves) == 4  # arrays only; config is static


def test_no_secondary_and_k_only():
    cfg = make_config(secondary_blocks=0, cache_type="self_k_only")
    pools = allocate_pools(cfg)
    assert pools.secondary == (None, None)
    assert pools.primary[0].shape[2] == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="CacheConfig"):
        allocate_pools("nope")
    with pytest.raises(ValueError, match="sharding"):
        allocate_pools(make_config(), sharding="gpu")
    mesh = jax.make_mesh((8,), ("kv",))
    with pytest.raises(ValueError, match="divisible"):
        allocate_pools(make_config(num_kv_heads=2), sharding=mesh)
    with pytest.raises(ValueError, match="layer"):
        allocate_pools(make_config()).locate(3)


def test_buckets():
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    t = pad_block_table(np.array([[1, 2, 3]], np.int32), 10)
    assert t.shape == (1, 4) and t[0, 3] == 10
    assert pad_seq_lens(np.array([3, 4, 5])).tolist() == [3, 4, 5, 0]
    assert pad_slot_mapping(np.arange(5)).tolist() == [0, 1, 2, 3, 4, -1, -1, -1]
    with pytest.raises(ValueError):
        pad_block_table(np.zeros((3, 3), np.int32), 0, batch=2)
