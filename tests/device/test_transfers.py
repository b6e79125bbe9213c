"""apply_transfers: equal to applying the plan entry by entry (property test), hazard
splitting, partial copies, every strategy and impl, donation, no recompiles."""
import chex
import jax
import numpy as np
import pytest
from device_helpers import LAYOUTS, assert_pools_equal, assert_pools_match, fill, make_config, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax import TransferKind, TransferPlan
from kvjax.device import allocate_pools, apply_transfers, apply_transfers_reference, split_segments, write_kv
from kvjax.device import transfers as tr

TPB = 4
CONFIGS = {lay: make_config(layout=lay, primary_blocks=6, secondary_blocks=4) for lay in LAYOUTS}
_POOLS = {}


def pools_for(layout: str):
    """Module-lifetime pools per layout; each use refills them (donation consumes the old)."""
    return fill(allocate_pools(CONFIGS[layout]), seed=len(_POOLS))


@st.composite
def plans(draw, max_ops=10):
    cfg = CONFIGS["block_first"]
    n = draw(st.integers(0, max_ops))
    ops = []
    for _ in range(n):
        kind = draw(st.sampled_from(list(TransferKind)))
        pool = draw(st.integers(0, len(cfg.pools) - 1))
        p, s = cfg.pools[pool].primary_blocks, cfg.pools[pool].secondary_blocks
        src = draw(st.integers(0, (s if kind == TransferKind.ONBOARD else p) - 1))
        dst = draw(st.integers(0, (s if kind == TransferKind.OFFLOAD else p) - 1))
        num = TPB if kind == TransferKind.OFFLOAD else draw(st.sampled_from([1, 2, 3, TPB, TPB]))
        ops.append((int(kind), pool, src, dst, num))
    return TransferPlan.from_ops(ops)


@settings(max_examples=25)
@given(plan=plans(), layout=st.sampled_from(LAYOUTS), strategy=st.sampled_from(["sequential", "bulk", "blockwise"]))
def test_plan_equals_one_by_one(plan, layout, strategy):
    pools = pools_for(layout)
    expected = snapshot(apply_transfers_reference(pools, plan))
    pools = apply_transfers(pools, plan, strategy=strategy, impl="xla")
    assert_pools_equal(pools, expected)
    for a in pools.secondary:
        assert a.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pallas_impl_matches(layout):
    plan = TransferPlan.from_ops([(0, 0, 1, 0, 4), (2, 0, 1, 3, 2), (1, 0, 0, 1, 4), (2, 1, 4, 5, 4), (1, 1, 2, 0, 3)])
    pools = pools_for(layout)
    expected = snapshot(apply_transfers_reference(pools, plan))
    pools = apply_transfers(pools, plan, impl="pallas")
    assert_pools_equal(pools, expected)


def test_sequential_runs_keep_order_per_pool():
    cfg = CONFIGS["block_first"]
    K = TransferKind
    plan = TransferPlan.from_ops([(K.OFFLOAD, 0, 0, 2, 4), (K.OFFLOAD, 1, 0, 2, 4), (K.ONBOARD, 0, 1, 0, 4),
                                  (K.ONBOARD, 1, 1, 0, 4), (K.COPY, 0, 0, 3, 2), (K.COPY, 0, 1, 4, 4)])
    runs = [(p, k, n, ops[:, :n].tolist()) for p, k, ops, n in tr.split_runs(cfg, plan)]
    assert runs == [
        (0, K.OFFLOAD, 1, [[0], [2], [4]]),
        (0, K.ONBOARD, 1, [[1], [0], [4]]),
        (0, K.COPY, 2, [[0, 1], [3, 4], [2, 4]]),
        (1, K.OFFLOAD, 1, [[0], [2], [4]]),
        (1, K.ONBOARD, 1, [[1], [0], [4]]),
    ]


def test_hazards_split_segments_and_war_does_not():
    cfg = CONFIGS["block_first"]
    K = TransferKind
    # offload slot 0, then onboard into slot 0 (write after read: one segment)
    assert len(split_segments(cfg, TransferPlan.from_ops([(K.OFFLOAD, 0, 0, 2, 4), (K.ONBOARD, 0, 1, 0, 4)]))) == 1
    # onboard into slot 3, then copy from slot 3 (read after write: two segments)
    assert len(split_segments(cfg, TransferPlan.from_ops([(K.ONBOARD, 0, 1, 3, 4), (K.COPY, 0, 3, 4, 2)]))) == 2
    # two writes to one slot (write after write: two segments)
    assert len(split_segments(cfg, TransferPlan.from_ops([(K.COPY, 0, 1, 3, 4), (K.COPY, 0, 2, 3, 2)]))) == 2
    # same slot numbers in different pools or tiers do not conflict
    assert (
        len(split_segments(cfg, TransferPlan.from_ops([(K.OFFLOAD, 0, 0, 2, 4), (K.COPY, 1, 2, 0, 4), (K.OFFLOAD, 0, 2, 0, 4)])))
        == 1
    )
    segs = split_segments(cfg, TransferPlan.from_ops([(K.COPY, 0, 1, 3, 4)] * 1 + [(K.COPY, 0, 2, 4, 4), (K.COPY, 0, 0, 5, 4)]))
    assert segs[0].cp_src.shape == (2, 4) and not segs[0].partial  # 3 copies bucketed to 4


