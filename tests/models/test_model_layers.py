"""Building blocks of kvjax.models against plain numpy formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.models import MLP, Attention, RMSNorm, apply_rope, grouped_attention, visibility_mask


@pytest.fixture(autouse=True)
def strict_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield


def test_rmsnorm_matches_formula():
    norm = RMSNorm(16, eps=1e-6, dtype=jnp.float32)
    norm.scale[...] = jnp.arange(1, 17, dtype=jnp.float32)
    x = np.random.default_rng(0).normal(size=(2, 3, 16)).astype(np.float32)
    expected = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * np.arange(1, 17)
    np.testing.assert_allclose(norm(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)


def test_rope_rotates_pairs_and_is_relative():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
    # position 0 is the identity; norms are preserved everywhere
    np.testing.assert_allclose(apply_rope(q, jnp.zeros((1, 1), jnp.int32), 10000.0), q, atol=1e-7)
    rotated = apply_rope(q, jnp.full((1, 1), 37, jnp.int32), 10000.0)
    np.testing.assert_allclose(jnp.linalg.norm(rotated), jnp.linalg.norm(q), rtol=1e-5)

    # first pair (dims 0 and 4, frequency 1) at position 1: a rotation by 1 radian
    x = jnp.zeros((1, 1, 1, 8)).at[..., 0].set(1.0)
    out = apply_rope(x, jnp.ones((1, 1), jnp.int32), 10000.0)
    np.testing.assert_allclose(out[0, 0, 0, [0, 4]], [np.cos(1.0), np.sin(1.0)], atol=1e-6)

    # q(p) . k(p') depends only on p - p'
    def score(p, p2):
        return float(jnp.sum(apply_rope(q, jnp.full((1, 1), p), 500.0) * apply_rope(k, jnp.full((1, 1), p2), 500.0)))

    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)


def test_visibility_mask_window_convention():
    pos = jnp.arange(6, dtype=jnp.int32)[None]  # [1, 6]
    mask = np.asarray(visibility_mask(pos, pos, 3))[0]
    for p in range(6):
        for j in range(6):
            assert mask[p, j] == (p - 3 < j <= p)


def test_grouped_attention_matches_naive_repeat_heads():
    rng = np.random.default_rng(2)
    b, t, s, n, kv, h = 2, 3, 7, 6, 2, 4
    q = rng.normal(size=(b, t, n, h)).astype(np.float32)
    k = rng.normal(size=(b, s, kv, h)).astype(np.float32)
    v = rng.normal(size=(b, s, kv, h)).astype(np.float32)
    mask = rng.random((b, t, s)) < 0.6
    mask[1, 2] = False  # a query that sees nothing returns zeros
    out = np.asarray(grouped_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), 0.5))
    expected = np.zeros_like(q)
    for bi in range(b):
        for ti in range(t):
            for ni in range(n):
                kh = ni // (n // kv)
                if not mask[bi, ti].any():
                    continue
                scores = 0.5 * k[bi, :, kh] @ q[bi, ti, ni]
                scores = np.where(mask[bi, ti], scores, -np.inf)
                w = np.exp(scores - scores.max())
                expected[bi, ti, ni] = (w / w.sum()) @ v[bi, :, kh]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert np.all(out[1, 2] == 0)


def test_projection_shapes_and_mlp():
    rngs = nnx.Rngs(params=0)
    attn = Attention(32, 8, 2, 4, rope_theta=10000.0, dtype=jnp.float32, rngs=rngs)
    assert attn.wq.shape == (32, 8, 4) and attn.wk.shape == (32, 2, 4) and attn.wo.shape == (8, 4, 32)
    x = jnp.ones((2, 5, 32))
    q, k, v = attn.qkv(x, jnp.zeros((2, 5), jnp.int32))
    assert (q.shape, k.shape, v.shape) == ((2, 5, 8, 4), (2, 5, 2, 4), (2, 5, 2, 4))
    mlp = MLP(32, 48, dtype=jnp.float32, rngs=rngs)
    xs = np.random.default_rng(3).normal(size=(1, 2, 32)).astype(np.float32)
    gate, up, down = (np.asarray(p[...]) for p in (mlp.gate, mlp.up, mlp.down))
    g = xs @ gate
    expected = (g / (1 + np.exp(-g)) * (xs @ up)) @ down
    np.testing.assert_allclose(mlp(jnp.asarray(xs)), expected, rtol=1e-4, atol=1e-5)


def test_parameter_at_walks_a_loader_path():
    from kvjax.models.layers import parameter_at

    class Two(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([RMSNorm(4, eps=1e-6, dtype=jnp.float32), RMSNorm(4, eps=1e-6, dtype=jnp.float32)])

    model = Two()
    assert parameter_at(model, ("layers", 1, "scale")) is model.layers[1].scale
    with pytest.raises(TypeError, match="is not a parameter"):
        parameter_at(model, ("layers", 1))
