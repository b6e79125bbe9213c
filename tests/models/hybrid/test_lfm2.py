"""LFM2 against transformers 5.24 (tests/fixtures/hf_hybrid/lfm2*): logits within 1e-3 (measured
<= 2.7e-5 on logits up to ~23: both sides float32, kvjax's matmuls at HIGHEST precision), identical greedy
continuations, and chunked prefill + decode through the state equal to the dense forward."""
import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hybrid_helpers import (
    FIXTURES,
    assert_chunks_match_dense,
    assert_decode_compiles_once,
    assert_greedy_matches,
    assert_unknown_fields_warn_or_refuse,
    chunk_forward,
    fixture_config,
    logit_error,
    perturb,
    read_tensors,
    write_safetensors,
)

from kvjax.checkpoint_files import CheckpointError
from kvjax.errors import InvalidArgumentError
from kvjax.hf_config import HybridModelNotServedError, UnknownConfigFieldWarning, UnsupportedConfigError
from kvjax.model_catalog import load_model_spec
from kvjax.models import from_pretrained
from kvjax.models.hybrid import ConvState, HybridState, KVState, Lfm2, Lfm2Spec, jit_forward_chunk

FAMILIES = ["lfm2", "lfm2-bias"]
ATOL = 1e-3


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    return request.param, from_pretrained(FIXTURES / request.param, dtype="float32")


def test_logits_match_transformers(loaded):
    family, model = loaded
    assert isinstance(model, Lfm2)
    err = logit_error(model, family)
    assert err <= ATOL, f"{family}: max |logit diff| {err}"


def test_greedy_matches_transformers_through_the_state(loaded):
    assert_greedy_matches(loaded[1], loaded[0])


def test_loads_in_the_checkpoint_dtype_by_default():
    model = from_pretrained(FIXTURES / "lfm2")
    assert model.spec.dtype == "bfloat16" and model.embed[...].dtype == jnp.bfloat16
    err = logit_error(model, "lfm2")  # bfloat16 activations: near transformers' float32 (logits up to ~23)
    assert 1e-4 < err < 1.5


def random_model(kernel: int = 4) -> Lfm2:
    spec = Lfm2Spec(name="t", vocab_size=61, hidden_size=24, ffn_size=40,
                    layer_types=("conv", "full_attention"),
                    num_attention_heads=4, num_kv_heads=2, head_dim=8, conv_kernel=kernel, conv_bias=True,
                    norm_eps=1e-5, rope_theta=1e4, max_seq_len=128, tie_embeddings=False)
    model = Lfm2(spec, rngs=nnx.Rngs(params=3))
    perturb(model, ("in_bias", "conv_b", "out_bias", "scale"))
    return model


class ChunkedEqualsDense(chex.TestCase):
    """Prefill in chunks of any sizes, then token-by-token decode, gives the dense logits."""

    @classmethod
    def setUpClass(cls):  # one model and one dense oracle for both variants
        super().setUpClass()
        cls.model = random_model()
        cls.tokens = jnp.asarray(np.random.RandomState(0).randint(0, 61, (2, 9)), jnp.int32)
        cls.dense = jax.jit(cls.model.dense_forward)(cls.tokens)  # [2, 9, V]
        cls.graphdef, cls.params = nnx.split(cls.model)

    @chex.variants(with_jit=True, without_jit=True)
    def test_splits(self):
        fwd = chunk_forward(self.variant, self.graphdef)
        for splits in [(2, 5), (5, 2, 2)]:  # few distinct chunk sizes (each compiles once), then decode
            assert_chunks_match_dense(self.model, fwd, self.params, self.tokens, self.dense, splits, max_len=16)

    @chex.variants(with_jit=True, without_jit=True)
    def test_state_shapes(self):
        fwd = chunk_forward(self.variant, self.graphdef)
        _, state = fwd(self.params, self.tokens[:, :5], self.model.init_state(2, 16))
        assert isinstance(state, HybridState) and len(state.layers) == 2
        for kind, layer in zip(self.model.spec.layer_types, state.layers, strict=True):
            if kind == "conv":
                assert isinstance(layer, ConvState)
                chex.assert_shape(layer.conv, (2, 3, 24))  # K-1 = 3 columns of the 24 channels
            else:
                assert isinstance(layer, KVState)
                chex.assert_shape([layer.k, layer.v], [(2, 16, 2, 8)] * 2)
        # the conv state is the last K-1 conv inputs: the same after 5 tokens in one chunk or five steps
        stepped = self.model.init_state(2, 16)
        for t in range(5):
            _, stepped = fwd(self.params, self.tokens[:, t:t + 1], stepped)
        chex.assert_trees_all_close(state, stepped, atol=1e-5, rtol=1e-5)


def test_decode_step_compiles_once():
    model = random_model()
    assert_decode_compiles_once(model, steps=10)
    step = jit_forward_chunk(model)
    state = model.init_state(1, 12)
    for t in range(10):
        _, state = step(jnp.asarray([[t + 3]], jnp.int32), state)
    assert step.run._cache_size() == 1


def test_chunks_that_do_not_fit_are_refused():
    model = random_model()
    step = jit_forward_chunk(model)
    state = model.init_state(1, 8)
    _, state = step(jnp.zeros((1, 6), jnp.int32), state)
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        step(jnp.zeros((1, 3), jnp.int32), state)
    assert int(state.length) == 6  # refused before the (donating) call: the state is still usable
    _, state = step(jnp.zeros((1, 2), jnp.int32), state)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        model.forward_chunk(jnp.asarray([[61]], jnp.int32), model.init_state(1, 4))
    with pytest.raises(InvalidArgumentError, match="rows"):
        model.forward_chunk(jnp.zeros((2, 1), jnp.int32), model.init_state(1, 4))
    with pytest.raises(InvalidArgumentError, match="batch"):
        model.init_state(0, 4)


