"""Device side of kvjax: KV pools as JAX arrays and the jitted ops that move their bytes.

Every op has an XLA path (a `*_reference` oracle beside it) and a Pallas path
(`pallas_kernels/`), picked by `impl="auto" | "xla" | "pallas"` (see `backend.py`). Ops that
return pools donate the pools they are given: always rebind the result. Ops take a Python
int layer or a traced one (`jax.lax.scan` over layers); `step_inputs` builds a step's
inputs from the ledger's output; `checked()` turns on checkify reports of bad traced inputs.
Hybrid models' recurrent states live in `StatePools` (`state_pools.py`), whole-state slots.
User documentation: docs/device.md.
"""
from kvjax.device.attention import (
    dense_attention,
    grouped_attention,
    paged_attention,
    paged_attention_reference,
    query_positions,
    visibility_mask,
)
from kvjax.device.buckets import bucket, pad_block_table, pad_seq_lens, pad_slot_mapping
from kvjax.device.checking import checked
from kvjax.device.gather import gather_kv, gather_kv_reference
from kvjax.device.geometry import PoolGeometry
from kvjax.device.offsets import build_kvcache_offsets
from kvjax.device.pools import KVPools, allocate_pools, pool_shape
from kvjax.device.state_pools import (
    StateField,
    StateGeometry,
    StatePools,
    allocate_state_pools,
    apply_state_transfers,
    apply_state_transfers_reference,
    read_states,
    read_states_reference,
    split_state_plan,
    write_states,
    write_states_reference,
)
from kvjax.device.step_inputs import StepInputs, slots_for_positions, step_inputs
from kvjax.device.transfers import apply_transfers, apply_transfers_reference, split_segments
from kvjax.device.write import write_kv, write_kv_reference

__all__ = [
    "KVPools",
    "PoolGeometry",
    "StateField",
    "StateGeometry",
    "StatePools",
    "StepInputs",
    "allocate_pools",
    "allocate_state_pools",
    "apply_state_transfers",
    "apply_state_transfers_reference",
    "apply_transfers",
    "apply_transfers_reference",
    "bucket",
    "build_kvcache_offsets",
    "checked",
    "dense_attention",
    "gather_kv",
    "gather_kv_reference",
    "grouped_attention",
    "pad_block_table",
    "pad_seq_lens",
    "pad_slot_mapping",
    "paged_attention",
    "paged_attention_reference",
    "pool_shape",
    "query_positions",
    "read_states",
    "read_states_reference",
    "slots_for_positions",
    "split_segments",
    "split_state_plan",
    "step_inputs",
    "visibility_mask",
    "write_kv",
    "write_kv_reference",
    "write_states",
    "write_states_reference",
]
