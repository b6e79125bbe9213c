"""Padding that cannot hurt: no op writes the null block; table entries out of range read
zeros, never another request's slot, for numpy and traced tables alike (adversarial random
tables and slot mappings, float32 and FP8, XLA and kernels); concrete bad inputs raise
ValueError and leave the pools usable; checked mode (checkify) reports bad traced inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_helpers import assert_pools_equal, fill, make_config, snapshot
from jax.experimental import checkify

from kvjax import TransferKind, TransferPlan
from kvjax.device import allocate_pools, apply_transfers, checked, gather_kv, paged_attention, slots_for_positions, write_kv

TPB, HEADS, DIM = 4, 2, 4


def value(req: int, pos: int, field: int) -> np.ndarray:
    """K/V of (request, position, field): decodable, distinct, exact in float32 and FP8
    (a power of two times a small integer, at most 3 significant bits)."""
    base = np.float32(2.0 ** ((req % 8) - 4)) * (4 + (pos % 4))  # 4..7 x 2^k
    sign = -1 if field else 1
    return np.full((HEADS, DIM), sign * base, np.float32)


def decode(x: np.ndarray) -> set:
    return {float(v) for v in np.unique(np.abs(x)) if v}


@pytest.mark.parametrize("dtype,impl", [("float32", "xla"), ("float8_e4m3fn", "pallas")])
def test_adversarial_tables_and_slots_never_cross_requests(dtype, impl):
    """Each request owns disjoint blocks. Slot mappings carry extra entries aimed at the null
    block, past the pool, and at negative values; tables (traced, inside jit) carry entries
    -2, -1, the null slot, num_slots and huge values. After every write, each request's
    gathered K/V holds only its own values (or zeros where its table is bad), the null
    block stays zero, and the output of attention over a table of junk is exactly zero."""
    cfg = make_config(num_layers=1, num_kv_heads=HEADS, head_dim=DIM, tokens_per_block=TPB, attention_windows=None,
                      primary_blocks=12, secondary_blocks=0, dtype=dtype)
    pool = cfg.pools[0]
    rng = np.random.default_rng(0 if dtype == "float32" else 1)
    reqs = 3
    owned = rng.permutation(pool.primary_blocks)[: reqs * 3].reshape(reqs, 3)  # 3 blocks each
    junk = np.array([-2, -1, pool.null_slot, pool.num_slots, 2**30, -(2**31)], np.int64)
    pools = allocate_pools(cfg)
    gather = jax.jit(lambda p, t, s: gather_kv(p, 0, t, s, impl=impl, dtype=jnp.float32))
    written = np.zeros((reqs,), int)
    for _step in range(3):
        # each request writes its next 4 positions; padding/junk entries aimed at forbidden places
        sm, ks, vs = [], [], []
        for r in range(reqs):
            for pos in range(written[r], written[r] + 4):
                sm.append(owned[r, pos // TPB] * TPB + pos % TPB)
                ks.append(value(r, pos, 0))
                vs.append(value(r, pos, 1))
            written[r] += 4
        bad = [pool.null_slot * TPB, pool.null_slot * TPB + 3, pool.num_slots * TPB + 1, -1, -5, 2**31 - 1]
        sm += bad
        ks += [np.full((HEADS, DIM), 1e4, np.float32)] * len(bad)  # loud values: must land nowhere
        vs += [np.full((HEADS, DIM), np.nan, np.float32)] * len(bad)
        sm = jnp.asarray(np.array(sm, np.int64), jnp.int32)  # a device array: not range-checked on the host
        pools = jax.jit(lambda p, k, v, s: write_kv(p, 0, k, v, s, impl=impl))(pools, jnp.asarray(np.stack(ks)),
                                                                              jnp.asarray(np.stack(vs)), sm)
        null = np.asarray(pools.primary[0][pool.null_slot])
        assert not null.any(), "the null block was written"
        # tables: own blocks with random junk entries mixed in
        table = np.concatenate([owned, np.full((reqs, 1), pool.null_slot)], axis=1).astype(np.int64)  # [reqs, 4]
        mask = rng.random(table.shape) < 0.35
        table = np.where(mask, rng.choice(junk, table.shape), table)
        lens = np.minimum(written, 4 * TPB)
        k, v = (np.asarray(x) for x in gather(pools, jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32)))
        for r in range(reqs):
            for pos in range(4 * TPB):
                blk = pos // TPB
                good = table[r, blk] == owned[r, blk] if blk < 3 else False
                for f, got in enumerate((k[r, pos], v[r, pos])):
                    if good and pos < lens[r]:
                        np.testing.assert_array_equal(got, value(r, pos, f), err_msg=f"req {r} pos {pos}")
                    else:
                        assert not got.any(), f"req {r} pos {pos}: read {decode(got)} through a bad entry"
        # attention over a table of junk only: every query sees zero keys and values
        q = jnp.ones((reqs, 1, 2 * HEADS, DIM), jnp.float32)
        junk_table = jnp.asarray(rng.choice(junk, (reqs, 4)), jnp.int32)
        attend = jax.jit(lambda p, t, s: paged_attention(q, p, 0, t, s, impl=impl))  # noqa: B023  # called at once
        out = attend(pools, junk_table, jnp.asarray(lens, jnp.int32))
        assert not np.asarray(out).any()


def test_negative_two_does_not_wrap():
    """The reported bug: a traced -2 used to wrap to slot num_slots - 2 (another request's)."""
    cfg = make_config(num_layers=1, attention_windows=None, primary_blocks=4, secondary_blocks=0, num_kv_heads=1, head_dim=4)
    pools = fill(allocate_pools(cfg), seed=1)
    k, _ = jax.jit(lambda p, t: gather_kv(p, 0, t, jnp.array([4])))(pools, jnp.array([[-2]], jnp.int32))
    assert not np.asarray(k).any()
    with pytest.raises(ValueError, match="block_table entries"):
        gather_kv(pools, 0, np.array([[-2]], np.int32), np.array([4], np.int32))


def test_concrete_bad_inputs_raise_and_leave_pools_usable():
    cfg = make_config(num_layers=2, attention_windows=None, primary_blocks=6, secondary_blocks=4)
    pools = fill(allocate_pools(cfg), seed=2)
    before = snapshot(pools)
    k = np.ones((2, 2, 8), np.float32)
    table, lens = np.array([[0, 1]], np.int32), np.array([5], np.int32)
    q = jnp.ones((1, 1, 2, 8), jnp.float32)
    null_first = cfg.pools[0].null_slot * cfg.tokens_per_block
    cases = [
        (lambda: write_kv(pools, 0, k, k, np.array([0, null_first], np.int32)), "null block"),
        (lambda: write_kv(pools, 0, k, k, np.array([0, 2**32 + 1], np.int64)), "outside int32"),
        (lambda: write_kv(pools, 0, k, k, np.array([0.0, 1.0])), "integer"),
        (lambda: write_kv(pools, 0, k, k, np.array([True, False])), "integer"),
        (lambda: gather_kv(pools, 0, np.array([[0, 2**33]], np.int64), lens), "outside int32"),
        (lambda: gather_kv(pools, 0, table.astype(np.float32), lens), "integer"),
        (lambda: gather_kv(pools, 0, table, np.array([2**40], np.int64)), "outside int32"),
        (lambda: paged_attention(q, pools, 0, table, lens, scale=float("nan")), "finite"),
        (lambda: paged_attention(q, pools, 0, table, lens, scale=float("inf")), "finite"),
        (lambda: paged_attention(q, pools, 0, table, lens, scale=True), "real number"),
        (lambda: paged_attention(q, pools, 0, table, lens, scale="0.5"), "real number"),
        (lambda: write_kv(pools, 2, k, k, np.array([0, 1], np.int32)), "layer"),
        (lambda: write_kv(pools, True, k, k, np.array([0, 1], np.int32)), "layer"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
    assert_pools_equal(pools, before)
    pools = write_kv(pools, 0, k, k, np.array([0, 1], np.int32))  # still usable (not donated by a failed call)


def test_bad_plans_are_rejected_before_anything_moves():
    cfg = make_config(num_layers=1, attention_windows=None, primary_blocks=6, secondary_blocks=4)
    pools = fill(allocate_pools(cfg), seed=3)
    before = snapshot(pools)
    K = TransferKind
    good = [(K.OFFLOAD, 0, 0, 1, 4), (K.COPY, 0, 2, 3, 2)]
    # the last entry is bad: nothing of the plan may have been applied
    with pytest.raises(ValueError, match="dst=6"):
        apply_transfers(pools, TransferPlan.from_ops(good + [(K.COPY, 0, 1, 6, 4)]), strategy="bulk")
    assert_pools_equal(pools, before)
    plan = TransferPlan.from_ops(good)
    for name, arr in (("src", np.array([0, 2**32 + 2], np.int64)), ("dst", np.array([1.0, 3.0])),
                      ("num_tokens", np.array([4, 2], np.uint64) * 2**62)):
        bad = TransferPlan.from_ops(good)
        object.__setattr__(bad, name, arr)  # arrays that bypassed TransferPlan's int32 cast
        with pytest.raises(ValueError, match=f"plan.{name}"):
            apply_transfers(pools, bad)
    assert_pools_equal(pools, before)
    apply_transfers(pools, plan)  # still usable


def test_checked_mode_reports_traced_inputs():
    cfg = make_config(num_layers=2, attention_windows=None, primary_blocks=6, secondary_blocks=0, num_kv_heads=2, head_dim=8)
    pools = fill(allocate_pools(cfg), seed=4)
    before = snapshot(pools)
    k = jnp.ones((2, 2, 8), jnp.float32)
    null_first = cfg.pools[0].null_slot * cfg.tokens_per_block
    bad_slots = jnp.array([0, null_first], jnp.int32)  # a device array: only checked mode can see it
    bad_table = jnp.array([[0, -3]], jnp.int32)
    lens = jnp.array([6], jnp.int32)
    # without checked mode: harmless (dropped / zeros), no error
    out = paged_attention(jnp.ones((1, 1, 2, 8)), pools, 0, bad_table, lens)
    assert np.isfinite(np.asarray(out)).all()
    with checked():
        # eager: validated before anything is donated; the pools stay usable
        with pytest.raises(ValueError, match="null block"):
            write_kv(pools, 0, k, k, bad_slots)
        with pytest.raises(ValueError, match="block_table entries"):
            gather_kv(pools, 0, bad_table, lens)
        with pytest.raises(ValueError, match="seq_lens"):
            paged_attention(jnp.ones((1, 1, 2, 8)), pools, 1, jnp.array([[0, 1]], jnp.int32), jnp.array([9], jnp.int32))
        with pytest.raises(ValueError, match="NaN"):
            write_kv(pools, 0, k * jnp.nan, k, jnp.array([0, 1], jnp.int32))
        assert_pools_equal(pools, before)
        pools = write_kv(pools, 0, k, k, jnp.array([0, 1], jnp.int32))  # good input passes

        # traced: the checks join the caller's computation; checkify functionalises them
        def step(p, slots, table, layer):
            p = write_kv(p, layer, k, k, slots)
            return p, paged_attention(jnp.ones((1, 1, 2, 8)), p, layer, table, lens)

        checked_step = jax.jit(checkify.checkify(step))
        err, _ = checked_step(pools, jnp.array([4, 5], jnp.int32), jnp.array([[0, 1]], jnp.int32), jnp.int32(1))
        assert err.get() is None
        err, _ = checked_step(pools, bad_slots, jnp.array([[0, 1]], jnp.int32), jnp.int32(1))
        assert "null block" in err.get()
        err, _ = checked_step(pools, jnp.array([4, 5], jnp.int32), bad_table, jnp.int32(0))
        assert "block_table entries" in err.get()
        err, _ = checked_step(pools, jnp.array([4, 5], jnp.int32), jnp.array([[0, 1]], jnp.int32), jnp.int32(7))
        assert "not in pool" in err.get()

        # inside a scan over layers
        def scan_step(p, layers):
            def body(p, layer):
                return write_kv(p, layer, k, k, bad_slots), None
            return jax.lax.scan(body, p, layers)[0]

        err, _ = jax.jit(checkify.checkify(scan_step))(pools, jnp.arange(2, dtype=jnp.int32))
        assert "null block" in err.get()
        with pytest.raises(ValueError, match="functionalized"):  # unwrapped traced checks are refused by JAX
            jax.jit(step)(pools, bad_slots, bad_table, jnp.int32(0))


def test_device_slot_helper_never_targets_the_null_block():
    table = jnp.array([[3, -1, 7, 9], [2, 9, 0, 100]], jnp.int32)  # num_slots 10: 9 is the null slot
    pos = jnp.array([[0, 5, 9, 14, 20], [1, 4, 8, 13, -1]], jnp.int32)
    write = jnp.array([[True] * 5, [True, True, True, True, False]])
    got = np.asarray(jax.jit(lambda t, p, w: slots_for_positions(t, p, w, tokens_per_block=4, num_slots=10))(table, pos, write))
    np.testing.assert_array_equal(got, [[12, -1, 29, -1, -1], [9, -1, 0, -1, -1]])
