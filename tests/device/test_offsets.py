"""KVCacheIndex offsets: the numpy formula (shared with the ledger) and the jitted builder."""
import numpy as np
import pytest
from device_helpers import make_config

from kvjax.device import build_kvcache_offsets
from kvjax.offsets import kvcache_index_offsets


def test_block_first_hand_computed():
    cfg = make_config(num_layers=2, attention_windows=None, primary_blocks=5)  # one pool, 2 layers, null slot 5
    table = np.array([[0, 3, 5], [2, -1, 5]], np.int32)
    off = kvcache_index_offsets(cfg, table)
    assert off.shape == (1, 2, 2, 3) and off.dtype == np.int32
    # slot * layers(2) * kv_factor(2) + field
    np.testing.assert_array_equal(off[0, 0], [[0, 12, 20], [1, 13, 21]])
    np.testing.assert_array_equal(off[0, 1], [[8, 20, 20], [9, 21, 21]])


def test_layer_first_and_k_only():
    cfg = make_config(layout="layer_first", attention_windows=None, primary_blocks=5)
    off = kvcache_index_offsets(cfg, np.array([[4, 5]], np.int32))
    np.testing.assert_array_equal(off[0, 0], [[8, 10], [9, 11]])  # slot * 2 + field
    kcfg = make_config(cache_type="self_k_only", num_layers=3, attention_windows=None, primary_blocks=5)
    off = kvcache_index_offsets(kcfg, np.array([[1, 2]], np.int32))
    np.testing.assert_array_equal(off[0, 0], [[3, 6], [15, 15]])  # V row: the null slot's offset (5*3)


def test_windows_and_jitted_builder_agree():
    rng = np.random.default_rng(0)
    for layout in ("block_first", "layer_first"):
        for cache_type in ("self", "self_k_only"):
            cfg = make_config(layout=layout, cache_type=cache_type, num_kv_heads=(2, 2, 4), primary_blocks={48: 9, 6: 7})
            tables = {48: rng.integers(0, 10, (3, 5)).astype(np.int32), 6: rng.integers(-1, 8, (3, 2)).astype(np.int32)}
            host = kvcache_index_offsets(cfg, tables)
            dev = np.asarray(build_kvcache_offsets(cfg, tables))
            np.testing.assert_array_equal(host, dev)
            assert host.shape == (len(cfg.pools), 3, 2, 5)
            for pool in cfg.pools:  # narrower window padded with its null offset
                if pool.window == 6:
                    stride = pool.num_layers * cfg.kv_factor if layout == "block_first" else cfg.kv_factor
                    assert (host[pool.index, :, 0, 2:] == pool.null_slot * stride).all()


def test_bad_tables():
    cfg = make_config(primary_blocks=4)
    with pytest.raises(ValueError, match="dict window"):
        kvcache_index_offsets(cfg, np.zeros((1, 2), np.int32))
    with pytest.raises(ValueError, match="missing"):
        kvcache_index_offsets(cfg, {48: np.zeros((1, 2), np.int32)})
    with pytest.raises(ValueError, match="num_slots"):
        kvcache_index_offsets(cfg, {48: np.full((1, 2), 9, np.int32), 6: np.zeros((1, 2), np.int32)})
    with pytest.raises(ValueError, match="batch"):
        kvcache_index_offsets(cfg, {48: np.zeros((1, 2), np.int32), 6: np.zeros((2, 2), np.int32)})
