"""The gated delta rule: chunked form == recurrent form == the formula written out in numpy."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models.hybrid.deltanet import chunked_delta_rule, gated_delta_rule, recurrent_delta_rule


def _inputs(seed: int, b=2, t=23, hk=2, hv=4, dk=8, dv=4, state=True):
    rng = np.random.default_rng(seed)
    f = np.float32
    q = rng.normal(size=(b, t, hk, dk)).astype(f)
    k = rng.normal(size=(b, t, hk, dk)).astype(f)
    v = rng.normal(size=(b, t, hv, dv)).astype(f)
    g = (-0.4 * np.abs(rng.normal(size=(b, t, hv)))).astype(f)  # log decays <= 0
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, t, hv))))).astype(f)
    s0 = (rng.normal(size=(b, hv, dk, dv)) if state else np.zeros((b, hv, dk, dv))).astype(f)
    return q, k, v, g, beta, s0


def _numpy_reference(q, k, v, g, beta, s0):
    """The update rule token by token in float64, with the layer's preparation (L2 norm, 1/sqrt(Dk), grouped heads)."""
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s0))
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    out = np.zeros(v.shape)
    for i in range(b):
        for h in range(hv):
            kh = h // (hv // hk)
            for j in range(t):
                s[i, h] *= np.exp(g[i, j, h])
                delta = beta[i, j, h] * (v[i, j, h] - k[i, j, kh] @ s[i, h])
                s[i, h] += np.outer(k[i, j, kh], delta)
                out[i, j, h] = q[i, j, kh] @ s[i, h]
    return out, s


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 8, 64])
def test_matches_the_formula(chunk_size):
    args = _inputs(0)
    want_out, want_state = _numpy_reference(*args)
    out, state = gated_delta_rule(*args, chunk_size=chunk_size)
    chex.assert_shape(out, (2, 23, 4, 4))
    chex.assert_shape(state, (2, 4, 8, 4))
    assert state.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(state, want_state, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("t, chunk_size", [(1, 4), (4, 4), (5, 4), (16, 5), (40, 16)])
def test_chunked_equals_recurrent(t, chunk_size):
    """Every tail length (a whole chunk, one token past, a ragged one), with a nonzero initial state."""
    q, k, v, g, beta, s0 = _inputs(t, t=t, hk=4, hv=4)
    rec = recurrent_delta_rule(q, k, v, g, beta, s0)
    chk = chunked_delta_rule(q, k, v, g, beta, s0, chunk_size=chunk_size)
    chex.assert_trees_all_close(chk, rec, atol=1e-5, rtol=1e-5)


def test_a_split_sequence_continues_from_its_state():
    q, k, v, g, beta, s0 = _inputs(3, t=30, state=False)
    whole_out, whole_state = gated_delta_rule(q, k, v, g, beta, s0, chunk_size=8)
    first, mid = gated_delta_rule(q[:, :11], k[:, :11], v[:, :11], g[:, :11], beta[:, :11], s0, chunk_size=8)
    second, end = gated_delta_rule(q[:, 11:], k[:, 11:], v[:, 11:], g[:, 11:], beta[:, 11:], mid, chunk_size=None)
    chex.assert_trees_all_close((jnp.concatenate([first, second], axis=1), end), (whole_out, whole_state), atol=1e-5)


class GatedDeltaRuleVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        args = _inputs(5, t=12)
        want = _numpy_reference(*args)
        for chunk_size in (None, 8):
            fn = self.variant(lambda *a, c=chunk_size: gated_delta_rule(*a, chunk_size=c))
            out, state = fn(*args)
            chex.assert_trees_all_close((out, state), tuple(np.float32(w) for w in want), atol=2e-5, rtol=1e-4)

    def test_decode_step_traces_once(self):
        step = jax.jit(chex.assert_max_traces(lambda *a: gated_delta_rule(*a, chunk_size=None), n=1))
        q, k, v, g, beta, state = _inputs(6, t=3)
        for i in range(3):
            _, state = step(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], beta[:, i:i + 1], state)
        chex.assert_trees_all_close(state, np.float32(_numpy_reference(q, k, v, g, beta, _inputs(6, t=3)[5])[1]), atol=2e-5)


def test_bad_shapes_are_refused():
    q, k, v, g, beta, s0 = _inputs(7, hk=3, hv=4)
    with pytest.raises(ValueError, match="do not split"):
        gated_delta_rule(q, k, v, g, beta, s0)
    q, k, v, g, beta, s0 = _inputs(7)
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_rule(q, k, v, g, beta, s0, chunk_size=0)
