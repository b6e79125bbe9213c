"""Scanning over layers: a hand-written attention stack (no kvjax model) run with
`jax.lax.scan` over stacked layer weights, carrying the pools, equals the same stack unrolled
in Python; the layer body and the device ops are traced once whatever the depth; several
pools need `pool=`; a traced layer outside its pool writes nothing and reads zeros."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_helpers import make_config

from kvjax.device import allocate_pools, gather_kv, paged_attention, step_inputs, write_kv
from kvjax.device import write as write_mod

D, K, N, H = 32, 2, 4, 16  # model width, kv heads, query heads, head dim


def init(depth, seed=0):
    rng = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(rng.standard_normal((depth,) + s) / np.sqrt(s[0]), jnp.float32)  # noqa: E731
    return {"wq": w(D, N, H), "wk": w(D, K, H), "wv": w(D, K, H), "wo": w(N * H, D).reshape(depth, N, H, D)}


def layer_step(p, x, pools, layer, table, seq_lens, slots, impl, pool=None):
    """One attention layer of a user's model. x: [B, T, D]."""
    b, t, _ = x.shape
    q = jnp.einsum("btd,dnh->btnh", x, p["wq"])  # [B, T, N, H]
    k = jnp.einsum("btd,dkh->btkh", x, p["wk"]).reshape(b * t, K, H)  # [B*T, K, H]
    v = jnp.einsum("btd,dkh->btkh", x, p["wv"]).reshape(b * t, K, H)  # [B*T, K, H]
    pools = write_kv(pools, layer, k, v, slots, impl=impl, pool=pool)
    o = paged_attention(q, pools, layer, table, seq_lens, impl=impl, pool=pool)  # [B, T, N, H]
    return x + jnp.einsum("btnh,nhd->btd", o, p["wo"]), pools


def unrolled(params, x, pools, table, seq_lens, slots, impl="xla"):
    for layer in range(params["wq"].shape[0]):
        p = jax.tree.map(lambda a: a[layer], params)  # noqa: B023  # mapped at once, not kept
        x, pools = layer_step(p, x, pools, layer, table, seq_lens, slots, impl)
    return x, pools


def scanned(params, x, pools, table, seq_lens, slots, impl="xla", body_hook=None):
    def body(carry, inputs):
        if body_hook is not None:
            body_hook()
        x, pools = carry
        p, layer = inputs
        x, pools = layer_step(p, x, pools, layer, table, seq_lens, slots, impl)
        return (x, pools), None

    layers = jnp.arange(params["wq"].shape[0], dtype=jnp.int32)
    (x, pools), _ = jax.lax.scan(body, (x, pools), (params, layers))
    return x, pools


