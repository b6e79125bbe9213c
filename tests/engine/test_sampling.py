"""Sampling: greedy is argmax; a sampled token depends only on (logits, seed, index, settings),
never on the row or the batch it was drawn in; top-p keeps the nucleus."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine import SamplingParams, request_seed, sample

V = 64


@pytest.fixture(scope="module")
def jsample():
    return jax.jit(sample)


def _logits(rows, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(rows, V)) * 3, jnp.float32)


def test_greedy_is_argmax_and_reports_margin(jsample):
    x = _logits(4)
    z = jnp.zeros(4, jnp.float32)
    tok, chosen, margin = jsample(x, z, jnp.ones(4), jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32))
    np.testing.assert_array_equal(tok, np.argmax(x, -1))
    np.testing.assert_allclose(chosen, np.max(x, -1))
    s = np.sort(np.asarray(x), -1)
    np.testing.assert_allclose(margin, s[:, -1] - s[:, -2])


def test_sampled_token_is_independent_of_batch_position(jsample):
    x = _logits(1, seed=1)
    t, p = jnp.full((1,), 1.0), jnp.full((1,), 0.95)
    alone = jsample(x, t, p, jnp.asarray([123]), jnp.asarray([7]))[0]
    batch = jnp.concatenate([_logits(3, seed=2), x])  # same row, last in a batch of 4
    mixed = jsample(batch, jnp.asarray([0.0, 0.7, 1.0, 1.0]), jnp.asarray([1.0, 0.5, 1.0, 0.95]),
                    jnp.asarray([1, 2, 3, 123]), jnp.asarray([0, 1, 2, 7]))[0]
    assert int(mixed[3]) == int(alone[0])
    assert int(mixed[0]) == int(np.argmax(batch[0]))  # a greedy row in a sampled batch


def test_keys_vary_with_seed_and_index(jsample):
    x = jnp.zeros((64, V), jnp.float32)  # uniform: draws spread over the vocabulary
    t, p = jnp.ones(64), jnp.ones(64)
    by_index = jsample(x, t, p, jnp.full((64,), 5, jnp.int32), jnp.arange(64, dtype=jnp.int32))[0]
    by_seed = jsample(x, t, p, jnp.arange(64, dtype=jnp.int32), jnp.zeros(64, jnp.int32))[0]
    assert len(set(np.asarray(by_index).tolist())) > 20 and len(set(np.asarray(by_seed).tolist())) > 20


def test_top_p_keeps_the_nucleus(jsample):
    x = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)] * 256, jnp.float32))
    toks = np.asarray(jsample(x, jnp.ones(256), jnp.full((256,), 0.7), jnp.arange(256, dtype=jnp.int32),
                              jnp.zeros(256, jnp.int32))[0])
    assert set(toks.tolist()) == {0, 1}  # 0.5 + 0.3 >= 0.7: only the two most likely
    tiny = np.asarray(jsample(x, jnp.ones(256), jnp.full((256,), 1e-6), jnp.arange(256, dtype=jnp.int32),
                              jnp.zeros(256, jnp.int32))[0])
    assert set(tiny.tolist()) == {0}


def test_params_and_seeds():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(seed=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert request_seed(0, "a") == request_seed(0, "a") != request_seed(0, "b")
    assert request_seed(1, "a") != request_seed(0, "a")
    assert 0 <= request_seed(3, ("x", 1)) < 2**31