# ---------------------------------------------------------------------- config.json
def config(**changes):
    return fixture_config("lfm2", **changes)


def test_spec_from_the_fixture_config():
    spec = Lfm2Spec.from_hf_config(config())
    assert spec.layer_types == ("conv", "conv", "full_attention", "conv", "full_attention")
    assert (spec.ffn_size, spec.conv_kernel, spec.head_dim, spec.rope_theta) == (48, 3, 16, 10000.0)
    assert spec.tie_embeddings and spec.dtype == "bfloat16"
    bias = Lfm2Spec.from_hf_config(json.loads((FIXTURES / "lfm2-bias" / "config.json").read_text()))
    assert (bias.ffn_size, bias.head_dim, bias.conv_bias, bias.tie_embeddings) == (40, 32, True, False)


def test_hub_style_config():
    """As LiquidAI publishes it: legacy fields transformers ignores or renames, rope_theta, full_attn_idxs."""
    hub = config(layer_types=..., rope_parameters=..., dtype=..., torch_dtype="bfloat16", rope_theta=10000.0,
                 full_attn_idxs=[2, 4], block_dim=64, conv_dim=64, conv_dim_out=64, num_heads=4, block_norm_eps=1e-5,
                 block_use_swiglu=True, use_pos_enc=True, block_mlp_init_scale=1.0, block_out_init_scale=1.0,
                 block_use_xavier_init=True, conv_use_xavier_init=True, tie_embedding=True, block_ff_dim=68,
                 intermediate_size=9999)
    spec = Lfm2Spec.from_hf_config(hub, strict=True)
    assert spec == Lfm2Spec.from_hf_config(config())


@pytest.mark.parametrize("changes, field", [
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_parameters"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_scaling"),
    (dict(layer_types=["conv", "sliding_attention", "conv", "conv", "full_attention"]), "layer_types"),
    (dict(layer_types=["conv"] * 4), "layer_types"),
    (dict(conv_L_cache=0), "conv_L_cache"),
    (dict(conv_bias=1), "conv_bias"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(block_dim=32), "block_dim"),
    (dict(num_heads=8), "num_heads"),
    (dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
    (dict(dtype="int8"), "dtype"),
    (dict(norm_eps=-1.0), "norm_eps"),
    (dict(hidden_size=64.5), "hidden_size"),
    (dict(model_type="llama"), "model_type"),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(UnsupportedConfigError, match=repr(field)):
        Lfm2Spec.from_hf_config(config(**changes))


def test_unknown_fields_warn_or_refuse():
    assert_unknown_fields_warn_or_refuse(Lfm2Spec.from_hf_config, config())


# ---------------------------------------------------------------------- loading and serving paths
def test_checkpoint_errors_name_the_tensor(tmp_path):
    def broken(edit):
        out = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        shutil.copytree(FIXTURES / "lfm2", out)
        tensors = read_tensors(out)
        edit(tensors)
        (out / "model.safetensors").unlink()
        write_safetensors(out / "model.safetensors", tensors)
        return out

    with pytest.raises(CheckpointError, match="'model.layers.3.conv.conv.weight' is missing"):
        from_pretrained(broken(lambda t: t.pop("model.layers.3.conv.conv.weight")))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.extra'"):
        from_pretrained(broken(lambda t: t.update({"model.layers.0.extra": np.zeros(2, np.float32)})))
    with pytest.raises(CheckpointError, match="'model.layers.2.self_attn.q_proj.weight' has shape"):
        from_pretrained(broken(lambda t: t.update({"model.layers.2.self_attn.q_proj.weight": np.zeros((8, 64), np.float32)})))
    # a tied checkpoint may carry the head (transformers ignores it too)
    model = from_pretrained(broken(lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]})), dtype="float32")
    assert logit_error(model, "lfm2") <= ATOL


def test_serving_paths_refuse_hybrids_clearly():
    """A hybrid has no ModelSpec and no Transformer runner: spec readers and `ModelRunner` say so,
    by name; `Engine` serves it with its own runner (tests/engine/test_hybrid_serving.py)."""
    with pytest.raises(HybridModelNotServedError, match="'lfm2'.*has no ModelSpec"):
        load_model_spec(FIXTURES / "lfm2")
    from kvjax.engine.engine import Engine
    from kvjax.engine.hybrid_runner import HybridRunner
    from kvjax.engine.runner import ModelRunner

    model = random_model()
    with pytest.raises(HybridModelNotServedError, match="HybridRunner"):
        ModelRunner(model)
    assert isinstance(Engine(model).runner, HybridRunner)
    with pytest.raises(ValueError, match="tensor parallelism"):
        from_pretrained(FIXTURES / "lfm2", mesh=jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,)))


def test_strict_config_reaches_the_loader(tmp_path):
    out = tmp_path / "lfm2"
    shutil.copytree(FIXTURES / "lfm2", out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, mystery=1)))
    with pytest.raises(UnsupportedConfigError, match="'mystery'"):
        from_pretrained(out, strict_config=True)
    with pytest.warns(UnknownConfigFieldWarning):
        from_pretrained(out, dtype="float32")
