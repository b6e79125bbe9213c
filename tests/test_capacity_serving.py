"""A server's KV cache from memory: the device rule (utilization x allocator limit - bytes in
use - activations), a stated budget, the CPU default, and the start-up check that one request
of the maximum length fits (sliding windows hold the whole prompt)."""
import pytest

from kvjax import capacity as C
from kvjax.model_catalog import load_model_spec

GiB = 2**30


def test_serving_kv_cache_bytes():
    stats = {"bytes_limit": 80 * GiB, "bytes_in_use": 16 * GiB}
    total, how = C.serving_kv_cache_bytes(utilization=0.9, activations=GiB, memory_stats=stats)
    assert total == int(0.9 * 80 * GiB) - 17 * GiB and "0.9 x 80.00 GiB device memory" in how
    total2, _ = C.serving_kv_cache_bytes(utilization=0.9, activations=GiB, memory_stats=stats, num_devices=4)
    assert total2 == 4 * total  # the pools' kv heads are split over the devices
    assert C.serving_kv_cache_bytes(utilization=0.9, activations=GiB, memory_stats=stats,
                                    kv_cache_bytes=3 * GiB)[0] == 3 * GiB
    total, how = C.serving_kv_cache_bytes(utilization=0.9, activations=GiB, memory_stats=None)
    assert total == C.DEFAULT_HOST_KV_CACHE_BYTES == GiB and "reports no device memory" in how
    with pytest.raises(ValueError, match="the weights alone"):
        C.serving_kv_cache_bytes(utilization=0.5, activations=0, memory_stats={"bytes_limit": GiB, "bytes_in_use": GiB})
    with pytest.raises(ValueError, match="num_devices must be >= 1"):
        C.serving_kv_cache_bytes(utilization=0.5, activations=0, num_devices=0)


def test_max_seq_len_must_fit():
    spec = load_model_spec("micro-swa")
    cc = spec.cache_config(primary_blocks=64, tokens_per_block=16, max_seq_len=1024)
    C.check_max_seq_len_fits(cc)  # 1024 / 16 = 64 blocks in every window
    small = spec.cache_config(primary_blocks=63, tokens_per_block=16, max_seq_len=1024)
    with pytest.raises(ValueError, match=r"63 blocks of 16 tokens, 64 needed.*to at most 1008"):
        C.check_max_seq_len_fits(small)