def step_for(cfg, depth):
    """A prefill chunk of 3 and 5 tokens on top of 4 and 0 cached ones."""
    tpb = cfg.tokens_per_block
    table = np.array([[0, 1, 2], [3, 4, cfg.pools[0].null_slot]], np.int32)
    s = step_inputs(cfg, table, np.array([7, 5]), np.array([3, 5]), q_len=8, max_blocks=4)
    x = jnp.asarray(np.random.default_rng(depth).standard_normal((2, 8, D)), jnp.float32)
    assert tpb == 4
    return x, s


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_scanned_equals_unrolled(impl):
    depth = 4 if impl == "xla" else 2
    cfg = make_config(num_layers=depth, num_kv_heads=K, head_dim=H, attention_windows=None, primary_blocks=8,
                      secondary_blocks=0)
    params = init(depth)
    x, s = step_for(cfg, depth)
    args = (jnp.asarray(s.block_table), jnp.asarray(s.seq_lens), jnp.asarray(s.slots))
    y_u, pools_u = jax.jit(unrolled, static_argnames="impl", donate_argnums=2)(params, x, allocate_pools(cfg), *args, impl=impl)
    y_s, pools_s = jax.jit(scanned, static_argnames="impl", donate_argnums=2)(params, x, allocate_pools(cfg), *args, impl=impl)
    chex.assert_trees_all_close(y_s, y_u, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(pools_s.primary, pools_u.primary, atol=1e-6)
    chex.assert_shape(y_s, (2, 8, D))


def test_traced_once_for_any_depth():
    """Over depths 2, 4, 8 the scanned step traces its layer body (and write_kv's jitted
    core) once per depth, and its compiled program does not grow with depth; the unrolled
    step traces its body once per layer. Ops called with Python int layers share one
    executable per pool too (the layer is a traced index inside)."""
    traces = {"body": 0}

    def hook():
        traces["body"] += 1

    sizes = []
    for depth in (2, 4, 8):
        cfg = make_config(num_layers=depth, num_kv_heads=K, head_dim=H, attention_windows=None, primary_blocks=8,
                          secondary_blocks=0)
        params = init(depth)
        x, s = step_for(cfg, depth)
        args = (jnp.asarray(s.block_table), jnp.asarray(s.seq_lens), jnp.asarray(s.slots))
        before = traces["body"]
        orig = write_mod._write_xla
        chex.clear_trace_counter()
        write_mod._write_xla = chex.assert_max_traces(orig, n=1)
        try:
            jax.clear_caches()
            fn = jax.jit(lambda *a: scanned(*a, body_hook=hook), donate_argnums=2)
            lowered = fn.trace(params, x, allocate_pools(cfg), *args).lower()
            y, _ = lowered.compile()(params, x, allocate_pools(cfg), *args)
        finally:
            write_mod._write_xla = orig
        assert traces["body"] - before == 1, f"depth {depth}: body traced {traces['body'] - before} times"
        hlo = lowered.as_text()
        sizes.append((hlo.count("stablehlo.scatter"), hlo.count("stablehlo.while"), hlo.count("stablehlo.gather")))
        chex.assert_tree_all_finite(y)
    assert sizes[0] == sizes[1] == sizes[2] and min(sizes[0]) >= 1, sizes
    # unrolled, eager: the jitted core of write_kv is traced once for all layers of the pool
    cfg = make_config(num_layers=8, num_kv_heads=K, head_dim=H, attention_windows=None, primary_blocks=8, secondary_blocks=0)
    x, s = step_for(cfg, 8)
    orig = write_mod._write_xla
    chex.clear_trace_counter()
    write_mod._write_xla = chex.assert_max_traces(orig, n=1)
    try:
        jax.clear_caches()
        unrolled(init(8), x, allocate_pools(cfg), jnp.asarray(s.block_table), jnp.asarray(s.seq_lens), jnp.asarray(s.slots))
    finally:
        write_mod._write_xla = orig
        jax.clear_caches()


def test_several_pools_need_a_static_pool():
    """Layers 0-1 have 2 kv heads, 2-3 have 4: two pools. A traced layer must name its pool;
    scanning over the layers of one pool works; a layer outside that pool is a no-op."""
    cfg = make_config(num_layers=4, num_kv_heads=(2, 2, 4, 4), head_dim=H, attention_windows=None, primary_blocks=8,
                      secondary_blocks=0)
    assert len(cfg.pools) == 2
    pools = allocate_pools(cfg)
    k = jnp.ones((4, 2, H), jnp.float32)
    slots = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(ValueError, match="pool="):
        jax.jit(lambda p, layer: write_kv(p, layer, k, k, slots))(pools, jnp.int32(1))
    with pytest.raises(ValueError, match="belongs to pool 0"):
        write_kv(pools, 1, k, k, np.arange(4, dtype=np.int32), pool=1)

    def body(p, layer):
        return write_kv(p, layer, k * (layer + 1).astype(jnp.float32), k, slots, pool=0), None

    pools, _ = jax.lax.scan(body, pools, jnp.arange(2, dtype=jnp.int32))
    got = np.asarray(gather_kv(pools, 1, np.array([[0]], np.int32), np.array([4], np.int32))[0])
    np.testing.assert_array_equal(got, 2 * np.ones((1, 4, 2, H)))
    # layer 3 lives in pool 1: with pool=0 it is outside the pool: nothing written, zeros read
    before = [np.array(jnp.copy(a)) for a in pools.primary]
    pools = jax.jit(lambda p: write_kv(p, jnp.int32(3), k * 9, k, slots, pool=0))(pools)
    for a, b in zip(pools.primary, before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    out = jax.jit(lambda p: gather_kv(p, jnp.int32(3), jnp.zeros((1, 1), jnp.int32), jnp.array([4]), pool=0)[0])(pools)
    assert not np.asarray(out).any()
    for bad in (jnp.int32(-1), jnp.int32(4), jnp.int32(99)):
        out = jax.jit(lambda p, layer: gather_kv(p, layer, jnp.zeros((1, 1), jnp.int32), jnp.array([4]), pool=0)[0])(pools, bad)
        assert not np.asarray(out).any()
    with pytest.raises(ValueError, match="0-d integer"):
        write_kv(pools, jnp.float32(1.0), k, k, slots, pool=0)
