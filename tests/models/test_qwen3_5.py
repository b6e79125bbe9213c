"""Qwen3.5 (gated DeltaNet + gated attention) against transformers 5.24 on the committed tiny
checkpoint (tests/fixtures/hf_hybrid/qwen3_5, written by tests/fixtures/make_hybrid_fixtures.py),
and the stateful chunk forward against the dense one."""
import dataclasses
import functools
import json
import shutil
import warnings
from pathlib import Path
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_helpers import read_all, rewrite_single_file

from kvjax.checkpoint_files import CheckpointError
from kvjax.engine.engine import Engine
from kvjax.engine.hybrid_runner import HybridRunner
from kvjax.engine.runner import ModelRunner
from kvjax.errors import InvalidArgumentError
from kvjax.hf_config import HybridModelNotServedError, UnknownConfigFieldWarning, UnsupportedConfigError, spec_from_checkpoint
from kvjax.model_catalog import servable_model
from kvjax.models import from_pretrained
from kvjax.models.hybrid.qwen3_5 import (
    AttentionKV,
    DeltaNetState,
    Qwen35ForCausalLM,
    load_qwen3_5,
    qwen35_spec_from_config,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf_hybrid" / "qwen3_5"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
CONFIG = json.loads((FIXTURE / "config.json").read_text())


FAMILIES = ["qwen3_5", "qwen3_5-tied"]
CAPACITY = 96  # one state shape for every test, so the jitted steps compile once per token count
PAD = 96  # the dense oracle runs on [5, PAD] (causal: padding after a prompt leaves its logits alone)


@pytest.fixture(scope="module")
def model() -> Qwen35ForCausalLM:
    return _family("qwen3_5")[0]


@pytest.fixture(scope="module")
def dense(model):
    """Dense logits of up to 5 token lists, through one compiled [5, PAD] forward."""
    return _family("qwen3_5")[2]


@pytest.fixture(scope="module")
def step(model):
    """The jitted chunk forward (8-token delta-rule chunks); compiles once per (batch, token count)."""
    return _family("qwen3_5")[3]


def _feed(step, state, tokens, sizes):
    """Feed `tokens` in chunks of `sizes` (then one by one); the logits of every position and the state."""
    out, start = [], 0
    for size in [*sizes, *[1] * len(tokens)]:
        if start >= len(tokens):
            break
        logits, state = step(jnp.asarray([tokens[start:start + size]], jnp.int32), state)
        out.append(np.asarray(logits[0]))
        start += size
    return np.concatenate(out), state


# ---------------------------------------------------------------------- parity with transformers
@functools.cache
def _family(name: str):
    """(model, its expected.json, dense oracle over [5, PAD], jitted chunk step) of a fixture."""
    path = FIXTURE.parent / name
    m = load_qwen3_5(path, dtype="float32")
    forward = jax.jit(m.dense_forward)

    def dense(rows):
        batch = np.zeros((5, PAD), np.int32)
        for i, r in enumerate(rows):
            batch[i, :len(r)] = r
        logits = np.asarray(forward(jnp.asarray(batch)))
        return [logits[i, :len(r)] for i, r in enumerate(rows)]

    step = jax.jit(lambda tokens, state: m.forward_chunk(tokens, state, chunk_size=8))
    return m, json.loads((path / "expected.json").read_text()), dense, step


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_logits_match_transformers(family):
    model, expected, dense, _ = _family(family)
    worst = 0.0
    got_all = dense(expected["prompts"])
    for prompt, got, want in zip(expected["prompts"], got_all, expected["logits"], strict=True):
        assert got.dtype == np.float32 and got.shape == (len(prompt), model.spec.vocab_size)
        for pos, values in zip(want["positions"], want["values"], strict=True):
            worst = max(worst, float(np.abs(got[pos] - np.asarray(values)).max()))
    assert worst <= 1e-3, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_greedy_matches_transformers(family):
    """Full recompute every step (the definition of greedy), all prompts in one batch."""
    _, expected, dense, _ = _family(family)
    seqs = [list(p) for p in expected["prompts"]]
    for _ in range(len(expected["greedy"][0])):
        for seq, logits in zip(seqs, dense(seqs), strict=True):
            seq.append(int(np.argmax(logits[-1])))
    assert [s[len(p):] for s, p in zip(seqs, expected["prompts"], strict=True)] == expected["greedy"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_state_matches_transformers(family):
    """Prefill (chunked form: 8-token calls, 8-token delta-rule chunks, the rest one token per call),
    then the recurrent form token by token: transformers' greedy tokens."""
    model, expected, _, step = _family(family)
    for prompt, want in zip(expected["prompts"], expected["greedy"], strict=True):
        logits, state = _feed(step, model.init_state(1, CAPACITY), prompt, [8] * (len(prompt) // 8))
        got = [int(np.argmax(logits[-1]))]
        for _ in want[1:]:
            logits, state = step(jnp.asarray([[got[-1]]], jnp.int32), state)
            got.append(int(jnp.argmax(logits[0, -1])))
        assert got == want
    assert expected["min_top2_margin"] > 1e-2  # wide enough that 1e-4 of float32 noise cannot flip a token


def test_tied_fixture_covers_the_other_corners():
    spec = _family("qwen3_5-tied")[0].spec
    assert spec.tie_embeddings and spec.conv_kernel == 2 and spec.rotary_dim == 16 and spec.num_kv_heads == 1
    assert spec.linear_num_key_heads == spec.linear_num_value_heads and _family("qwen3_5-tied")[0].lm_head is None


# ---------------------------------------------------------------------- chunked prefill + decode == dense
@pytest.mark.parametrize("sizes", [[45], [5, 8, 8, 8, 8, 8], []], ids=["whole", "5+8s", "token-by-token"])
def test_chunks_of_any_size_then_decode_equal_dense(model, step, dense, sizes):
    """The prompt whole (6 delta-rule chunks, the last ragged), in chunks that straddle the
    delta-rule chunks, or one token per call; then 3 decode steps."""
    prompt, decode = EXPECTED["prompts"][1][:45], EXPECTED["greedy"][1][:3]
    got, state = _feed(step, model.init_state(1, CAPACITY), prompt + decode, sizes)
    np.testing.assert_allclose(got, dense([prompt + decode])[0], atol=1e-4, rtol=1e-4)
    assert int(state.lengths[0]) == len(prompt) + len(decode)


def test_rows_at_different_lengths_decode_together(model, step, dense):
    """Two rows prefilled apart (10 and 13 tokens), then decoded in one batch: each row at its own position."""
    a, b = EXPECTED["prompts"][3][:10], EXPECTED["prompts"][2][:13]
    states = [_feed(step, model.init_state(1, CAPACITY), p, [8])[1] for p in (a, b)]
    both = jax.tree.map(lambda x, y: jnp.concatenate([x, y]), *states)
    np.testing.assert_array_equal(both.lengths, [10, 13])
    logits, both = step(jnp.asarray([[5], [6]], jnp.int32), both)
    want = dense([a + [5], b + [6]])
    for row in range(2):
        np.testing.assert_allclose(np.asarray(logits[row, -1]), want[row][-1], atol=1e-4, rtol=1e-4)


def test_random_weights_from_a_spec():
    """`from_spec`: deterministic per seed, and its chunk forward equals its dense forward too."""
    spec = dataclasses.replace(_spec(), name="random", dtype="float32", layer_types=("full_attention", "linear_attention"))
    a, b, c = (Qwen35ForCausalLM.from_spec(spec, seed=s) for s in (1, 1, 2))
    chex.assert_trees_all_equal(nnx.state(a, nnx.Param), nnx.state(b, nnx.Param))
    assert not np.array_equal(a.embed[...], c.embed[...])
    tokens = jnp.asarray([[5, 9, 200]], jnp.int32)
    state, got = a.init_state(1, 3), []
    for i in range(3):  # one compiled decode step
        logits, state = a.forward_chunk(tokens[:, i:i + 1], state)
        got.append(logits)
    want = a.dense_forward(tokens, chunk_size=2)
    chex.assert_trees_all_close(jnp.concatenate(got, axis=1), want, atol=1e-4, rtol=1e-4)
    assert float(jnp.std(want)) > 0.1  # not a degenerate model


# ---------------------------------------------------------------------- state
def test_state_pytree_shapes(model):
    spec = model.spec
    state = model.init_state(3, 20)
    assert len(state.layers) == spec.num_layers == 5
    c = 2 * 2 * 16 + 4 * 8  # q, k (2 key heads x 16) and v (4 value heads x 8) channels
    for i, layer in enumerate(state.layers):
        if spec.layer_types[i] == "linear_attention":
            assert isinstance(layer, DeltaNetState)
            chex.assert_shape(layer.conv, (3, 3, c))  # K - 1 = 3 inputs kept
            chex.assert_shape(layer.recurrent, (3, 4, 16, 8))  # [B, Hv, Dk, Dv]
            assert layer.recurrent.dtype == jnp.float32
        else:
            assert isinstance(layer, AttentionKV)
            chex.assert_shape([layer.k, layer.v], (3, 20, 2, 16))
    logits, after = jax.eval_shape(model.forward_chunk, jnp.zeros((3, 4), jnp.int32), state)
    chex.assert_shape(logits, (3, 4, 256))
    chex.assert_trees_all_equal_shapes_and_dtypes(after, state)
    assert spec.state_bytes(20) == {"linear_attention": 3 * (3 * c * 4 + 4 * 16 * 8 * 4),
                                     "full_attention": 2 * 2 * 20 * 2 * 16 * 4}


class ChunkForwardVariants(chex.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = load_qwen3_5(FIXTURE, dtype="float32")

    @chex.variants(with_jit=True, without_jit=True)
    def test_prefill_and_decode(self):
        model = self.model
        fn = self.variant(lambda tokens, state: model.forward_chunk(tokens, state, chunk_size=4))
        prompt = EXPECTED["prompts"][0][:6]
        state = model.init_state(1, 8)
        first, state = fn(jnp.asarray([prompt], jnp.int32), state)
        second, state = fn(jnp.asarray([[7]], jnp.int32), state)
        chex.assert_shape(first, (1, 6, 256))
        chex.assert_shape(second, (1, 1, 256))
        want = np.asarray(model.dense_forward(jnp.asarray([prompt + [7]])))[0]
        chex.assert_trees_all_close(jnp.concatenate([first[0], second[0]]), want, atol=1e-4, rtol=1e-4)

    def test_eager_calls_compile_once_per_shape(self):
        model = self.model
        with mock.patch.object(Qwen35ForCausalLM, "_chunk", chex.assert_max_traces(Qwen35ForCausalLM._chunk, n=1)):
            state = model.init_state(3, 5)
            for i in range(3):
                _, state = model.forward_chunk(jnp.full((3, 1), 3 + i, jnp.int32), state)
        np.testing.assert_array_equal(state.lengths, [3, 3, 3])

    def test_decode_step_compiles_once(self):
        model = self.model
        decode = jax.jit(chex.assert_max_traces(lambda tok, state: model.forward_chunk(tok, state), n=1))
        state = model.init_state(2, 8)
        for i in range(4):
            _, state = decode(jnp.full((2, 1), 3 + i, jnp.int32), state)
        np.testing.assert_array_equal(state.lengths, [4, 4])


def test_overrunning_the_cache_is_refused_or_poisoned(model, step):
    state = model.init_state(1, CAPACITY)._replace(lengths=jnp.asarray([CAPACITY - 3], jnp.int32))
    with pytest.raises(InvalidArgumentError, match="cannot take 8 more"):
        model.forward_chunk(jnp.zeros((1, 8), jnp.int32), state)  # eager: refused before anything runs
    logits, _ = step(jnp.zeros((1, 8), jnp.int32), state)  # jitted, lengths unknown at trace time: NaN, never a clamped write
    assert np.isnan(np.asarray(logits)).all()
    logits, _ = step(jnp.zeros((1, 1), jnp.int32), state)  # room for one more: fine
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("tokens, match", [
    (np.zeros((4,), np.int32), r"\[batch, tokens\]"),
    (np.zeros((1, 0), np.int32), "at least one token"),
    (np.full((1, 2), 256, np.int32), r"token ids must lie in \[0, 256\)"),
    (np.full((1, 2), -1, np.int32), r"token ids must lie"),
    (np.zeros((1, 2), np.float32), "integers"),
])
def test_bad_tokens_are_refused(model, tokens, match):
    with pytest.raises(InvalidArgumentError, match=match):
        model.dense_forward(jnp.asarray(tokens))
    with pytest.raises(InvalidArgumentError):
        model.forward_chunk(jnp.asarray(tokens), model.init_state(1, 4))


def test_a_foreign_state_is_refused(model):
    state = model.init_state(2, 4)
    with pytest.raises(InvalidArgumentError, match="state does not fit"):
        model.forward_chunk(jnp.zeros((1, 1), jnp.int32), state)  # 2 rows of state, 1 of tokens
    with pytest.raises(InvalidArgumentError, match="state does not fit"):
        model.forward_chunk(jnp.zeros((2, 1), jnp.int32), state._replace(layers=state.layers[::-1]))


# ---------------------------------------------------------------------- loading
def test_checkpoint_dtype_is_the_default(model):
    bf16 = load_qwen3_5(FIXTURE)
    assert bf16.spec.dtype == "bfloat16" and bf16.embed[...].dtype == jnp.bfloat16
    # the stored weights are bfloat16: loading them as float32 is exact
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(bf16, nnx.Param)),
                                nnx.state(model, nnx.Param))
    logits = jax.jit(bf16.dense_forward)(jnp.asarray([EXPECTED["prompts"][3][:8]]))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_from_pretrained_routes_qwen3_5(model):
    loaded = from_pretrained(FIXTURE, dtype="float32")
    assert isinstance(loaded, Qwen35ForCausalLM)
    chex.assert_trees_all_equal(nnx.state(loaded, nnx.Param), nnx.state(model, nnx.Param))


def test_spec_readers_and_the_transformer_runner_refuse_hybrid_models_clearly(model):
    with pytest.raises(HybridModelNotServedError, match="has no ModelSpec"):
        spec_from_checkpoint(FIXTURE)
    with pytest.raises(HybridModelNotServedError, match="has no ModelSpec"):
        servable_model(str(FIXTURE))
    with pytest.raises(HybridModelNotServedError, match="Qwen35ForCausalLM .* is a hybrid model"):
        ModelRunner(model)
    assert isinstance(Engine(model).runner, HybridRunner)  # served (tests/engine/test_hybrid_serving.py)


def _multimodal_copy(tmp_path: Path, extra: dict[str, np.ndarray]) -> Path:
    """The fixture in the published multimodal layout: text tensors under model.language_model., config nested."""
    out = tmp_path / "qwen3_5_vl"
    shutil.copytree(FIXTURE, out)
    tensors = {("model.language_model." + n.removeprefix("model.")) if n.startswith("model.") else n: a
               for n, a in read_all(out).items()}
    rewrite_single_file(out, {**tensors, **extra})
    text = {k: v for k, v in CONFIG.items() if k not in ("architectures", "transformers_version", "dtype")}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "dtype": "float32",
              "text_config": text, "vision_config": {"depth": 1}, "image_token_id": 9, "vision_start_token_id": 10,
              "tie_word_embeddings": False, "transformers_version": "5.24.0"}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_multimodal_checkpoint_loads_its_text_model(model, tmp_path):
    extra = {"model.visual.patch_embed.proj.weight": np.ones((4, 3), np.float32), "mtp.fc.weight": np.ones((2, 2), np.float32)}
    path = _multimodal_copy(tmp_path, extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every field known
        loaded = from_pretrained(path)
    assert isinstance(loaded, Qwen35ForCausalLM) and loaded.spec.dtype == "float32"
    chex.assert_trees_all_equal(nnx.state(loaded, nnx.Param), nnx.state(model, nnx.Param))


@pytest.mark.parametrize("change, match", [
    (lambda t: t.pop("model.layers.2.self_attn.q_norm.weight"), "'model.layers.2.self_attn.q_norm.weight' is missing"),
    (lambda t: t.update({"model.layers.0.linear_attn.extra": np.ones(2, np.float32)}), "unexpected tensor"),
    (lambda t: t.update({"model.layers.0.linear_attn.A_log": np.ones(3, np.float32)}),
     r"has shape \[3\], config.json implies \[4\]"),
])
def test_checkpoint_problems_are_named(tmp_path, change, match):
    out = tmp_path / "broken"
    shutil.copytree(FIXTURE, out)
    tensors = read_all(out)
    change(tensors)
    rewrite_single_file(out, {n: np.asarray(a, np.float32) for n, a in tensors.items()})
    with pytest.raises(CheckpointError, match=match):
        load_qwen3_5(out)


# ---------------------------------------------------------------------- config
def _spec(strict=True, **changes):
    config = {**CONFIG, **changes}
    for k, v in changes.items():
        if v is None:
            config.pop(k)
    return qwen35_spec_from_config(config, strict=strict)


def test_config_is_read():
    spec = _spec()
    assert spec.layer_types == ("linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention")
    assert (spec.head_dim, spec.rotary_dim, spec.rope_theta) == (16, 4, 10000.0)
    assert (spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim,
            spec.conv_kernel, spec.conv_channels) == (2, 4, 16, 8, 4, 96)
    assert spec.dtype == "bfloat16" and not spec.tie_embeddings


def test_config_defaults_follow_transformers():
    minimal = {"model_type": "qwen3_5_text", "num_hidden_layers": 8}
    spec = qwen35_spec_from_config(minimal, strict=True)
    assert spec.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",)
    assert (spec.head_dim, spec.rotary_dim, spec.rope_theta, spec.vocab_size) == (256, 64, 10000.0, 248320)
    legacy = qwen35_spec_from_config({**minimal, "rope_parameters": None, "partial_rotary_factor": 0.5,
                                      "rope_theta": 5e6, "full_attention_interval": 2}, strict=True)
    assert (legacy.rotary_dim, legacy.rope_theta, legacy.layer_types[:2]) == (128, 5e6, ("linear_attention", "full_attention"))
    published = qwen35_spec_from_config({**minimal, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
                                         "mamba_ssm_dtype": "float32", "mlp_only_layers": [], "attn_output_gate": True,
                                         "eos_token_id": 5, "dtype": "bfloat16"}, strict=True)
    assert published.dtype == "bfloat16"


@pytest.mark.parametrize("changes, field", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(attn_output_gate=False), "attn_output_gate"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(hidden_act="relu2"), "hidden_act"),
    (dict(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.1}), "rope_parameters"),
    (dict(rope_parameters={"rope_type": "default", "beta_fast": 1}), "rope_parameters"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(layer_types=["linear_attention"] * 4), "layer_types"),
    (dict(full_attention_interval=2), "layer_types"),
    (dict(layer_types=["mamba"] * 5), "layer_types"),
    (dict(linear_num_key_heads=3), "linear_num_value_heads"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(num_experts=8), "num_experts"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(vocab_size=None, model_type="qwen3_next"), "model_type"),
])
def test_config_refusals_name_the_field(changes, field):
    with pytest.raises(UnsupportedConfigError, match=field):
        _spec(**changes)


def test_unknown_fields_warn_or_are_refused():
    with pytest.warns(UnknownConfigFieldWarning, match="'new_knob'"):
        _spec(strict=False, new_knob=3)
    with pytest.raises(UnsupportedConfigError, match="'new_knob'"):
        _spec(strict=True, new_knob=3)


def test_multimodal_config_refusals():
    nested = {"model_type": "qwen3_5", "text_config": {**CONFIG}, "vision_config": {}}
    assert qwen35_spec_from_config(nested, strict=True).layer_types == _spec().layer_types
    with pytest.raises(UnsupportedConfigError, match="tie_word_embeddings"):
        qwen35_spec_from_config({**nested, "tie_word_embeddings": True}, strict=True)
    with pytest.raises(UnsupportedConfigError, match="text_config model_type"):
        qwen35_spec_from_config({**nested, "text_config": {**CONFIG, "model_type": "qwen3_text"}})
    with pytest.raises(UnsupportedConfigError, match="'text_config'"):
        qwen35_spec_from_config({"model_type": "qwen3_5"})
