"""Device side of kvjax: KV pools as JAX arrays and the jitted ops that move their bytes.

Every op has an XLA path (a `*_reference` oracle beside it) and a Pallas path
(`pallas_kernels/`), picked by `impl="auto" | "xla" | "pallas"` (see `backend.py`). Ops that
return pools donate the pools they are given: always rebind the result.
"""
from kvjax.device.attention import dense_attention, paged_attention, paged_attention_reference
from kvjax.device.buckets import bucket, pad_block_table, pad_seq_lens, pad_slot_mapping
from kvjax.device.gather import gather_kv, gather_kv_reference
from kvjax.device.offsets import build_kvcache_offsets
from kvjax.device.pools import KVPools, allocate_pools, pool_shape
from kvjax.device.transfers import apply_transfers, apply_transfers_reference, split_segments
from kvjax.device.write import write_kv, write_kv_reference

__all__ = [
    "KVPools",
    "allocate_pools",
    "apply_transfers",
    "apply_transfers_reference",
    "bucket",
    "build_kvcache_offsets",
    "dense_attention",
    "gather_kv",
    "gather_kv_reference",
    "pad_block_table",
    "pad_seq_lens",
    "pad_slot_mapping",
    "paged_attention",
    "paged_attention_reference",
    "pool_shape",
    "split_segments",
    "write_kv",
    "write_kv_reference",
]
