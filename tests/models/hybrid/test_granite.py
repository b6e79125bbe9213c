"""Granite-4.0-H dense against transformers 5.24 (tests/fixtures/hf_hybrid/granite*): logits within
1e-3 (measured <= 2.5e-6), identical greedy continuations through the state, chunked prefill +
decode equal to the dense forward, and the config refusals (mixture-of-experts by name)."""
import json

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
)

from kvjax.hf_config import HybridModelNotServedError, UnsupportedConfigError
from kvjax.model_catalog import load_model_spec
from kvjax.models import from_pretrained
from kvjax.models.hybrid import Granite, GraniteSpec, HybridState, KVState, MambaState, jit_forward_chunk

FAMILIES = ["granite", "granite-rope"]
ATOL = 1e-3


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request):
    return request.param, from_pretrained(FIXTURES / request.param, dtype="float32")


def test_logits_match_transformers(loaded):
    family, model = loaded
    assert isinstance(model, Granite)
    err = logit_error(model, family)
    assert err <= ATOL, f"{family}: max |logit diff| {err}"


def test_greedy_matches_transformers_through_the_state(loaded):
    """Prefill in chunks of 8 (the chunked SSD, across the fixture's 16-token SSD chunks), the
    remainder and the continuation token by token (the recurrent form)."""
    assert_greedy_matches(loaded[1], loaded[0])


def test_bfloat16_by_default():
    """The checkpoint's dtype (bfloat16): weights, activations, conv and attention states in
    bfloat16, the SSM state in float32; logits near transformers' float32 ones (max |logit| 0.28)."""
    model = from_pretrained(FIXTURES / "granite")
    assert model.spec.dtype == "bfloat16" and model.embed[...].dtype == jnp.bfloat16
    assert 1e-5 < logit_error(model, "granite") < 0.03
    _, state = jit_forward_chunk(model)(jnp.asarray([[5, 6, 7]], jnp.int32), model.init_state(1, 4))
    mamba, attn = state.layers[0], state.layers[1]
    assert (mamba.conv.dtype, mamba.ssm.dtype, attn.k.dtype) == (jnp.bfloat16, jnp.float32, jnp.bfloat16)


def random_spec(**changes) -> GraniteSpec:
    base = dict(name="t", vocab_size=53, hidden_size=16, ffn_size=24, layer_types=("mamba", "attention"),
                num_attention_heads=4, num_kv_heads=2, head_dim=4, attention_bias=True, rope_theta=1e4, norm_eps=1e-5,
                embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0,
                mamba_heads=4, mamba_head_dim=6, mamba_groups=2, mamba_state=5, mamba_conv=4, mamba_chunk=4,
                mamba_conv_bias=True, mamba_proj_bias=True, max_seq_len=64)
    return GraniteSpec(**{**base, **changes})


def random_model(**changes) -> Granite:
    model = Granite(random_spec(**changes), rngs=nnx.Rngs(params=5))
    perturb(model, ("scale", "norm", "conv_b", "in_bias", "out_bias", "bq", "bk", "bv", "bo", "dt_bias", "a_log", "d"))
    return model


class ChunkedEqualsDense(chex.TestCase):
    @classmethod
    def setUpClass(cls):  # one model and one dense oracle for both variants
        super().setUpClass()
        cls.model = random_model()
        cls.tokens = jnp.asarray(np.random.RandomState(1).randint(0, 53, (2, 10)), jnp.int32)
        cls.dense = jax.jit(cls.model.dense_forward)(cls.tokens)  # [2, 10, V]
        cls.graphdef, cls.params = nnx.split(cls.model)

    @chex.variants(with_jit=True, without_jit=True)
    def test_splits(self):
        fwd = chunk_forward(self.variant, self.graphdef)
        for splits in [(3, 6), (6, 3)]:  # chunks inside and across the SSD chunk of 4, then decode
            assert_chunks_match_dense(self.model, fwd, self.params, self.tokens, self.dense, splits, max_len=12)

    @chex.variants(with_jit=True, without_jit=True)
    def test_state_shapes(self):
        fwd = chunk_forward(self.variant, self.graphdef)
        _, state = fwd(self.params, self.tokens[:, :6], self.model.init_state(2, 12))
        assert isinstance(state, HybridState) and int(state.length) == 6
        mamba, attn = state.layers[0], state.layers[1]
        assert isinstance(mamba, MambaState) and isinstance(attn, KVState)
        chex.assert_shape(mamba.conv, (2, 3, 4 * 6 + 2 * 2 * 5))  # K-1 columns of x, B and C
        chex.assert_shape(mamba.ssm, (2, 4, 6, 5))  # [B, heads, head_dim, state]
        chex.assert_type(mamba.ssm, jnp.float32)
        chex.assert_shape([attn.k, attn.v], [(2, 12, 2, 4)] * 2)


def test_decode_step_compiles_once():
    assert_decode_compiles_once(random_model(), steps=8)


# ---------------------------------------------------------------------- config.json
def config(**changes):
    return fixture_config("granite", **changes)


def test_spec_from_the_fixture_configs():
    spec = GraniteSpec.from_hf_config(config())
    assert spec.layer_types == ("mamba", "attention", "mamba", "mamba", "attention")
    assert (spec.mamba_heads, spec.mamba_head_dim, spec.mamba_groups, spec.mamba_state, spec.mamba_conv) == (8, 8, 2, 12, 4)
    assert spec.rope_theta is None and spec.tie_embeddings and spec.attention_multiplier == 0.07
    rope = GraniteSpec.from_hf_config(json.loads((FIXTURES / "granite-rope" / "config.json").read_text()))
    assert rope.rope_theta == 10000.0 and rope.mamba_proj_bias and not rope.mamba_conv_bias


def test_hub_style_config():
    """As IBM publishes it: layers_block_type with mamba / attention, position_embedding_type nope,
    rope_theta, init_method, time_step_limit absent."""
    hub = config(layer_types=..., layers_block_type=["mamba", "attention", "mamba", "mamba", "attention"],
                 rope_parameters=..., rope_theta=10000, rope_scaling=None, dtype=..., torch_dtype="bfloat16",
                 init_method="mup", normalization_function="rmsnorm", time_step_limit=..., mamba_d_head=8)
    assert GraniteSpec.from_hf_config(hub, strict=True) == GraniteSpec.from_hf_config(config())


@pytest.mark.parametrize("changes, field", [
    (dict(num_local_experts=8), "num_local_experts"),
    (dict(num_local_experts=...), "num_local_experts"),  # absent means transformers' default of 8 experts
    (dict(position_embedding_type="alibi"), "position_embedding_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(time_step_limit=[0.001, 0.1]), "time_step_limit"),
    (dict(mamba_d_head=12), "mamba_d_head"),
    (dict(mamba_n_groups=3), "mamba_n_groups"),
    (dict(layer_types=["mamba", "attention", "moe", "mamba", "attention"]), "layer_types"),
    (dict(layers_block_type=["attention"] * 5), "layers_block_type"),
    (dict(normalization_function="layernorm"), "normalization_function"),
    (dict(position_embedding_type="rope", rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters"),
    (dict(embedding_multiplier=0), "embedding_multiplier"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(UnsupportedConfigError, match=repr(field)):
        GraniteSpec.from_hf_config(config(**changes))


def test_unknown_fields_warn_or_refuse():
    assert_unknown_fields_warn_or_refuse(GraniteSpec.from_hf_config, config())


def test_serving_paths_refuse_it_clearly():
    with pytest.raises(HybridModelNotServedError, match="'granitemoehybrid'.*has no ModelSpec"):
        load_model_spec(FIXTURES / "granite")
