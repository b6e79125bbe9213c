"""Recurrent-state pools: geometry and sizing, read/write against their references (eager and
jitted, static and traced layers, a scan over layers), whole-slot transfers, a seeded random
driver of steps and plans against a numpy model of every slot, and bad input (typed errors,
nothing changed)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax import TransferKind, TransferPlan
from kvjax.device import checked
from kvjax.device import state_pools as sp
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
    validate_state_plan,
    write_states,
    write_states_reference,
)
from kvjax.errors import InvalidArgumentError, KVCacheError
from kvjax.models.hybrid.qwen3_5 import DeltaNetState, qwen35_spec_from_config

OFF, ON, CP = int(TransferKind.OFFLOAD), int(TransferKind.ONBOARD), int(TransferKind.COPY)


def geometry(primary=6, secondary=4, layers=3, **kw) -> StateGeometry:
    return StateGeometry.for_deltanet(num_layers=layers, conv_dim=6, conv_kernel=4, value_heads=2, key_dim=3, value_dim=4,
                                      dtype="bfloat16", primary_slots=primary, secondary_slots=secondary, **kw)


def host(pools: StatePools):
    """Host copies (through device copies: a numpy view of a pool array would block donation)."""
    return ([np.array(jnp.copy(a)) for a in pools.primary],
            [None if a is None else np.array(jnp.copy(a)) for a in pools.secondary])


def assert_host_equal(pools: StatePools, want) -> None:
    got = host(pools)
    for tier, (gs, ws) in enumerate(zip(got, want, strict=True)):
        for i, (g, w) in enumerate(zip(gs, ws, strict=True)):
            if w is not None:
                np.testing.assert_array_equal(g, w, err_msg=f"tier {tier} field {i}")


def random_values(rng, geo: StateGeometry, batch: int):
    """Values exactly representable in every field dtype (multiples of 1/8 in [-4, 4))."""
    return {f.name: jnp.asarray(rng.integers(-32, 32, (batch, *f.shape)) / 8, f.jnp_dtype) for f in geo.fields}


def filled(geo: StateGeometry, seed: int) -> StatePools:
    """Pools with every real slot (both tiers) written through the ops themselves."""
    rng = np.random.default_rng(seed)
    pools = allocate_state_pools(geo)
    for layer in range(geo.num_layers):
        pools = write_states(pools, layer, np.arange(geo.primary_slots, dtype=np.int32),
                             random_values(rng, geo, geo.primary_slots))
    if geo.secondary_slots:
        ops = [(OFF, geo.plan_pool, s % geo.primary_slots, s, geo.tokens_per_block) for s in range(geo.secondary_slots)]
        pools = apply_state_transfers(pools, TransferPlan.from_ops(ops))
        for layer in range(geo.num_layers):  # the primary tier differs from what went to the host
            pools = write_states(pools, layer, np.arange(geo.primary_slots, dtype=np.int32),
                                 random_values(rng, geo, geo.primary_slots))
    return pools


# ----------------------------------------------------------------------------- geometry
def test_geometry_shapes_placement_and_sizing():
    geo = geometry()
    pools = allocate_state_pools(geo)
    chex.assert_shape(pools.primary, [(7, 3, 3, 6), (7, 3, 2, 3, 4)])  # [N+1, L, *field]
    chex.assert_shape(pools.secondary, [(4, 3, 3, 6), (4, 3, 2, 3, 4)])
    assert [a.dtype for a in pools.primary] == [jnp.bfloat16, jnp.float32]
    assert all(a.sharding.memory_kind == "device" for a in pools.primary)
    assert all(a.sharding.memory_kind == "pinned_host" for a in pools.secondary)
    assert geo.null_slot == 6 and geo.num_slots == 7 and geo.names == ("conv", "recurrent")
    layer = 3 * 6 * 2 + 2 * 3 * 4 * 4  # conv bf16 + recurrent f32
    assert geo.layer_bytes == layer and geo.slot_bytes == 3 * layer
    assert geo.pool_bytes() == (7 * 3 * layer, 4 * 3 * layer) and pools.nbytes == sum(geo.pool_bytes())
    assert geo.pool_bytes(99, 0) == (100 * 3 * layer, 0)
    assert geo.max_slots(10 * geo.slot_bytes + 1) == 9 and geo.max_slots(geo.slot_bytes) == 0
    none = allocate_state_pools(geometry(secondary=0))
    assert none.secondary == (None, None)
    assert hash(geo) == hash(geometry()) and geo == geometry()  # static jit key


def test_deltanet_fields_match_the_model_state():
    """A read is one `DeltaNetState` of the model (conv `[B, K-1, C]`, recurrent f32)."""
    geo = geometry()
    got = read_states(allocate_state_pools(geo), 0, np.array([6, 6], np.int32))
    state = DeltaNetState(**got)
    chex.assert_shape(state.conv, (2, 3, 6))
    chex.assert_shape(state.recurrent, (2, 2, 3, 4))
    chex.assert_type(state.recurrent, jnp.float32)


def test_geometry_for_a_ledger_pool():
    """Slot ids, host slots, layers and the plan's pool index come from the ledger's pool."""
    from kvjax import CacheConfig

    cfg = CacheConfig(tokens_per_block=4, num_layers=5, num_kv_heads=2, head_dim=8, max_seq_len=32, primary_blocks=9,
                      secondary_blocks=3, attention_windows=(32, 8))
    pool = cfg.pools[1]
    geo = StateGeometry.for_pool(pool, (StateField("ssm", (2, 3)),), tokens_per_block=4)
    assert pool.layers == (0, 2, 4)  # window 32 sorts after window 8
    assert (geo.num_layers, geo.primary_slots, geo.secondary_slots, geo.plan_pool) == (3, 9, 3, 1)
    assert geo.null_slot == pool.null_slot and geo.tokens_per_block == 4
    pools = allocate_state_pools(geo)
    before = host(pools)
    pools = apply_state_transfers(pools, TransferPlan.from_ops([(OFF, 1, 8, 2, 4), (CP, 1, 0, 8, 4)]))
    assert_host_equal(pools, before)  # all zeros still, but the ledger's entries were accepted
    with pytest.raises(InvalidArgumentError, match="PoolSpec"):
        StateGeometry.for_pool(cfg, (StateField("ssm", (2,)),), tokens_per_block=4)


def test_slot_bytes_match_the_qwen35_spec():
    """Sizing agrees with the model's own count: Qwen3.5's default text config (24 DeltaNet
    layers of 32 value heads x 128 x 128 float32 plus a bf16 conv of 3 x 8192)."""
    spec = qwen35_spec_from_config({"model_type": "qwen3_5_text", "torch_dtype": "bfloat16"})
    geo = StateGeometry.for_deltanet(num_layers=len(spec.linear_layers), conv_dim=spec.conv_channels,
                                     conv_kernel=spec.conv_kernel, value_heads=spec.linear_num_value_heads,
                                     key_dim=spec.linear_key_head_dim, value_dim=spec.linear_value_head_dim,
                                     dtype=spec.dtype, primary_slots=1)
    assert geo.slot_bytes == spec.state_bytes(0)["linear_attention"] == 51_511_296
    assert geo.layer_bytes == 2_146_304  # what CacheConfig.recurrent_state_bytes takes
    assert geo.max_slots(16 * 2**30) == 332


@pytest.mark.parametrize("kw, match", [
    (dict(fields=()), "non-empty"),
    (dict(fields=(StateField("a", (2,)), StateField("a", (3,)))), "distinct"),
    (dict(num_layers=0), "num_layers"),
    (dict(primary_slots=0), "primary_slots"),
    (dict(secondary_slots=-1), "secondary_slots"),
    (dict(primary_slots=True), "primary_slots"),
    (dict(tokens_per_block=0), "tokens_per_block"),
])
def test_bad_geometry_is_typed(kw, match):
    base = dict(fields=(StateField("ssm", (2, 3)),), num_layers=2, primary_slots=4)
    with pytest.raises(InvalidArgumentError, match=match):
        StateGeometry(**{**base, **kw})


@pytest.mark.parametrize("args", [("x-y", (2,), "float32"), ("a", (0,), "float32"), ("a", (2,), "int8"),
                                  ("a", 3, "float32")])
def test_bad_field_is_typed(args):
    with pytest.raises(InvalidArgumentError):
        StateField(*args)


# ------------------------------------------------------------------------- read / write
class StateOpsVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_write_then_read_matches_reference(self):
        geo = geometry()
        rng = np.random.default_rng(1)
        pools = filled(geo, seed=1)
        slots = jnp.array([4, -1, 0, 2], jnp.int32)
        vals = random_values(rng, geo, 4)
        want = host(write_states_reference(pools, 2, np.asarray(slots), vals))
        write = self.variant(lambda p, layer, s, v: write_states(p, layer, s, v))
        pools = write(pools, jnp.int32(2), slots, vals)  # a device-array (or traced) layer
        assert_host_equal(pools, want)
        reads = jnp.array([4, 6, 0, 1, 6], jnp.int32)
        got = self.variant(lambda p, layer, s: read_states(p, layer, s))(pools, jnp.int32(2), reads)
        chex.assert_shape([got["conv"], got["recurrent"]], [(5, 3, 6), (5, 2, 3, 4)])
        chex.assert_trees_all_equal(got, read_states_reference(pools, 2, np.asarray(reads)))
        chex.assert_trees_all_close(got["recurrent"][0], vals["recurrent"][0])  # written slot 4
        chex.assert_trees_all_equal(got["conv"][1], jnp.zeros((3, 6), jnp.bfloat16))  # the null slot

    @chex.variants(with_jit=True, without_jit=True)
    def test_values_cast_to_field_dtype(self):
        geo = geometry()
        pools = allocate_state_pools(geo)
        vals = {"conv": jnp.full((1, 3, 6), 1.5, jnp.float32), "recurrent": jnp.full((1, 2, 3, 4), 0.25, jnp.bfloat16)}
        pools = self.variant(lambda p, v: write_states(p, 1, np.array([3], np.int32), v))(pools, vals)
        got = read_states(pools, 1, np.array([3], np.int32))
        chex.assert_type([got["conv"], got["recurrent"]], [jnp.bfloat16, jnp.float32])
        chex.assert_trees_all_close(got, {"conv": jnp.full((1, 3, 6), 1.5, jnp.bfloat16),
                                          "recurrent": jnp.full((1, 2, 3, 4), 0.25, jnp.float32)})


def test_scan_over_layers_copy_forward_compiles_once():
    """The pattern a hybrid step uses: one jitted scan over the recurrent layers reads each
    row's state (the null slot for a fresh row) and writes the next one elsewhere; traced
    once for every layer and slot choice, and the snapshot read from is left as it was."""
    geo = geometry()
    pools = filled(geo, seed=2)
    before = host(pools)

    def step(pools, reads, writes, delta):
        def body(p, layer):
            st = read_states(p, layer, reads)  # {field: [B, ...]}
            nxt = {k: v.astype(jnp.float32) * 0.5 + delta for k, v in st.items()}
            return write_states(p, layer, writes, nxt), st["recurrent"]

        return jax.lax.scan(body, pools, jnp.arange(geo.num_layers))

    run = jax.jit(chex.assert_max_traces(step, n=1), donate_argnums=0)
    for reads, writes, delta in (([2, 6, 5], [0, 1, -1], 1.0), ([0, 6, 0], [3, 4, 5], -2.0)):
        r, w = np.array(reads, np.int32), np.array(writes, np.int32)
        prim, sec = host(pools)
        pools, seen = run(pools, r, w, jnp.float32(delta))
        chex.assert_shape(seen, (geo.num_layers, 3, 2, 3, 4))
        for i, f in enumerate(geo.fields):
            exp = prim[i].copy()
            for b in range(3):
                if w[b] >= 0:
                    exp[w[b]] = (prim[i][r[b]].astype(np.float32) * 0.5 + delta).astype(exp.dtype)
            np.testing.assert_array_equal(host(pools)[0][i], exp, err_msg=f.name)
            np.testing.assert_array_equal(host(pools)[0][i][geo.null_slot], 0)
        np.testing.assert_array_equal(np.asarray(seen)[:, 1], 0)  # the fresh row read zeros
    np.testing.assert_array_equal(host(pools)[0][1][2], before[0][1][2])  # snapshot slot 2: read, never written
    assert all(a.sharding.memory_kind == "pinned_host" for a in pools.secondary)  # through the user's jit
    assert_host_equal(pools, ([None, None], before[1]))  # the host tier is untouched by steps


def test_eager_ops_share_one_executable_across_layers_and_slots():
    geo = geometry()
    pools = filled(geo, seed=3)
    rng = np.random.default_rng(3)
    read_states(pools, 0, np.array([1, 2], np.int32))
    pools = write_states(pools, 0, np.array([1, 2], np.int32), random_values(rng, geo, 2))
    sizes = sp._read._cache_size(), sp._write._cache_size()
    for layer in range(geo.num_layers):
        read_states(pools, layer, np.array([6, layer], np.int32))
        pools = write_states(pools, layer, np.array([-1, layer + 3], np.int32), random_values(rng, geo, 2))
    assert (sp._read._cache_size(), sp._write._cache_size()) == sizes


def test_write_donates_and_read_does_not():
    geo = geometry()
    pools = filled(geo, seed=4)
    old = pools.primary
    read_states(pools, 0, np.array([0], np.int32))
    assert not any(a.is_deleted() for a in old)
    pools = write_states(pools, 0, np.array([0], np.int32), random_values(np.random.default_rng(0), geo, 1))
    assert all(a.is_deleted() for a in old)
    old = pools.primary
    pools = apply_state_transfers(pools, TransferPlan.from_ops([(CP, 0, 0, 1, 1)]))
    assert all(a.is_deleted() for a in old)


# ---------------------------------------------------------------------------- transfers
def test_transfers_match_reference_and_keep_memory_kinds():
    geo = geometry()
    pools = filled(geo, seed=5)
    plan = TransferPlan.from_ops([(OFF, 0, 1, 0, 1), (OFF, 0, 5, 3, 1), (CP, 0, 5, 1, 1), (ON, 0, 0, 5, 1),
                                  (ON, 0, 2, 2, 1), (CP, 0, 2, 0, 1), (OFF, 0, 0, 2, 1)])
    want = host(apply_state_transfers_reference(pools, plan))
    pools = apply_state_transfers(pools, plan)
    assert_host_equal(pools, want)
    assert all(a.sharding.memory_kind == "pinned_host" for a in pools.secondary)
    assert all(a.sharding.memory_kind == "device" for a in pools.primary)
    for a in want[0]:
        np.testing.assert_array_equal(a[geo.null_slot], 0)


@st.composite
def state_plans(draw, primary=6, secondary=4):
    ops = []
    for _ in range(draw(st.integers(0, 9))):
        kind = draw(st.sampled_from([OFF, ON, CP]))
        src = draw(st.integers(0, (secondary if kind == ON else primary) - 1))
        dst = draw(st.integers(0, (secondary if kind == OFF else primary) - 1))
        ops.append((kind, 0, src, dst, 1))
    return TransferPlan.from_ops(ops)


_FILLED: dict = {}


@settings(max_examples=20, deadline=None)
@given(plan=state_plans())
def test_plan_equals_one_by_one(plan):
    """Any plan (hazards included: a slot written, then read, then overwritten) equals its
    entries applied one by one."""
    if "want" not in _FILLED:
        _FILLED["want"] = host(filled(geometry(), seed=9))
    prim, sec = _FILLED["want"]
    geo = geometry()
    pools = StatePools(tuple(jnp.array(a) for a in prim),
                       tuple(jax.device_put(a, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
                             for a in sec), geo)
    want = host(apply_state_transfers_reference(pools, plan))
    assert_host_equal(apply_state_transfers(pools, plan), want)


def test_transfer_runs_compile_per_bucket():
    geo = geometry()
    pools = filled(geo, seed=6)
    pools = apply_state_transfers(pools, TransferPlan.from_ops([(CP, 0, 0, 1, 1), (CP, 0, 2, 3, 1), (CP, 0, 1, 4, 1)]))
    size = sp._run._cache_size()
    for ops in ([(CP, 0, 3, 0, 1), (CP, 0, 4, 5, 1), (CP, 0, 5, 2, 1), (CP, 0, 1, 3, 1)],  # bucket 4 again
                [(CP, 0, 5, 0, 1), (CP, 0, 0, 5, 1), (CP, 0, 2, 1, 1)]):
        pools = apply_state_transfers(pools, TransferPlan.from_ops(ops))
    assert sp._run._cache_size() == size


def test_split_state_plan_keeps_order():
    plan = TransferPlan.from_ops([(OFF, 0, 1, 0, 4), (CP, 2, 1, 2, 1), (ON, 1, 0, 3, 4), (OFF, 2, 4, 1, 1)])
    plan = TransferPlan(plan.kind, plan.pool, plan.src, plan.dst, plan.num_tokens, seq=7)
    mine, rest = split_state_plan(plan, 2)
    assert list(mine) == [tuple(plan)[1], tuple(plan)[3]] and list(rest) == [tuple(plan)[0], tuple(plan)[2]]
    assert mine.seq == rest.seq == 7
    geo = geometry(plan_pool=2)
    validate_state_plan(geo, mine)
    with pytest.raises(InvalidArgumentError, match="split_state_plan"):
        validate_state_plan(geo, plan)


# --------------------------------------------------------------------- random driver
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_steps_and_plans_against_a_slot_model(seed):
    """Steps (each row reads a slot, the null one included, and writes the next state to a
    free slot or skips), copy-forward snapshots, offloads, onboards and copies, checked after
    every action against a numpy model of every slot: the null slot stays zero, and a
    snapshot, written once, never changes while later steps and plans write elsewhere."""
    rng = np.random.default_rng(seed)
    geo = geometry(primary=8, secondary=5, layers=2, tokens_per_block=4, plan_pool=1)
    pools = allocate_state_pools(geo)
    model = host(pools)
    frozen: dict[int, list[np.ndarray]] = {}  # primary snapshot slot -> its fields, as first written
    for _ in range(12):
        if rng.random() < 0.6:  # a step over every layer
            batch = int(rng.integers(1, 4))
            reads = rng.choice(np.append(np.arange(geo.primary_slots), [geo.null_slot] * 3), batch).astype(np.int32)
            free = [s for s in range(geo.primary_slots) if s not in frozen and s not in reads]
            writes = np.full(batch, -1, np.int32)
            take = rng.permutation(free)[: batch]
            for b, s in enumerate(take):
                if rng.random() < 0.8:
                    writes[b] = s
            for layer in range(geo.num_layers):
                got = read_states(pools, layer, reads)
                for i, f in enumerate(geo.fields):
                    np.testing.assert_array_equal(np.asarray(got[f.name]), model[0][i][reads, layer])
                vals = random_values(rng, geo, batch)
                pools = write_states(pools, layer, writes, vals)
                for i, f in enumerate(geo.fields):
                    for b in range(batch):
                        if writes[b] >= 0:
                            model[0][i][writes[b], layer] = np.asarray(vals[f.name][b])
            for s in writes[writes >= 0][: 1]:  # the first written slot becomes a kept snapshot
                frozen[int(s)] = [a[s].copy() for a in model[0]]
        else:  # a plan: offloads of any slot, onboards and copies into non-snapshot slots
            ops = []
            for _ in range(int(rng.integers(1, 6))):
                kind = int(rng.choice([OFF, ON, CP]))
                targets = [s for s in range(geo.primary_slots) if s not in frozen] if kind != OFF else range(geo.secondary_slots)
                if not targets:
                    continue
                src = int(rng.integers(0, geo.secondary_slots if kind == ON else geo.primary_slots))
                dst = int(rng.choice(list(targets)))
                ops.append((kind, 1, src, dst, 4))
                for i in range(len(geo.fields)):
                    src_a = model[1][i] if kind == ON else model[0][i]
                    dst_a = model[1][i] if kind == OFF else model[0][i]
                    dst_a[dst] = src_a[src].copy()
            pools = apply_state_transfers(pools, TransferPlan.from_ops(ops))
        assert_host_equal(pools, model)
        prim = host(pools)[0]
        for i in range(len(geo.fields)):
            np.testing.assert_array_equal(prim[i][geo.null_slot], 0)
            for s, fields in frozen.items():
                np.testing.assert_array_equal(prim[i][s], fields[i], err_msg=f"snapshot slot {s} changed")
    assert frozen  # the driver did take snapshots


# -------------------------------------------------------------------------- bad input
BAD_CALLS = {
    "read slot -1": lambda p, v: read_states(p, 0, np.array([0, -1], np.int32)),
    "read past null": lambda p, v: read_states(p, 0, np.array([7], np.int32)),
    "read float slots": lambda p, v: read_states(p, 0, np.array([0.0])),
    "read 2-D slots": lambda p, v: read_states(p, 0, np.zeros((1, 1), np.int32)),
    "read int64 overflow": lambda p, v: read_states(p, 0, np.array([2**40])),
    "read layer 3": lambda p, v: read_states(p, 3, np.array([0], np.int32)),
    "read layer -1": lambda p, v: read_states(p, -1, np.array([0], np.int32)),
    "read bool layer": lambda p, v: read_states(p, True, np.array([0], np.int32)),
    "read float layer": lambda p, v: read_states(p, jnp.float32(0), np.array([0], np.int32)),
    "read not pools": lambda p, v: read_states(p.primary, 0, np.array([0], np.int32)),
    "write null slot": lambda p, v: write_states(p, 0, np.array([1, 6], np.int32), v),
    "write past null": lambda p, v: write_states(p, 0, np.array([1, 9], np.int32), v),
    "write slot -2": lambda p, v: write_states(p, 0, np.array([1, -2], np.int32), v),
    "write repeated slot": lambda p, v: write_states(p, 0, np.array([3, 3], np.int32), v),
    "write batch mismatch": lambda p, v: write_states(p, 0, np.array([3], np.int32), v),
    "write layer 3": lambda p, v: write_states(p, 3, np.array([0, 1], np.int32), v),
    "write missing field": lambda p, v: write_states(p, 0, np.array([0, 1], np.int32), {"conv": v["conv"]}),
    "write extra field": lambda p, v: write_states(p, 0, np.array([0, 1], np.int32), {**v, "x": v["conv"]}),
    "write wrong shape": lambda p, v: write_states(p, 0, np.array([0, 1], np.int32),
                                                   {**v, "conv": v["conv"][:, :2]}),
    "write ragged batch": lambda p, v: write_states(p, 0, np.array([0, 1], np.int32),
                                                    {**v, "recurrent": v["recurrent"][:1]}),
    "write int values": lambda p, v: write_states(p, 0, np.array([0, 1], np.int32),
                                                  {**v, "conv": v["conv"].astype(jnp.int32)}),
    "write values not a mapping": lambda p, v: write_states(p, 0, np.array([0, 1], np.int32), list(v.values())),
    "plan not a plan": lambda p, v: apply_state_transfers(p, [(CP, 0, 0, 1, 1)]),
    "plan other pool": lambda p, v: apply_state_transfers(p, TransferPlan.from_ops([(CP, 0, 0, 1, 1), (CP, 1, 0, 1, 1)])),
    "plan partial": lambda p, v: apply_state_transfers(p, TransferPlan.from_ops([(CP, 0, 0, 1, 1), (CP, 0, 1, 2, 2)])),
    "plan copy from null": lambda p, v: apply_state_transfers(p, TransferPlan.from_ops([(CP, 0, 6, 1, 1)])),
    "plan copy to null": lambda p, v: apply_state_transfers(p, TransferPlan.from_ops([(CP, 0, 1, 0, 1), (CP, 0, 1, 6, 1)])),
    "plan offload past host": lambda p, v: apply_state_transfers(p, TransferPlan.from_ops([(OFF, 0, 1, 4, 1)])),
    "plan onboard past host": lambda p, v: apply_state_transfers(p, TransferPlan.from_ops([(ON, 0, 4, 1, 1)])),
    "plan negative": lambda p, v: apply_state_transfers(p, TransferPlan.from_ops([(ON, 0, -1, 1, 1)])),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_input_is_typed_and_changes_nothing(name):
    geo = geometry()
    pools = filled(geo, seed=7)
    before = host(pools)
    vals = random_values(np.random.default_rng(7), geo, 2)
    with pytest.raises(InvalidArgumentError) as e:
        BAD_CALLS[name](pools, vals)
    assert isinstance(e.value, KVCacheError) and isinstance(e.value, ValueError)
    assert not any(a.is_deleted() for a in (*pools.primary, *pools.secondary))
    assert_host_equal(pools, before)


def test_no_host_tier_refuses_offload_and_onboard():
    pools = allocate_state_pools(geometry(secondary=0))
    for op in ((OFF, 0, 0, 0, 1), (ON, 0, 0, 0, 1)):
        with pytest.raises(InvalidArgumentError, match="no host tier"):
            apply_state_transfers(pools, TransferPlan.from_ops([op]))
    pools = apply_state_transfers(pools, TransferPlan.from_ops([(CP, 0, 0, 1, 1)]))  # copies need no host tier


def test_device_slots_out_of_range_are_dropped_or_reported_in_checked_mode():
    """Device arrays are not synced for checks: a bad write slot is dropped (never clamped
    into a neighbour), a bad read slot reads zeros; checked mode reports both before anything
    is donated."""
    geo = geometry()
    pools = filled(geo, seed=8)
    before = host(pools)
    vals = random_values(np.random.default_rng(8), geo, 2)
    pools = write_states(pools, 0, jnp.array([6, 9], jnp.int32), vals)  # null slot and beyond: dropped
    assert_host_equal(pools, before)
    got = read_states(pools, 0, jnp.array([-1, 7, 5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got["recurrent"][:2]), 0)  # no wrap to slot 5 / clamp to 6
    np.testing.assert_array_equal(np.asarray(got["recurrent"][2]), before[0][1][5, 0])
    with checked():
        with pytest.raises(ValueError, match="write_states: write slot 6 "):
            write_states(pools, 0, jnp.array([1, 6], jnp.int32), vals)
        with pytest.raises(ValueError, match="read_states: read slot -1 "):
            read_states(pools, 0, jnp.array([-1], jnp.int32))
        with pytest.raises(ValueError, match="layer"):
            write_states(pools, jnp.int32(5), jnp.array([1, 2], jnp.int32), vals)
        pools = write_states(pools, 0, jnp.array([1, -1], jnp.int32), vals)  # valid: goes through
    assert not any(a.is_deleted() for a in pools.primary)
    np.testing.assert_array_equal(host(pools)[0][1][1, 0], np.asarray(vals["recurrent"][0]))
