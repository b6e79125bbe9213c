"""write_kv and gather_kv against their references: layouts, dtypes, impls, padding, ragged
lengths, K-only caches; donation is real; bucketed shapes do not retrace; bad input errors."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_helpers import DTYPES, LAYOUTS, assert_pools_equal, fill, make_config, random_tables, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.device import allocate_pools, gather_kv, gather_kv_reference, write_kv, write_kv_reference
from kvjax.device import gather as gather_mod
from kvjax.device import write as write_mod

IMPLS = ("xla", "pallas")


def _tokens(rng, pool, n, tpb, dtype):
    """Distinct random (slot, offset) targets (null slot excluded), some padding entries."""
    flat = rng.choice(pool.primary_blocks * tpb, n, replace=False).astype(np.int32)
    flat[rng.random(n) < 0.2] = -1
    k = jnp.asarray(rng.standard_normal((n, pool.num_kv_heads, pool.head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((n, pool.num_kv_heads, pool.head_dim)), dtype)
    return k, v, flat


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_matches_reference(layout, dtype, impl):
    rng = np.random.default_rng(hash((layout, dtype, impl)) % 2**32)
    cfg = make_config(layout=layout, dtype=dtype)
    pools = fill(allocate_pools(cfg), seed=1)
    for layer in (0, 1, 2):
        pool, _ = pools.locate(layer)
        k, v, sm = _tokens(rng, pool, 9, cfg.tokens_per_block, dtype)
        expected = snapshot(write_kv_reference(pools, layer, k, v, jnp.asarray(sm)))
        ptr = pools.primary[pool.index].unsafe_buffer_pointer()
        pools = write_kv(pools, layer, k, v, sm, impl=impl)
        assert pools.primary[pool.index].unsafe_buffer_pointer() == ptr, "write must be in place (donated)"
        assert_pools_equal(pools, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_matches_reference(layout, dtype, impl):
    rng = np.random.default_rng(hash((layout, dtype, impl, 1)) % 2**32)
    cfg = make_config(layout=layout, dtype=dtype)
    pools = fill(allocate_pools(cfg), seed=2)
    for layer in (0, 1):
        pool, _ = pools.locate(layer)
        table, lens = random_tables(rng, pool, 3, 5, cfg.tokens_per_block)
        k, v = gather_kv(pools, layer, table, lens, impl=impl)
        kr, vr = gather_kv_reference(pools, layer, jnp.asarray(table), jnp.asarray(lens))
        chex.assert_shape(k, (3, 5 * cfg.tokens_per_block, pool.num_kv_heads, pool.head_dim))
        chex.assert_type(k, jnp.dtype(dtype))
        np.testing.assert_array_equal(np.asarray(k), np.asarray(kr))
        np.testing.assert_array_equal(np.asarray(v), np.asarray(vr))
        for b in range(3):  # the tail past seq_len reads as zeros
            assert not np.asarray(k[b, lens[b]:], np.float32).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_write_then_gather_roundtrip_k_only(impl):
    cfg = make_config(cache_type="self_k_only", attention_windows=None, primary_blocks=6)
    pools = allocate_pools(cfg)
    pool = cfg.pools[0]
    k = jnp.arange(2 * 7 * 2 * 8, dtype=jnp.float32).reshape(14, 2, 8)
    # request 0 holds slots 4, 1 (7 tokens); request 1 holds slot 2 (3 tokens) then 4 padding tokens
    sm = np.array([16, 17, 18, 19, 4, 5, 6, 8, 9, 10, -1, -1, -1, -1], np.int32)
    pools = write_kv(pools, 1, k, None, sm, impl=impl)
    table = np.array([[4, 1], [2, pool.null_slot]], np.int32)
    kk, vv = gather_kv(pools, 1, table, np.array([7, 3], np.int32), impl=impl)
    assert vv is None
    np.testing.assert_array_equal(np.asarray(kk[0, :7]), np.asarray(k[:7]))
    np.testing.assert_array_equal(np.asarray(kk[1, :3]), np.asarray(k[7:10]))
    assert not np.asarray(kk[1, 3:]).any()


def test_bucketed_steps_do_not_retrace():
    cfg = make_config()
    pools = allocate_pools(cfg)
    rng = np.random.default_rng(0)
    pool, _ = pools.locate(0)
    orig_g, orig_w = gather_mod._gather_xla, write_mod._write_xla
    gather_mod._gather_xla = chex.assert_max_traces(orig_g, n=1)
    write_mod._write_xla = chex.assert_max_traces(orig_w, n=1)
    try:
        jax.clear_caches()
        for _step in range(4):
            table, lens = random_tables(rng, pool, 4, 8, cfg.tokens_per_block)
            k, v, sm = _tokens(rng, pool, 8, cfg.tokens_per_block, "float32")
            pools = write_kv(pools, 0, k, v, sm, impl="xla")
            gather_kv(pools, 0, table, lens, impl="xla")
    finally:
        gather_mod._gather_xla, write_mod._write_xla = orig_g, orig_w
        jax.clear_caches()


def test_bad_input():
    cfg = make_config()
    pools = allocate_pools(cfg)
    k = jnp.zeros((3, 2, 8))
    with pytest.raises(ValueError, match="k.shape"):
        write_kv(pools, 0, jnp.zeros((3, 4, 8)), k, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(pools, 0, k, k, np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="slot_mapping has entries"):
        write_kv(pools, 0, k, k, np.array([0, 1, 11 * 4], np.int32))
    with pytest.raises(ValueError, match="v is required"):
        write_kv(pools, 0, k, None, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="layer"):
        write_kv(pools, 7, k, k, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="impl"):
        write_kv(pools, 0, k, k, np.zeros(3, np.int32), impl="cuda")
    with pytest.raises(ValueError, match="block_table entries"):
        gather_kv(pools, 0, np.array([[11]], np.int32), np.array([1], np.int32))
    with pytest.raises(ValueError, match="seq_lens"):
        gather_kv(pools, 0, np.array([[1]], np.int32), np.array([5], np.int32))
    with pytest.raises(ValueError, match="seq_lens.shape"):
        gather_kv(pools, 0, np.array([[1]], np.int32), np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="KVPools"):
        gather_kv(pools.primary, 0, np.array([[1]], np.int32), np.array([1], np.int32))


@settings(max_examples=5)
@given(
    tpb=st.sampled_from([1, 2, 4, 8]),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 4, 6]),
    layers=st.integers(1, 3),
    batch=st.integers(1, 3),
    max_blocks=st.integers(1, 4),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
)
def test_random_shapes_roundtrip(tpb, heads, head_dim, layers, batch, max_blocks, layout, dtype):
    """Random geometry: write every live position of every request, gather it back."""
    cfg = make_config(layout=layout, dtype=dtype, tokens_per_block=tpb, num_kv_heads=heads, head_dim=head_dim,
                      num_layers=layers, attention_windows=None, primary_blocks=batch * max_blocks + 1)
    rng = np.random.default_rng(tpb * 1000 + heads * 100 + head_dim * 10 + layers)
    pools = fill(allocate_pools(cfg), seed=tpb)
    pool = cfg.pools[0]
    table, lens = random_tables(rng, pool, batch, max_blocks, tpb, disjoint=True)
    layer = layers - 1
    pos = [(b, p) for b in range(batch) for p in range(lens[b])]
    sm = np.array([table[b, p // tpb] * tpb + p % tpb for b, p in pos] or [-1], np.int32)
    k = jnp.asarray(rng.standard_normal((len(sm), heads, head_dim)), dtype)
    pools = write_kv(pools, layer, k, -k, sm)
    kk, vv = gather_kv(pools, layer, table, lens)
    kr, vr = gather_kv_reference(pools, layer, jnp.asarray(table), jnp.asarray(lens))
    np.testing.assert_array_equal(np.asarray(kk), np.asarray(kr))
    np.testing.assert_array_equal(np.asarray(vv), np.asarray(vr))
    for i, (b, p) in enumerate(pos):
        np.testing.assert_array_equal(np.asarray(kk[b, p]), np.asarray(k[i]))


@settings(max_examples=6, deadline=None)
@given(
    tpb=st.sampled_from([1, 2, 4, 8]),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 4, 6]),
    n=st.integers(1, 12),
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    k_only=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_write_random_shapes_match_reference(tpb, heads, head_dim, n, layout, dtype, k_only, seed):
    """The per-field XLA scatter equals the token-by-token reference: random geometry, both
    layouts, K/V and K-only, padding entries, runs of consecutive offsets and lone tokens,
    float32 inputs written into a bfloat16 cache."""
    cfg = make_config(layout=layout, dtype=dtype, tokens_per_block=tpb, num_kv_heads=heads, head_dim=head_dim,
                      attention_windows=None, primary_blocks=6, cache_type="self_k_only" if k_only else "self")
    rng = np.random.default_rng(seed)
    pools = fill(allocate_pools(cfg), seed=seed)
    n = min(n, 6 * tpb)
    start = int(rng.integers(0, 6 * tpb - n + 1))
    sm = (np.arange(start, start + n) if rng.random() < 0.5 else rng.choice(6 * tpb, n, replace=False)).astype(np.int32)
    sm[rng.random(n) < 0.25] = -1
    k = jnp.asarray(rng.standard_normal((n, heads, head_dim)), jnp.float32)
    v = None if k_only else -k
    layer = int(rng.integers(0, cfg.num_layers))
    expected = snapshot(write_kv_reference(pools, layer, k, v, jnp.asarray(sm)))
    pools = write_kv(pools, layer, k, v, sm, impl="xla")
    assert_pools_equal(pools, expected)
