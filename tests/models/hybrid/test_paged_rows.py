"""The row conventions of the hybrid paged forward (`kvjax.models.hybrid.paged`): a group's rows
are left-padded (real tokens last), a recurrent layer rolls them to right padding with `lens`
real tokens, and padding must leave every state as the real tokens alone leave it: the conv
state skips it (`lens`), the SSD and the delta rule see dt = 0 / g = beta = 0 there. Each is
checked against the same op run on the unpadded row (small eager ops, no model)."""
import jax.numpy as jnp
import numpy as np

from kvjax.models.hybrid import causal_conv1d, gated_delta_rule, ssd_chunked, ssd_recurrent
from kvjax.models.hybrid.paged import to_left_padding, to_right_padding

T = 8
LENS = np.array([8, 5, 1, 0], np.int32)  # a full row, two short ones, a padding row


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_rolling_rows_between_left_and_right_padding():
    x = np.zeros((4, T, 2), np.float32)
    for b, n in enumerate(LENS):
        x[b, T - n:] = np.arange(1, n + 1)[:, None] * (b + 1)  # left-padded: real tokens last
    right = np.asarray(to_right_padding(jnp.asarray(x), jnp.asarray(LENS)))
    for b, n in enumerate(LENS):
        np.testing.assert_array_equal(right[b, :n], x[b, T - n:])
    np.testing.assert_array_equal(np.asarray(to_left_padding(jnp.asarray(right), jnp.asarray(LENS))), x)


def test_conv_state_skips_right_padding():
    r = _rng(1)
    k, c = 4, 3
    x = r.normal(size=(4, T, c)).astype(np.float32)
    w, bias = r.normal(size=(k, c)).astype(np.float32), r.normal(size=(c,)).astype(np.float32)
    state = r.normal(size=(4, k - 1, c)).astype(np.float32)
    y, new = causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), jnp.asarray(state), jnp.asarray(LENS))
    for b, n in enumerate(LENS):
        if n == 0:
            np.testing.assert_array_equal(np.asarray(new[b]), state[b])  # nothing real: the state stays
            continue
        y1, new1 = causal_conv1d(jnp.asarray(x[b:b + 1, :n]), jnp.asarray(w), jnp.asarray(bias), jnp.asarray(state[b:b + 1]))
        np.testing.assert_allclose(np.asarray(y[b, :n]), np.asarray(y1[0]), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(new[b]), np.asarray(new1[0]))


def test_ssd_and_delta_rule_states_ignore_zeroed_padding():
    r = _rng(2)
    lens = np.array([5, 0], np.int32)  # a short row and a padding row (one reference compile each op)
    b, nh, p, g, n = 2, 2, 3, 1, 5
    valid = np.arange(T)[None, :] < lens[:, None]  # [B, T]
    x = r.normal(size=(b, T, nh, p)).astype(np.float32)
    dt = np.where(valid[..., None], r.uniform(0.1, 1.0, size=(b, T, nh)), 0.0).astype(np.float32)
    a, d = -r.uniform(0.5, 1.5, size=(nh,)).astype(np.float32), r.normal(size=(nh,)).astype(np.float32)
    bm, cm = (r.normal(size=(b, T, g, n)).astype(np.float32) for _ in range(2))
    s0 = r.normal(size=(b, nh, p, n)).astype(np.float32)
    _, final = ssd_chunked(*map(jnp.asarray, (x, dt, a, bm, cm, d, s0)), chunk=4)
    hk, hv, dk, dv = 1, 2, 4, 3
    q, kk = (r.normal(size=(b, T, hk, dk)).astype(np.float32) for _ in range(2))
    v = r.normal(size=(b, T, hv, dv)).astype(np.float32)
    gate = np.where(valid[..., None], -r.uniform(0.1, 1.0, size=(b, T, hv)), 0.0).astype(np.float32)
    beta = np.where(valid[..., None], r.uniform(0.1, 0.9, size=(b, T, hv)), 0.0).astype(np.float32)
    d0 = r.normal(size=(b, hv, dk, dv)).astype(np.float32)
    _, delta = gated_delta_rule(*map(jnp.asarray, (q, kk, v, gate, beta, d0)), chunk_size=4)
    for i, m in enumerate(lens):
        row = slice(i, i + 1)
        if m == 0:
            np.testing.assert_allclose(np.asarray(final[i]), s0[i], rtol=1e-6)
            np.testing.assert_allclose(np.asarray(delta[i]), d0[i], rtol=1e-6)
            continue
        _, want = ssd_recurrent(*(jnp.asarray(t[row, :m]) for t in (x, dt)), jnp.asarray(a),
                                *(jnp.asarray(t[row, :m]) for t in (bm, cm)), jnp.asarray(d), jnp.asarray(s0[row]))
        np.testing.assert_allclose(np.asarray(final[i]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
        _, want_delta = gated_delta_rule(*(jnp.asarray(t[row, :m]) for t in (q, kk, v, gate, beta)), jnp.asarray(d0[row]),
                                         chunk_size=None)
        np.testing.assert_allclose(np.asarray(delta[i]), np.asarray(want_delta[0]), rtol=1e-4, atol=1e-5)
