"""The XLA attention path's loop over steps of table columns (online softmax). Tables in the
other tests fit in one step; here a small step budget (`attention.CHUNK_BYTES`, patched) makes every
case run many steps: one or two columns per step (two on a 5-column table: a padded last
step), decode and prefill chunks, a sliding window (steps before it skipped), ragged and
empty rows, FP8 pools, K-only caches, traced layers and a layer outside its pool; each
against the reference. Also the step-range and step-size rules themselves, and one trace
per shape whatever the lengths (chex)."""
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_helpers import fill, make_config, random_tables

from kvjax.device import allocate_pools, attention, paged_attention, paged_attention_reference, write_kv
from kvjax.device.attention import xla_chunk_columns, xla_chunk_range

reference = jax.jit(paged_attention_reference, static_argnums=(2,), static_argnames=("scale",))
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float8_e4m3fn": 2e-5}
H = 16


def filled(cfg, seed):
    """Random K/V in every primary block (FP8 pools through `write_kv`, which sets the scales)."""
    pools = allocate_pools(cfg)
    if not pools.is_scaled:
        return fill(pools, seed)
    rng = np.random.default_rng(seed)
    for layer in range(cfg.num_layers):
        pool, _ = pools.locate(layer)
        sm = np.arange(pool.primary_blocks * cfg.tokens_per_block, dtype=np.int32)
        k = rng.standard_normal((sm.size, pool.num_kv_heads, H)).astype(np.float32) * (1 + layer)
        pools = write_kv(pools, layer, k, None if cfg.kv_factor == 1 else -0.5 * k + 1, sm)
    return pools


def step_budget(batch, columns_per_step, cfg, q_len, heads, kv_heads=2):
    """A CHUNK_BYTES that gives `columns_per_step` columns per step (`xla_chunk_columns`'s rule)."""
    item = 4 if cfg.dtype == "float32" else 2
    return batch * columns_per_step * kv_heads * cfg.tokens_per_block * max(H * item, heads // kv_heads * q_len * 4)


def steps_of(budget):
    """The XLA path's step budget, on any backend."""
    return mock.patch.multiple(attention, CHUNK_BYTES=budget, CHUNK_BYTES_ACCELERATOR=budget)


def check(pools, cfg, layer, table, lens, q, budget, tol):
    with steps_of(budget):
        out = paged_attention(q, pools, layer, table, lens, impl="xla")
    chex.assert_shape(out, q.shape)
    chex.assert_type(out, q.dtype)
    ref = reference(q, pools, layer, jnp.asarray(table), jnp.asarray(lens))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
    qpos = np.asarray(lens)[:, None] - q.shape[1] + np.arange(q.shape[1])[None]
    assert not np.asarray(out, np.float32)[qpos < 0].any(), "padding queries must return zeros"


@pytest.mark.parametrize("layout,dtype", [("block_first", "float32"), ("layer_first", "float32"),
                                          ("block_first", "bfloat16"), ("layer_first", "float8_e4m3fn")])
def test_many_steps_match_reference(layout, dtype):
    cfg = make_config(layout=layout, dtype=dtype, num_layers=2, num_kv_heads=2, head_dim=H, attention_windows=(48, 6))
    pools = filled(cfg, seed=7)
    qdtype = jnp.float32 if dtype == "float32" else jnp.bfloat16
    rng = np.random.default_rng(11)
    # global and 6-token-window layers; decode and 5-query chunks; 5 columns as 5 steps of
    # one, or 3 steps of two (the last padded)
    for layer, q_len, heads, per_step in ((0, 1, 4, 1), (0, 5, 8, 2), (1, 1, 4, 2), (1, 5, 8, 1)):
        pool, _ = pools.locate(layer)
        table, lens = random_tables(rng, pool, 4, 5, cfg.tokens_per_block)
        lens[1] = min(lens[1], q_len - 1)  # queries at negative positions
        lens[2] = 0  # an empty row
        q = jnp.asarray(rng.standard_normal((4, q_len, heads, H)), qdtype)
        budget = step_budget(4, per_step, cfg, q_len, heads)
        assert xla_chunk_columns(4, 5, budget // (4 * per_step), budget) == per_step
        check(pools, cfg, layer, table, lens, q, budget, TOL[dtype])


def test_long_rows_skip_steps_before_the_window_and_after_the_longest_row():
    """Rows of 45-47 tokens in a 12-column table, window 6: only the last steps hold visible
    keys. Entries in the skipped columns are garbage slots and out-of-pool values; the
    result must not depend on them (they are never gathered: the null slot would be)."""
    cfg = make_config(num_kv_heads=2, head_dim=H, attention_windows=(48, 6), primary_blocks=24)
    pools = filled(cfg, seed=8)
    rng = np.random.default_rng(12)
    pool, _ = pools.locate(1)
    table = rng.permutation(pool.primary_blocks)[:24].reshape(2, 12).astype(np.int32)
    lens = np.array([47, 45], np.int32)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, H)), jnp.float32)
    budget = step_budget(2, 1, cfg, 3, 4)
    lo, hi = xla_chunk_range(jnp.asarray(lens), 3, 6, 12, cfg.tokens_per_block)
    assert (int(lo), int(hi)) == (9, 12)  # keys 37.. are visible: steps 9, 10, 11 of 12
    check(pools, cfg, 1, table, lens, q, budget, TOL["float32"])
    with steps_of(budget):
        want = paged_attention(q, pools, 1, table, lens, impl="xla")
        table[:, :9] = rng.integers(0, pool.primary_blocks, (2, 9))  # other slots where no key is visible
        chex.assert_trees_all_equal(paged_attention(q, pools, 1, table, lens, impl="xla"), want)


