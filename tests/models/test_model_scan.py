"""Layers under `jax.lax.scan`: the scanned forwards equal a Python loop over the same stacked
weights (dense and paged; uniform, sliding-window and Gemma-3-like local/global models with a
tail shorter than the pattern; the Gemma 3 transformers fixture), a group's layers are traced
once whatever the depth, and the compiled program does not grow with the number of layers."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_helpers import FIXTURES
from test_model_paged import TPB, run_schedule

from kvjax.model_catalog import load_model_spec
from kvjax.model_spec import ModelSpec
from kvjax.models import Block, Transformer, from_pretrained, jit_dense_forward, jit_paged_forward
from kvjax.models.layers import shapes_only
from kvjax.models.transformer import layer_period

UNIFORM = ModelSpec(name="uniform", num_layers=5, num_attention_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32,
                    intermediate_size=64, vocab_size=97, max_seq_len=128, dtype="float32", embedding_scale="sqrt_hidden_size")
# Gemma-3-like: two local layers (window 8, their own RoPE base, 2 kv heads) then a global one with
# 4 kv heads, repeated over 7 layers: period 3, two scanned groups and a tail of one layer
GEMMA_LIKE = dataclasses.replace(
    UNIFORM, name="gemma-like", num_layers=7, num_kv_heads=(2, 2, 4) * 2 + (2,), attention_windows=(8, 8, 128),
    rope_theta=1e6, rope_local_theta=1e4, sandwich_norms=True, qk_norm=True, norm_weight_offset=1.0,
    query_pre_attn_scalar=16.0, mlp_activation="gelu_tanh")


def _tokens(vocab, shape, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def test_layer_period():
    assert layer_period(UNIFORM) == 1 and layer_period(GEMMA_LIKE) == 3
    assert layer_period(load_model_spec("tiny-swa")) == 4  # windows 64, 64, 64, global: no repeat inside 4 layers
    assert layer_period(load_model_spec("gemma-3-27b")) == 6
    assert layer_period(dataclasses.replace(UNIFORM, attention_windows=(8, 16, 8, 16, 16))) == 5
    model = Transformer.from_spec(GEMMA_LIKE, seed=1)
    assert model.period == 3 and [s.attn.wq.shape for s in model.stacks] == [(3, 32, 4, 8)] + [(2, 32, 4, 8)] * 2
    assert model.block(6).attn.wk.shape == (32, 2, 8) and model.block(5).attn.num_kv_heads == 4
    np.testing.assert_array_equal(model.block(4).mlp.up[...], model.stacks[1].mlp.up[...][1])
    with pytest.raises(ValueError, match="layer=7"):
        model.block(7)


def test_dense_scanned_equals_unrolled():
    spec = UNIFORM
    model = Transformer.from_spec(spec, seed=2)
    tokens = _tokens(spec.vocab_size, (2, 24), seed=3)  # longer than the local window
    scanned = jit_dense_forward(model)(tokens)
    unrolled = jit_dense_forward(model, unroll=True)(tokens)
    chex.assert_shape(scanned, (2, 24, spec.vocab_size))
    chex.assert_trees_all_close(scanned, unrolled, atol=1e-5, rtol=1e-5)


def test_paged_scanned_equals_unrolled():
    """Prefill chunks then decode-sized chunks through the paged cache (sliding-window placeholders,
    two pools: a traced layer names its pool), scanned and unrolled: the same logits."""
    model = Transformer.from_spec(GEMMA_LIKE, seed=4)
    config = model.spec.cache_config(primary_blocks=16, tokens_per_block=TPB, max_seq_len=128)
    assert len(config.pools) == 2
    rng = np.random.default_rng(5)
    sequences = [rng.integers(0, model.spec.vocab_size, n).tolist() for n in (27, 12)]
    schedule = [(8, [8, 8]), (8, [8, 4]), (8, [8, 0]), (8, [3, 0])]  # one shape: one compilation per mode
    got = {}
    for unroll in (False, True):
        got[unroll] = run_schedule(model, config, sequences, schedule, seed=6, fwd=jit_paged_forward(model, unroll=unroll))
    assert got[False].keys() == got[True].keys() and len(got[False]) == 39
    worst = max(float(np.abs(got[False][k] - got[True][k]).max()) for k in got[False])
    assert worst <= 1e-5, worst


def test_gemma3_fixture_scanned_equals_unrolled():
    """The transformers Gemma 3 fixture (4 layers, pattern 3: one scanned group and a tail layer).
    Every family's scanned forward also matches transformers' logits (test_from_pretrained)."""
    model = from_pretrained(FIXTURES / "gemma3", dtype="float32")
    assert model.period == 3
    tokens = _tokens(model.spec.vocab_size, (2, 16), seed=7)
    chex.assert_trees_all_close(jit_dense_forward(model)(tokens), jit_dense_forward(model, unroll=True)(tokens),
                                atol=1e-5, rtol=1e-5)


def test_a_group_is_traced_once_whatever_the_depth(monkeypatch):
    """Scanned, `Block.dense` is traced once per position of the pattern plus once per tail layer
    (3 + 1 for 7 Gemma-like layers); unrolled, once per layer; both give the same logits."""
    model = Transformer.from_spec(GEMMA_LIKE, seed=8)
    tokens = _tokens(GEMMA_LIKE.vocab_size, (2, 24), seed=9)  # longer than the local window
    logits = {}
    for unroll, traces in ((False, 4), (True, 7)):
        chex.clear_trace_counter()
        monkeypatch.setattr(Block, "dense", chex.assert_max_traces(Block.dense, n=traces))
        fwd = jit_dense_forward(model, unroll=unroll)
        logits[unroll] = jax.block_until_ready(fwd(tokens))
        jax.block_until_ready(fwd(tokens))  # compiled: no more traces
        monkeypatch.undo()
        with pytest.raises(AssertionError):  # the bound is tight
            chex.clear_trace_counter()
            monkeypatch.setattr(Block, "dense", chex.assert_max_traces(Block.dense, n=traces - 1))
            jit_dense_forward(model, unroll=unroll)(tokens)
        monkeypatch.undo()
    chex.assert_trees_all_close(logits[False], logits[True], atol=1e-5, rtol=1e-5)


def _lowered_ops(num_layers: int, paged: bool) -> dict[str, int]:
    """Op counts of the lowered forward of a `num_layers` uniform model (abstract weights: nothing allocated)."""
    spec = dataclasses.replace(UNIFORM, num_layers=num_layers)
    with shapes_only():
        model = nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(params=0)))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    if paged:
        from kvjax.device import allocate_pools

        config = spec.cache_config(primary_blocks=8, tokens_per_block=TPB, max_seq_len=64)
        pools = jax.eval_shape(lambda: allocate_pools(config))
        args = (tokens, tokens, pools, jax.ShapeDtypeStruct((2, 8), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32),
                jax.ShapeDtypeStruct((16,), jnp.int32))
        fn = jax.jit(lambda st, *a: nnx.merge(graphdef, st).paged_forward(*a))
    else:
        args = (tokens,)
        fn = jax.jit(lambda st, *a: nnx.merge(graphdef, st).dense_forward(*a))
    text = fn.lower(state, *args).as_text()
    return {op: text.count(f"stablehlo.{op}") for op in ("dot_general", "while", "scatter", "gather")}


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_program_size_does_not_grow_with_depth(paged):
    shallow, deep = _lowered_ops(2, paged), _lowered_ops(32, paged)
    assert shallow == deep and shallow["while"] >= 1 and shallow["dot_general"] >= 7, (shallow, deep)
