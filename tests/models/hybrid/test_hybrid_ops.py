"""The recurrent primitives against direct definitions: the causal depthwise conv with a K-1 state,
and Mamba2's SSD (chunked and recurrent forms against the per-token recurrence in numpy)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models.hybrid import causal_conv1d, ssd_chunked, ssd_recurrent


def conv_reference(x, w, bias, state):
    """y[t] = bias + sum_k w[k] * window[t + k] over window = state ++ x (numpy, float64)."""
    window = np.concatenate([state, x], axis=1)
    k = w.shape[0]
    y = np.stack([sum(window[:, t + i] * w[i] for i in range(k)) for t in range(x.shape[1])], axis=1)
    return y + (0 if bias is None else bias), window[:, window.shape[1] - (k - 1):]


@pytest.mark.parametrize("kernel, t", [(4, 7), (4, 2), (3, 1), (2, 5), (1, 3)])
def test_conv_matches_definition(kernel, t):
    r = np.random.RandomState(kernel * 10 + t)
    x, w = r.randn(2, t, 5).astype(np.float32), r.randn(kernel, 5).astype(np.float32)
    bias, state = r.randn(5).astype(np.float32), r.randn(2, kernel - 1, 5).astype(np.float32)
    y, new = jax.jit(causal_conv1d)(x, w, bias, state)
    want_y, want_state = conv_reference(x, w, bias, state)
    chex.assert_shape([y, new], [(2, t, 5), (2, kernel - 1, 5)])
    chex.assert_trees_all_close((y, new), (want_y, want_state), atol=1e-5, rtol=1e-5)


def test_conv_chunks_compose():
    """Any split of a sequence gives the same outputs and final state as one call (state carried)."""
    r = np.random.RandomState(0)
    x, w = jnp.asarray(r.randn(1, 9, 3), jnp.float32), jnp.asarray(r.randn(4, 3), jnp.float32)
    zero = jnp.zeros((1, 3, 3), jnp.float32)
    whole, final = causal_conv1d(x, w, None, zero)
    state, parts = zero, []
    for a, b in [(0, 2), (2, 3), (3, 8), (8, 9)]:
        y, state = causal_conv1d(x[:, a:b], w, None, state)
        parts.append(y)
    chex.assert_trees_all_close((jnp.concatenate(parts, 1), state), (whole, final), atol=1e-6)
    with pytest.raises(ValueError, match="conv state"):
        causal_conv1d(x, w, None, jnp.zeros((1, 2, 3), jnp.float32))


def ssd_reference(x, dt, a, b, c, d, s):
    """The recurrence token by token in float64 numpy."""
    x, dt, b, c, s = (np.asarray(v, np.float64) for v in (x, dt, b, c, s))
    nh, g = x.shape[2], b.shape[2]
    b, c = np.repeat(b, nh // g, axis=2), np.repeat(c, nh // g, axis=2)
    ys = []
    for t in range(x.shape[1]):
        s = s * np.exp(dt[:, t] * a)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        ys.append(np.einsum("bhpn,bhn->bhp", s, c[:, t]) + x[:, t] * d[None, :, None])
    return np.stack(ys, 1), s


@pytest.mark.parametrize("t, chunk", [(11, 4), (8, 8), (5, 16), (1, 4)])
def test_ssd_forms_match_the_recurrence(t, chunk):
    r = np.random.RandomState(t + chunk)
    bsz, nh, p, g, n = 2, 4, 3, 2, 5
    x = r.randn(bsz, t, nh, p).astype(np.float32)
    dt = np.log1p(np.exp(r.randn(bsz, t, nh))).astype(np.float32)
    a = -r.uniform(0.5, 4.0, nh).astype(np.float32)
    b, c = r.randn(bsz, t, g, n).astype(np.float32), r.randn(bsz, t, g, n).astype(np.float32)
    d, s0 = r.randn(nh).astype(np.float32), r.randn(bsz, nh, p, n).astype(np.float32)
    want = ssd_reference(x, dt, a, b, c, d, s0)
    chunked = jax.jit(ssd_chunked, static_argnums=7)(x, dt, a, b, c, d, s0, chunk)
    recurrent = jax.jit(ssd_recurrent)(x, dt, a, b, c, d, s0)
    for got in (chunked, recurrent):
        chex.assert_shape(got, [(bsz, t, nh, p), (bsz, nh, p, n)])
        chex.assert_type(got, jnp.float32)
        chex.assert_trees_all_close(got, want, atol=2e-5, rtol=2e-5)