def test_step_range():
    lens = jnp.array([40, 0, 13], jnp.int32)
    # oldest visible key: 34 (row 0), none (row 1), 7 (row 2); 4 positions per step; longest row 40
    assert tuple(int(x) for x in xla_chunk_range(lens, 1, 6, 12, 4)) == (1, 10)
    assert tuple(int(x) for x in xla_chunk_range(lens, 1, 48, 12, 4)) == (0, 10)  # global: from the start
    assert tuple(int(x) for x in xla_chunk_range(lens, 5, 6, 12, 4)) == (0, 10)  # a chunk reaches further back
    lo, hi = xla_chunk_range(jnp.zeros((3,), jnp.int32), 1, 6, 12, 4)
    assert int(lo) >= int(hi)  # no row holds a key: no step runs
    assert int(xla_chunk_range(jnp.array([48], jnp.int32), 1, 48, 6, 4)[1]) == 6  # the table ends first


def test_step_size():
    assert xla_chunk_columns(8, 64, 4096, 1 << 20) == 32  # 8 rows x 32 columns x 4 KiB = 1 MiB
    assert xla_chunk_columns(8, 64, 1 << 20, 1 << 20) == 1  # at least one column
    assert xla_chunk_columns(8, 5, 16, 1 << 20) == 5  # a narrow table: one step
    assert xla_chunk_columns(1, 5, 16, 32) == 2  # 3 steps, the last padded


def test_a_table_without_columns_gives_zeros():
    cfg = make_config(num_layers=2, num_kv_heads=2, head_dim=H)
    pools = fill(allocate_pools(cfg), seed=21)
    q = jnp.ones((2, 1, 4, H), jnp.float32)
    out = paged_attention(q, pools, 0, np.zeros((2, 0), np.int32), np.zeros(2, np.int32), impl="xla")
    chex.assert_trees_all_equal(out, jnp.zeros_like(q))


def test_k_only_cache_many_steps():
    cfg = make_config(num_kv_heads=2, head_dim=H, attention_windows=None, cache_type="self_k_only")
    pools = filled(cfg, seed=9)
    rng = np.random.default_rng(13)
    pool, _ = pools.locate(0)
    table, lens = random_tables(rng, pool, 3, 6, cfg.tokens_per_block)
    q = jnp.asarray(rng.standard_normal((3, 2, 4, H)), jnp.float32)
    check(pools, cfg, 0, table, lens, q, step_budget(3, 1, cfg, 2, 4), TOL["float32"])


