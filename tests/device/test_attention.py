"""paged_attention against the reference and against dense attention on the gathered K/V:
decode and prefill chunks, GQA, sliding windows, ragged lengths, padding rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_helpers import DTYPES, LAYOUTS, fill, make_config, random_tables

from kvjax.device import allocate_pools, dense_attention, gather_kv, paged_attention, paged_attention_reference
from pallas_kernels.paged_attention import mgpu_supported

TOL = {"float32": 2e-5, "bfloat16": 2e-2}
reference = jax.jit(paged_attention_reference, static_argnums=(2,), static_argnames=("scale",))
dense = jax.jit(dense_attention, static_argnames=("scale", "window"))


@pytest.fixture(scope="module", params=[(lay, dt) for lay in LAYOUTS for dt in DTYPES], ids=lambda p: "-".join(p))
def filled(request):
    layout, dtype = request.param
    cfg = make_config(layout=layout, dtype=dtype, num_kv_heads=2, head_dim=16, attention_windows=(48, 6))
    return cfg, fill(allocate_pools(cfg), seed=3)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_matches_reference_and_dense(filled, impl):
    cfg, pools = filled
    # decode (1 query, 2 q heads per kv head) or a prefill chunk (5 queries, 4 per kv head):
    # each layout and each dtype sees both
    q_len, heads = (1, 4) if (cfg.layout == "block_first") == (cfg.dtype == "float32") else (5, 8)
    if impl == "pallas" and jax.default_backend() == "gpu" and not mgpu_supported(cfg.dtype, 16, cfg.tokens_per_block):
        pytest.skip("GPU run: the Mosaic kernel takes 16-bit K/V, head_dim % 64 == 0 (checked in gpu_check.sh)")
    rng = np.random.default_rng(q_len * 10 + heads)
    for layer in (0, 1):  # full attention and a 6-token sliding window
        pool, _ = pools.locate(layer)
        table, lens = random_tables(rng, pool, 4, 5, cfg.tokens_per_block)
        lens[1] = min(lens[1], q_len - 1)  # some queries sit at negative positions
        q = jnp.asarray(rng.standard_normal((4, q_len, heads, 16)), cfg.dtype)
        out = paged_attention(q, pools, layer, table, lens, impl=impl)
        assert out.shape == q.shape and out.dtype == q.dtype
        ref = reference(q, pools, layer, jnp.asarray(table), jnp.asarray(lens))
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=TOL[cfg.dtype], rtol=TOL[cfg.dtype]
        )
        if impl != "xla":
            continue
        k, v = gather_kv(pools, layer, table, lens)
        d = dense(q, k, v, jnp.asarray(lens), scale=1 / 4.0, window=cfg.layer_windows[layer])
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(d, np.float32), atol=TOL[cfg.dtype], rtol=TOL[cfg.dtype]
        )
        qpos = lens[:, None] - q_len + np.arange(q_len)[None]
        assert not np.asarray(out, np.float32)[qpos < 0].any(), "padding queries must return zeros"


@pytest.mark.parametrize("window", [1, 3])
def test_windows_narrower_than_a_block(window):
    """A sliding window narrower than a block (4 tokens): a query sees part of one block, or of
    two across a boundary. Both implementations against the reference and dense attention,
    for a decode query and chunks of 3 and 5."""
    cfg = make_config(num_kv_heads=2, head_dim=16, attention_windows=(48, window))
    pools = fill(allocate_pools(cfg), seed=3)
    pool, _ = pools.locate(1)
    for q_len, heads in ((1, 4), (3, 2), (5, 8)):
        rng = np.random.default_rng(window * 100 + q_len)
        table, lens = random_tables(rng, pool, 4, 5, cfg.tokens_per_block)
        q = jnp.asarray(rng.standard_normal((4, q_len, heads, 16)), cfg.dtype)
        ref = reference(q, pools, 1, jnp.asarray(table), jnp.asarray(lens))
        k, v = gather_kv(pools, 1, table, lens)
        d = dense(q, k, v, jnp.asarray(lens), scale=1 / 4.0, window=window)
        for impl in ("xla", "pallas"):
            if impl == "pallas" and jax.default_backend() == "gpu" and not mgpu_supported(cfg.dtype, 16, cfg.tokens_per_block):
                continue  # on a GPU the Pallas path is the Mosaic kernel: 16-bit K/V, head_dim % 64 == 0
            out = paged_attention(q, pools, 1, table, lens, impl=impl)
            np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOL["float32"], rtol=TOL["float32"])
            np.testing.assert_allclose(np.asarray(out), np.asarray(d), atol=TOL["float32"], rtol=TOL["float32"])


def test_float32_is_full_precision():
    """Scores of large-magnitude f32 inputs must not be computed in TF32/bf16."""
    cfg = make_config(head_dim=16, attention_windows=None)
    pools = fill(allocate_pools(cfg), seed=4)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 1, 2, 16)) * 30, jnp.float32)
    table, lens = np.array([[0, 1, 2]], np.int32), np.array([12], np.int32)
    out = paged_attention(q, pools, 0, table, lens, impl="xla")
    k, v = (np.asarray(x, np.float64) for x in gather_kv(pools, 0, table, lens))
    s = np.einsum("hd,shd->hs", np.asarray(q[0, 0], np.float64).reshape(2, 16), np.repeat(k[0, :12], 1, axis=1)) / 4
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hs,shd->hd", p / p.sum(-1, keepdims=True), v[0, :12])
    np.testing.assert_allclose(np.asarray(out[0, 0], np.float64), o, atol=1e-4, rtol=1e-5)


def test_custom_scale_and_errors():
    cfg = make_config(head_dim=16)
    pools = fill(allocate_pools(cfg), seed=5)
    q = jnp.ones((1, 1, 2, 16), jnp.float32)
    table, lens = np.array([[0, 1]], np.int32), np.array([5], np.int32)
    a = paged_attention(q, pools, 0, table, lens, scale=0.5)
    b = reference(q, pools, 0, jnp.asarray(table), jnp.asarray(lens), scale=0.5)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(jnp.ones((1, 1, 3, 16)), pools, 0, table, lens)
    with pytest.raises(ValueError, match="batch"):
        paged_attention(jnp.ones((2, 1, 2, 16)), pools, 0, table, lens)
    with pytest.raises(ValueError, match="q must be 4-D"):
        paged_attention(jnp.ones((1, 2, 16)), pools, 0, table, lens)
