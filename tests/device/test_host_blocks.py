"""Host slots <-> bytes (`kvjax.device.host_blocks`, what the KV store reads and fills): a
write then a read returns the same bytes in any slot order, FP8 scales travel with their
blocks, other slots are untouched, and a wrong buffer is refused before anything changes."""
import numpy as np
import pytest

from kvjax.config import CacheConfig
from kvjax.device import allocate_pools
from kvjax.device.host_blocks import host_block_bytes, read_host_blocks, write_host_blocks


@pytest.mark.parametrize("dtype,layout", [("float32", "layer_first"), ("float8_e4m3fn", "block_first")])
def test_round_trip(dtype, layout):
    cfg = CacheConfig(tokens_per_block=4, num_layers=2, num_kv_heads=2, head_dim=8, max_seq_len=64, primary_blocks=8,
                      secondary_blocks=6, dtype=dtype, layout=layout)
    pools = allocate_pools(cfg)
    width = host_block_bytes(pools, [0])
    values = 2 * 2 * 2 * 4 * 8 * (4 if dtype == "float32" else 1)  # [layers, F, heads, tokens, head_dim]
    assert width == values + (2 * 2 * 2 * 4 if dtype != "float32" else 0)  # + float32 scales [layers, F, heads]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 120, (3, width), dtype=np.uint8)  # no NaN/inf bit patterns in any dtype
    pools = write_host_blocks(pools, [0], [4, 1, 5], data)
    got = read_host_blocks(pools, [0], [1, 5, 4, 0, 2])
    assert (got[0] == data[1]).all() and (got[1] == data[2]).all() and (got[2] == data[0]).all()
    assert not got[3:].any()  # untouched slots stay zero
    with pytest.raises(ValueError, match="uint8"):
        write_host_blocks(pools, [0], [2], data[:1].astype(np.int16))
    assert (read_host_blocks(pools, [0], [4])[0] == data[0]).all()