def test_donation_and_no_recompiles():
    pools = pools_for("block_first")
    ptr_p = [a.unsafe_buffer_pointer() for a in pools.primary]
    ptr_s = [a.unsafe_buffer_pointer() for a in pools.secondary]
    K = TransferKind
    traced = chex.assert_max_traces(tr._gather_primary, n=4)  # offload + copy gathers x 2 pools, traced once
    orig, tr._gather_primary = tr._gather_primary, traced
    try:
        jax.clear_caches()
        for step in range(4):  # 3 or 4 entries per kind: same buckets every step
            n = 3 + step % 2
            ops = [(K.OFFLOAD, p, i, (i + step) % 4, TPB) for p in (0, 1) for i in range(n)]
            ops += [(K.COPY, p, 4, 5, 2 + step % 2) for p in (0, 1)]
            pools = apply_transfers(pools, TransferPlan.from_ops(ops), strategy="bulk")
    finally:
        tr._gather_primary = orig
        jax.clear_caches()
    sizes = []
    for step in range(4):  # the sequential strategy: same buckets, no new compilations
        n = 3 + step % 2
        ops = [(K.OFFLOAD, p, i, (i + step) % 4, TPB) for p in (0, 1) for i in range(n)]
        ops += [(K.COPY, p, 4, 5, 2 + step % 2) for p in (0, 1)]
        pools = apply_transfers(pools, TransferPlan.from_ops(ops), strategy="sequential")
        sizes.append(tr._sequential_run._cache_size())
    assert sizes[1:] == sizes[:1] * 3, sizes
    assert [a.unsafe_buffer_pointer() for a in pools.primary] == ptr_p
    assert [a.unsafe_buffer_pointer() for a in pools.secondary] == ptr_s


def test_bad_plans():
    pools = pools_for("block_first")
    K = TransferKind
    bad = [
        ([(K.COPY, 2, 0, 1, 4)], "plan.pool"),
        ([(K.COPY, 0, 0, 6, 4)], "dst=6"),  # the null slot is never a destination
        ([(K.ONBOARD, 0, 4, 0, 4)], "src=4"),
        ([(K.OFFLOAD, 0, 0, 1, 2)], "num_tokens"),
        ([(K.COPY, 0, 0, 1, 0)], "num_tokens"),
    ]
    for ops, msg in bad:
        with pytest.raises(ValueError, match=msg):
            apply_transfers(pools, TransferPlan.from_ops(ops))
    with pytest.raises(ValueError, match="TransferPlan"):
        apply_transfers(pools, [(0, 0, 0, 0, 4)])
    with pytest.raises(ValueError, match="strategy"):
        apply_transfers(pools, TransferPlan.empty(), strategy="dma")
    with pytest.raises(ValueError, match="sequential"):
        apply_transfers(pools, TransferPlan.empty(), strategy="sequential", impl="pallas")
    no_sec = allocate_pools(make_config(secondary_blocks=0))
    with pytest.raises(ValueError, match=r"outside \[0, 0\)"):
        apply_transfers(no_sec, TransferPlan.from_ops([(K.OFFLOAD, 0, 0, 0, 4)]))
    assert apply_transfers(no_sec, TransferPlan.empty()) is no_sec


# ---------------------------------------------------------------------------- FP8 pools
def fp8_config(layout):
    return make_config(layout=layout, dtype="float8_e4m3fn", num_layers=2, num_kv_heads=2, head_dim=8,
                       attention_windows=None, primary_blocks=6, secondary_blocks=4)


@st.composite
def fp8_plans(draw, cfg):
    n = draw(st.integers(1, 8))
    ops = []
    for _ in range(n):
        kind = draw(st.sampled_from(list(TransferKind)))
        pool = cfg.pools[0]
        src = draw(st.integers(0, (pool.secondary_blocks if kind == TransferKind.ONBOARD else pool.primary_blocks) - 1))
        dst = draw(st.integers(0, (pool.secondary_blocks if kind == TransferKind.OFFLOAD else pool.primary_blocks) - 1))
        num = cfg.tokens_per_block if kind == TransferKind.OFFLOAD else draw(st.sampled_from([1, 2, 3, 4, 4]))
        ops.append((int(kind), 0, src, dst, num))
    return TransferPlan.from_ops(ops)


def _filled_fp8(cfg, seed):
    """FP8 pools with every real slot written at a different magnitude, host tier too."""
    pools = allocate_pools(cfg)
    rng = np.random.default_rng(seed)
    tpb, p = cfg.tokens_per_block, cfg.pools[0]
    sm = np.arange(p.primary_blocks * tpb, dtype=np.int32)
    for layer in range(cfg.num_layers):
        mag = np.repeat(10.0 ** rng.uniform(-2, 2, p.primary_blocks), tpb)[:, None, None]
        x = (rng.standard_normal((sm.size, 2, 8)) * mag).astype(np.float32)
        pools = write_kv(pools, layer, x, -x, sm)
    # give the host tier content: offload every block there once
    k = min(p.secondary_blocks, p.primary_blocks)
    plan = TransferPlan.from_ops([(TransferKind.OFFLOAD, 0, (i + 3) % p.primary_blocks, i, tpb) for i in range(k)])
    return apply_transfers(pools, plan, strategy="sequential")


@settings(max_examples=5)
@given(data=st.data(), layout=st.sampled_from(LAYOUTS), strategy=st.sampled_from(["sequential", "bulk", "blockwise"]))
def test_transfers_move_scales_with_blocks(data, layout, strategy):
    """Every strategy equals the entry-by-entry reference on FP8 pools, scales included."""
    cfg = fp8_config(layout)
    plan = data.draw(fp8_plans(cfg))
    pools = _filled_fp8(cfg, seed=len(plan))
    want = apply_transfers_reference(pools, plan)
    pools = apply_transfers(pools, plan, strategy=strategy, impl="xla")
    assert_pools_match(pools, want)