def test_traced_layer_and_a_layer_outside_the_pool():
    """Two pools (2 and 4 kv heads); a traced layer of pool 0 matches the reference, and a
    traced layer outside it reads the null slot: zeros, never NaN."""
    cfg = make_config(num_layers=4, num_kv_heads=(2, 2, 4, 4), head_dim=H, attention_windows=None, primary_blocks=8,
                      secondary_blocks=0)
    pools = fill(allocate_pools(cfg), seed=10)
    rng = np.random.default_rng(14)
    pool, _ = pools.locate(1)
    table, lens = random_tables(rng, pool, 2, 4, cfg.tokens_per_block)
    lens[0] = 16
    q = jnp.asarray(rng.standard_normal((2, 1, 4, H)), jnp.float32)
    with steps_of(step_budget(2, 1, cfg, 1, 4)):
        run = jax.jit(lambda q, p, layer: paged_attention(q, p, layer, table, lens, pool=0, impl="xla"))
        out = run(q, pools, jnp.int32(1))
        outside = run(q, pools, jnp.int32(3))
    ref = reference(q, pools, 1, jnp.asarray(table), jnp.asarray(lens))
    chex.assert_trees_all_close(out, ref, atol=2e-5, rtol=2e-5)
    assert not np.asarray(outside).any() and np.isfinite(np.asarray(outside)).all()


class Variants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_steps_eager_and_jitted(self):
        cfg = make_config(num_layers=2, num_kv_heads=2, head_dim=H, attention_windows=(48, 6), dtype="bfloat16")
        pools = filled(cfg, seed=15)
        rng = np.random.default_rng(16)
        pool, _ = pools.locate(1)
        table, lens = random_tables(rng, pool, 4, 5, cfg.tokens_per_block)
        q = jnp.asarray(rng.standard_normal((4, 2, 4, H)), jnp.bfloat16)
        with steps_of(step_budget(4, 1, cfg, 2, 4)):
            out = self.variant(lambda q, p, t, s: paged_attention(q, p, 1, t, s, impl="xla"))(
                q, pools, jnp.asarray(table), jnp.asarray(lens))
        chex.assert_shape(out, (4, 2, 4, H))
        chex.assert_trees_all_close(out, reference(q, pools, 1, jnp.asarray(table), jnp.asarray(lens)),
                                    atol=2e-2, rtol=2e-2)


def test_one_trace_per_shape():
    """Lengths and tables change the steps the loop runs, not the program: one trace."""
    cfg = make_config(num_kv_heads=2, head_dim=H, attention_windows=(48, 6))
    pools = fill(allocate_pools(cfg), seed=17)
    rng = np.random.default_rng(18)
    pool, _ = pools.locate(1)
    q = jnp.asarray(rng.standard_normal((4, 1, 4, H)), jnp.float32)

    @chex.assert_max_traces(n=1)
    def step(q, pools, table, lens):
        return paged_attention(q, pools, 1, table, lens, impl="xla")

    run = jax.jit(step)
    with steps_of(step_budget(4, 1, cfg, 1, 4)):
        for _ in range(3):
            table, lens = random_tables(rng, pool, 4, 5, cfg.tokens_per_block)
            out = run(q, pools, jnp.asarray(table), jnp.asarray(lens))
            chex.assert_trees_all_close(out, reference(q, pools, 1, jnp.asarray(table), jnp.asarray(lens)),
                                        atol=2e-5, rtol=2e-5)


def test_sharded_kv_heads_many_steps():
    """Pools sharded over kv heads on 8 CPU devices: the loop's carries follow the heads; the
    result equals the single-device one, and the output stays sharded over heads."""
    if len(jax.devices()) < 8:
        pytest.fail("tests/conftest.py must provide 8 CPU devices")
    mesh = jax.make_mesh((8,), ("kv",))
    cfg = make_config(num_layers=2, num_kv_heads=8, head_dim=H, attention_windows=None, primary_blocks=8,
                      secondary_blocks=0)
    single = fill(allocate_pools(cfg), seed=19)
    sharded = allocate_pools(cfg, sharding=mesh)
    sharded = sharded.replace(primary=tuple(jax.device_put(np.asarray(a), b.sharding) + 0
                                            for a, b in zip(single.primary, sharded.primary, strict=True)))
    rng = np.random.default_rng(20)
    table, lens = random_tables(rng, cfg.pools[0], 4, 4, cfg.tokens_per_block)
    q = jnp.asarray(rng.standard_normal((4, 2, 16, H)), jnp.float32)
    with steps_of(step_budget(4, 1, cfg, 2, 16, kv_heads=8)):
        one = paged_attention(q, single, 1, table, lens, impl="xla")
        out = paged_attention(q, sharded, 1, table, lens, impl="xla")
    chex.assert_trees_all_close(out, one, atol=1e-6)
    chex.assert_trees_all_close(one, reference(q, single, 1, jnp.asarray(table), jnp.asarray(lens)), atol=2e-5, rtol=2e-5)
    assert out.sharding.spec[2] == "kv", out.sharding
