"""Static metadata is geometry only: configs that differ in ledger policy give equal
`PoolGeometry`s and share every compiled op (trace counts), and kernel selection is a pure
function of (platform, compute capability, dtype, head_dim, tokens per block)."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_helpers import make_config

from kvjax import TransferKind, TransferPlan
from kvjax.device import (
    PoolGeometry,
    allocate_pools,
    apply_transfers,
    backend,
    build_kvcache_offsets,
    gather_kv,
    paged_attention,
    write_kv,
)
from kvjax.device import attention as attn_mod
from kvjax.device import gather as gather_mod
from kvjax.device import transfers as tr
from kvjax.device import write as write_mod

POLICY = dict(enable_block_reuse=False, enable_partial_reuse=False, copy_on_partial_reuse=False, onboard_blocks=False,
              secondary_offload_min_priority=80, event_buffer_max_size=64, max_num_tokens=512, max_beam_width=1)


def test_policy_does_not_reach_the_geometry():
    a = make_config(dtype="bfloat16")
    b = dataclasses.replace(a, **POLICY)
    assert a != b and PoolGeometry.from_config(a) == PoolGeometry.from_config(b)
    assert hash(PoolGeometry.from_config(a)) == hash(PoolGeometry.from_config(b))
    pa, pb = allocate_pools(a), allocate_pools(b)
    assert jax.tree.structure(pa) == jax.tree.structure(pb)  # same treedef: same jit cache entries
    assert PoolGeometry.from_config(dataclasses.replace(a, tokens_per_block=8)) != PoolGeometry.from_config(a)


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_policies_share_compiled_ops(dtype):
    """Every op run on pools from config A, then on pools from config B (policy changed):
    no op traces again."""
    a = make_config(dtype=dtype, primary_blocks=6, secondary_blocks=4, attention_windows=None)
    b = dataclasses.replace(a, **POLICY)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.float32)
    sm = np.array([0, 1, 5, -1], np.int32)
    table, lens = np.array([[0, 1], [2, 6]], np.int32), np.array([7, 3], np.int32)
    q = jnp.ones((2, 1, 4, 8), jnp.float32)
    plan = TransferPlan.from_ops([(TransferKind.OFFLOAD, 0, 1, 0, 4), (TransferKind.COPY, 0, 0, 3, 2),
                                  (TransferKind.ONBOARD, 0, 0, 4, 3)])

    def run(config):
        pools = allocate_pools(config)
        for layer in range(config.num_layers):
            pools = write_kv(pools, layer, k, k, sm)
            gather_kv(pools, layer, table, lens)
            paged_attention(q, pools, layer, table, lens)
        for strategy in ("sequential", "bulk"):
            pools = apply_transfers(pools, plan, strategy=strategy)
        build_kvcache_offsets(config, {w: table for w in config.windows})
        return pools

    jitted = (write_mod._write_kv, gather_mod._gather_kv, attn_mod._paged_attention, tr._apply_segment,
              tr._sequential_run)
    jax.clear_caches()
    run(a)
    sizes = [f._cache_size() for f in jitted]
    assert all(sizes)
    orig = write_mod._write_xla if dtype == "float32" else write_mod._write_scaled_xla
    chex.clear_trace_counter()
    name = "_write_xla" if dtype == "float32" else "_write_scaled_xla"
    setattr(write_mod, name, chex.assert_max_traces(orig, n=0))  # any new trace fails
    try:
        run(b)
    finally:
        setattr(write_mod, name, orig)
    assert [f._cache_size() for f in jitted] == sizes


CC = {"H100/H200": (9, 0), "A100": (8, 0), "L40S": (8, 9), "B200": (10, 0), "RTX 5090": (12, 0)}


@pytest.mark.parametrize("card,cap", CC.items())
def test_kernel_selection_by_compute_capability(card, cap):
    select = lambda **kw: backend.select("paged_attention", platform="gpu", capability=cap, **kw)  # noqa: E731
    hopper = cap[0] == 9
    assert select(dtype=jnp.bfloat16, head_dim=128, tokens_per_block=16) == ("pallas" if hopper else "xla")
    assert select(dtype=jnp.float16, head_dim=64, tokens_per_block=64) == ("pallas" if hopper else "xla")
    for dtype, hd, tpb in ((jnp.float32, 128, 16), (jnp.float8_e4m3fn, 128, 16), (jnp.bfloat16, 96, 16),
                           (jnp.bfloat16, 128, 4)):
        assert select(dtype=dtype, head_dim=hd, tokens_per_block=tpb) == "xla"
    for op in ("gather_kv", "write_kv", "apply_transfers"):
        assert backend.select(op, platform="gpu", capability=cap, dtype=jnp.bfloat16, head_dim=128,
                              tokens_per_block=16) == "xla"
    why = backend.kernel_support("paged_attention", platform="gpu", capability=cap, dtype=jnp.bfloat16, head_dim=128,
                                 tokens_per_block=16)
    assert (why is None) == hopper
    copy_why = backend.kernel_support("gather_kv", platform="gpu", capability=cap)
    assert (copy_why is None) == (cap >= (9, 0))  # TMA: Hopper and newer


def test_kernel_selection_off_gpu_and_parsing():
    for op in backend.OPS:
        assert backend.select(op, platform="cpu", capability=None, dtype=jnp.bfloat16, head_dim=128, tokens_per_block=16) == "xla"
        assert backend.kernel_support(op, platform="cpu", capability=None) is None  # the interpreter takes all
    assert backend.kernel_support("gather_kv", platform="gpu", capability=None) is not None
    assert backend.parse_capability("9.0") == (9, 0) and backend.parse_capability("8.9") == (8, 9)
    assert backend.parse_capability(None) is None and backend.parse_capability("sm_90") is None
    with pytest.raises(ValueError, match="op"):
        backend.select("attention", platform="gpu", capability=(9, 0))
    assert backend.resolve("auto", "paged_attention", dtype=jnp.bfloat16, head_dim=128, tokens_per_block=16) == (
        "pallas" if jax.default_backend() == "gpu" and backend.compute_capability()[0] == 9 else "xla")
