"""The dense reference forward: deterministic init, causality, the sliding-window convention."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.model_spec import ModelSpec
from kvjax.models import Transformer, dense_greedy, jit_dense_forward

SMALL = ModelSpec(
    name="small",
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=8,
    hidden_size=32,
    intermediate_size=64,
    vocab_size=97,
    max_seq_len=128,
    dtype="float32",
)


@pytest.fixture(autouse=True)
def strict_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(scope="module")
def tiny():
    return Transformer.from_spec("tiny", seed=0)


def _params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_tiny_structure(tiny):
    spec = tiny.spec
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads) == (4, 256, 8, 2)
    assert len(tiny.blocks) == 4 and tiny.lm_head is not None  # untied: a random tied model echoes its input
    assert tiny.embed.shape == (4096, 256) and tiny.embed[...].dtype == jnp.float32
    attn = tiny.blocks[0].attn
    assert attn.wq.shape == (256, 8, 32) and attn.wk.shape == (256, 2, 32) and attn.wv.shape == (256, 2, 32)
    assert tiny.blocks[0].mlp.gate.shape == (256, 768)
    n_params = sum(p.size for p in _params(tiny))
    per_layer = 256 * 8 * 32 * 2 + 256 * 2 * 32 * 2 + 3 * 256 * 768 + 2 * 256
    assert n_params == 2 * 4096 * 256 + 4 * per_layer + 256  # embedding + untied output head


def test_init_is_deterministic_per_seed():
    a, b, c = (Transformer.from_spec(SMALL, seed=s) for s in (7, 7, 8))
    for x, y in zip(_params(a), _params(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(_params(a), _params(c), strict=True))


def test_untied_head_and_dtype_override():
    model = Transformer.from_spec(dataclasses.replace(SMALL, tie_embeddings=False), seed=0, dtype="bfloat16")
    assert model.lm_head.shape == (32, 97) and model.embed[...].dtype == jnp.bfloat16
    logits = jit_dense_forward(model)(jnp.arange(10, dtype=jnp.int32)[None] % 97)
    assert logits.shape == (1, 10, 97) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_dense_forward_is_causal_and_batch_independent(tiny):
    fwd = jit_dense_forward(tiny)
    tokens = jax.random.randint(jax.random.key(0), (2, 48), 0, 4096, dtype=jnp.int32)
    logits = fwd(tokens)  # [2, 48, 4096]
    assert logits.shape == (2, 48, 4096) and bool(jnp.all(jnp.isfinite(logits)))
    changed = fwd(tokens.at[:, 30].set((tokens[:, 30] + 1) % 4096))
    np.testing.assert_array_equal(changed[:, :30], logits[:, :30])
    assert float(jnp.abs(changed[:, 30:] - logits[:, 30:]).max()) > 1e-2
    # each row alone gives the same logits as in the batch
    np.testing.assert_allclose(fwd(tokens[1:]), logits[1:], atol=1e-5)


def test_rope_makes_logits_shift_invariant():
    fwd = jit_dense_forward(Transformer.from_spec(SMALL, seed=1))
    tokens = jnp.arange(20, dtype=jnp.int32)[None] * 5 % 97
    base = fwd(tokens, jnp.arange(20, dtype=jnp.int32)[None])
    shifted = fwd(tokens, jnp.arange(20, dtype=jnp.int32)[None] + 50)
    np.testing.assert_allclose(shifted, base, atol=1e-4)


def test_sliding_window_limits_the_receptive_field():
    # every layer sees 5 keys (itself and 4 before): after 2 layers position p depends on tokens >= p - 8
    spec = dataclasses.replace(SMALL, attention_windows=(5,))
    fwd = jit_dense_forward(Transformer.from_spec(spec, seed=2))
    tokens = jnp.arange(30, dtype=jnp.int32)[None] * 3 % 97
    base = fwd(tokens)
    changed = fwd(tokens.at[0, 10].set(1))
    diff = np.abs(np.asarray(changed - base))[0].max(axis=-1)  # [30]
    assert np.all(diff[:10] == 0) and np.all(diff[19:] == 0)
    assert np.all(diff[10:19] > 1e-4)
    # a global model would propagate the change to the end
    full = jit_dense_forward(Transformer.from_spec(SMALL, seed=2))
    diff_full = np.abs(np.asarray(full(tokens.at[0, 10].set(1)) - full(tokens)))[0]
    assert diff_full[19:].max() > 1e-4


def test_swa_model_mixes_local_and_global_layers():
    swa = Transformer.from_spec("tiny-swa", seed=0)
    assert [b.window for b in swa.blocks] == [64, 64, 64, 2048]
    assert swa.lm_head is not None and swa.lm_head.shape == (256, 4096)


def test_dense_greedy_matches_argmax_loop_and_stops_at_eos():
    model = Transformer.from_spec(SMALL, seed=4)
    fwd = jit_dense_forward(model)
    prompt = [5, 17, 3]
    seq = list(prompt)
    for _ in range(5):
        padded = jnp.asarray([seq + [0] * (16 - len(seq))], jnp.int32)  # right padding is invisible
        seq.append(int(jnp.argmax(fwd(padded)[0, len(seq) - 1])))
    greedy = dense_greedy(model, [prompt, [9]], [5, 2], forward=fwd)
    assert greedy[0] == seq[3:] and len(greedy[1]) == 2
    assert dense_greedy(model, [prompt], 5, eos_id=seq[4], forward=fwd) == [seq[3: seq.index(seq[4], 3) + 1]]
    assert dense_greedy(model, [prompt], 0, forward=fwd) == [[]]
    with pytest.raises(ValueError, match="at least one token"):
        dense_greedy(model, [[]], 1)
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        dense_greedy(model, [prompt], 126)
