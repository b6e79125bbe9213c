"""config.json -> ModelSpec: published hub configs give the built-in specs, both spellings agree,
every field that would change the numbers is either supported or refused by name, harmless
fields are ignored, and unknown ones are named in one warning (refused in strict mode)."""
import copy
import dataclasses
import json
import logging
import warnings

import pytest
from hf_helpers import FAMILIES, FIXTURES

from kvjax.hf_config import (
    NOT_NUMERIC,
    NOT_NUMERIC_SUFFIXES,
    UNSUPPORTED_UNLESS,
    UnknownConfigFieldWarning,
    UnsupportedConfigError,
    spec_from_checkpoint,
    spec_from_hf_config,
)
from kvjax.model_catalog import load_model_spec
from kvjax.model_spec import ModelSpec, RopeScaling

# as published on the hub (config.json of each repository)
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_32_1B = {**LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
               "tie_word_embeddings": True,
               "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "factor": 32.0}}
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 152064,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}
# the multimodal checkpoints: a partial text_config (the rest are transformers' defaults)
GEMMA3_27B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                      "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}

PUBLISHED = {
    "llama-3.1-8b": LLAMA_31_8B,
    "mistral-7b": MISTRAL_7B,
    "qwen2.5-7b": QWEN25_7B,
    "gemma-3-27b": GEMMA3_27B_IT,
}


def _architecture(spec: ModelSpec) -> dict:
    """Every field that decides the numbers (not the name, provenance or demo flag)."""
    return {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("name", "source", "random_weights")}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_give_the_builtin_specs(name):
    spec = spec_from_hf_config(PUBLISHED[name], name=name)
    assert _architecture(spec) == _architecture(load_model_spec(name))
    assert not load_model_spec(name).random_weights


def test_features_of_published_configs():
    s = spec_from_hf_config(LLAMA_32_1B)
    assert (s.tie_embeddings, s.head_dim, s.rope_scaling.factor, s.embedding_scale) == (True, 64, 32.0, "none")
    s = spec_from_hf_config(QWEN25_7B)
    assert (s.qkv_bias, s.out_bias, s.attention_windows) == (True, False, None)  # sliding_window unused
    s = spec_from_hf_config(QWEN3_06B)
    assert (s.qk_norm, s.head_dim, s.hidden_size // s.num_attention_heads, s.tie_embeddings) == (True, 128, 64, True)
    s = spec_from_hf_config(GEMMA3_1B)
    assert s.attention_windows == (512,) * 5 + (32768,)
    assert (s.rope_theta, s.rope_local_theta, s.rope_scaling) == (1e6, 1e4, None)
    assert (s.norm_weight_offset, s.sandwich_norms, s.qk_norm, s.embedding_scale) == (1.0, True, True, "sqrt_hidden_size")
    assert (s.mlp_activation, s.attention_scale) == ("gelu_tanh", 256**-0.5)
    s = spec_from_hf_config(GEMMA3_27B_IT)
    assert s.attention_scale == 168**-0.5 and s.head_dim == 128
    assert [s.uses_local_rope(i) for i in range(6)] == [True] * 5 + [False]


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_config_spellings_agree(family):
    """config.json as transformers 5 writes it (rope_parameters, layer_types, dtype) and as the hub
    publishes it (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern, torch_dtype)."""
    new = spec_from_checkpoint(FIXTURES / family)
    hub = spec_from_hf_config(json.loads((FIXTURES / family / "config.hub.json").read_text()), name=new.name, source=new.source)
    assert new == hub
    raw = json.loads((FIXTURES / family / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_theta" not in raw


def test_transformers5_spellings_of_llama_and_gemma():
    llama = {k: v for k, v in LLAMA_31_8B.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    llama["rope_parameters"] = {**LLAMA_31_8B["rope_scaling"], "rope_theta": 500000.0}
    llama["dtype"] = "bfloat16"
    assert spec_from_hf_config(llama) == spec_from_hf_config(LLAMA_31_8B)
    gemma = {k: v for k, v in GEMMA3_1B.items() if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq",
                                                             "sliding_window_pattern", "torch_dtype")}
    gemma["layer_types"] = (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2
    gemma["_sliding_window_pattern"] = 6
    gemma["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    gemma["dtype"] = "bfloat16"
    assert spec_from_hf_config(gemma) == spec_from_hf_config(GEMMA3_1B)


def test_defaults_follow_transformers():
    """Fields a config leaves out take the model type's transformers default."""
    minimal = {"model_type": "mistral", "hidden_size": 128, "num_attention_heads": 8, "num_hidden_layers": 2,
               "intermediate_size": 96, "vocab_size": 100}
    s = spec_from_hf_config(minimal)
    assert (s.num_kv_heads, s.head_dim, s.attention_windows, s.max_seq_len) == (8, 16, (4096,), 131072)
    assert (s.rope_theta, s.norm_eps, s.dtype, s.tie_embeddings) == (10000.0, 1e-6, "float32", False)
    g = spec_from_hf_config({"model_type": "gemma3_text"})
    assert (g.vocab_size, g.head_dim, g.query_pre_attn_scalar, g.num_kv_heads) == (262208, 256, 256.0, 4)
    assert g.attention_windows == (4096,) * 5 + (131072,) and g.tie_embeddings
    q = spec_from_hf_config({"model_type": "qwen2", "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
                             "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1, "num_hidden_layers": 3})
    assert q.layer_windows == (32768, 64, 64)  # layers from max_window_layers on slide


def _edit(config: dict, **changes) -> dict:
    out = copy.deepcopy(config)
    for k, v in changes.items():
        if v is _DROP:
            out.pop(k, None)
        else:
            out[k] = v
    return out


_DROP = object()

REFUSED = [
    # (config, field named in the error, change)
    (LLAMA_31_8B, "model_type", {"model_type": "phi3"}),
    (LLAMA_31_8B, "quantization_config", {"quantization_config": {"quant_method": "awq", "bits": 4}}),
    (LLAMA_31_8B, "quantization_config", {"quantization_config": {"quant_method": "fp8"}, "unknown_x": 1}),
    (LLAMA_31_8B, "rope_interleaved", {"rope_interleaved": True}),
    (LLAMA_31_8B, "final_logit_softcapping", {"final_logit_softcapping": 30.0}),
    (LLAMA_31_8B, "num_local_experts", {"num_local_experts": 8}),
    (LLAMA_31_8B, "use_sliding_window", {"use_sliding_window": True}),
    (LLAMA_31_8B, "layer_types", {"layer_types": ["sliding_attention"] + ["full_attention"] * 31}),
    (LLAMA_31_8B, "is_encoder_decoder", {"is_encoder_decoder": True}),
    (LLAMA_31_8B, "embedding_multiplier", {"embedding_multiplier": 12.0}),
    (LLAMA_31_8B, "rope_interleaved", {"rope_interleaved": 0}),  # JSON types kept apart: 0 is not false
    (LLAMA_31_8B, "residual_multiplier", {"residual_multiplier": True}),
    (
        LLAMA_31_8B,
        "rope_scaling",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
    ),
    (LLAMA_31_8B, "rope_scaling", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    (LLAMA_31_8B, "rope_scaling", {"rope_scaling": {**LLAMA_31_8B["rope_scaling"], "partial_rotary_factor": 0.5}}),
    (LLAMA_31_8B, "rope_scaling", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),  # incomplete
    (LLAMA_31_8B, "rope_scaling", {"rope_scaling": {**LLAMA_31_8B["rope_scaling"], "beta_fast": 32}}),
    (LLAMA_31_8B, "rope_scaling", {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}),  # both spellings
    (LLAMA_31_8B, "partial_rotary_factor", {"partial_rotary_factor": 0.5}),
    (LLAMA_31_8B, "mlp_bias", {"mlp_bias": True}),
    (LLAMA_31_8B, "hidden_act", {"hidden_act": "relu"}),
    (LLAMA_31_8B, "torch_dtype", {"torch_dtype": "int8"}),
    (LLAMA_31_8B, "dtype", {"dtype": "float32"}),  # disagrees with torch_dtype
    (LLAMA_31_8B, "sliding_window", {"sliding_window": 4096}),  # Llama has none
    (LLAMA_31_8B, "num_key_value_heads", {"num_key_value_heads": 0}),
    (LLAMA_31_8B, "hidden_size", {"hidden_size": "4096"}),
    (MISTRAL_7B, "layer_types", {"layer_types": ["full_attention"] * 32}),
    (MISTRAL_7B, "attention_bias", {"attention_bias": True}),  # not a Mistral field
    (QWEN25_7B, "use_mrope", {"use_mrope": True}),
    (QWEN25_7B, "rope_scaling", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}),
    (QWEN25_7B, "layer_types", {"use_sliding_window": True, "layer_types": ["sliding"] * 28}),
    (QWEN3_06B, "attention_bias", {"attention_bias": "yes"}),
    (QWEN3_06B, "mlp_bias", {"mlp_bias": True}),
    (QWEN3_06B, "partial_rotary_factor", {"partial_rotary_factor": 0.5}),
    (GEMMA3_1B, "attn_logit_softcapping", {"attn_logit_softcapping": 50.0}),
    (GEMMA3_1B, "final_logit_softcapping", {"final_logit_softcapping": 30.0}),
    (GEMMA3_1B, "use_bidirectional_attention", {"use_bidirectional_attention": True}),
    (GEMMA3_1B, "hidden_activation", {"hidden_activation": "relu"}),
    (GEMMA3_1B, "hidden_act", {"hidden_act": "gelu"}),  # Gemma 3 reads hidden_activation only
    (GEMMA3_1B, "sliding_window", {"sliding_window": 40000}),  # no longer distinguishable from global
    (GEMMA3_1B, "layer_types", {"layer_types": ["full_attention"] * 26}),  # disagrees with the pattern
    (
        GEMMA3_1B,
        "rope_parameters",
        {
            "rope_scaling": _DROP,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            },
        },
    ),
    (GEMMA3_27B_IT, "quantization_config", {"quantization_config": {"quant_method": "gptq", "bits": 4}}),
]


@pytest.mark.parametrize(
    ("config", "field", "change"), REFUSED, ids=[f"{c['model_type']}-{f}-{i}" for i, (c, f, _) in enumerate(REFUSED)]
)
def test_unsupported_fields_are_refused_by_name(config, field, change):
    with pytest.raises(UnsupportedConfigError, match=f"'{field}'"):
        spec_from_hf_config(_edit(config, **change))


def test_refusals_say_field_value_and_what_is_supported():
    with pytest.raises(UnsupportedConfigError, match=r"'rope_interleaved': value True .*supported: false"):
        spec_from_hf_config(_edit(LLAMA_31_8B, rope_interleaved=True))


def _quiet(config: dict, **kwargs):
    """spec_from_hf_config that fails on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return spec_from_hf_config(config, **kwargs)


def test_every_not_numeric_field_is_ignored_without_a_warning():
    base = spec_from_hf_config(LLAMA_31_8B)
    harmless = {field: "anything" for field in NOT_NUMERIC if field != "model_type"}
    harmless.update({f"unk{suffix}": 7 for suffix in NOT_NUMERIC_SUFFIXES})
    harmless.update({"sep_token_id": 3, "forced_eos_token_id": [1, 2], "hidden_dropout": 0.1})
    assert _quiet(_edit(LLAMA_31_8B, **harmless), strict=True) == base


def test_unsupported_fields_at_their_harmless_values_are_accepted():
    """A field kvjax lacks is refused only at a value that would change the numbers."""
    harmless = {"rope_interleaved": False, "partial_rotary_factor": 1.0, "attn_logit_softcapping": None,
                "mlp_bias": False, "use_bidirectional_attention": False, "num_experts": 0, "pruned_heads": {},
                "is_encoder_decoder": False, "add_cross_attention": False, "attention_chunk_size": None,
                "embedding_multiplier": 1}
    assert set(harmless) <= set(UNSUPPORTED_UNLESS)
    spec = _quiet(_edit(QWEN3_06B, **harmless), strict=True)
    assert spec == spec_from_hf_config(QWEN3_06B)
    # Mistral has no attention biases: false is harmless; Qwen2's biases are fixed whatever it says
    assert _quiet(_edit(MISTRAL_7B, attention_bias=False)) == spec_from_hf_config(MISTRAL_7B)
    assert _quiet(_edit(QWEN25_7B, attention_bias=False)).qkv_bias


def test_unknown_fields_warn_once_naming_all_of_them(caplog):
    config = _edit(GEMMA3_27B_IT, audio_config={}, zeta=1)
    config["text_config"]["new_norm"] = "x"
    with caplog.at_level(logging.WARNING, logger="kvjax"), pytest.warns(UnknownConfigFieldWarning) as record:
        spec = spec_from_hf_config(config, source="g/config.json")
    assert len(record) == 1
    assert record[0].filename == __file__  # attributed to the caller, not to kvjax's internals
    message = str(record[0].message)
    assert "g/config.json" in message and "'audio_config', 'zeta', 'text_config.new_norm'" in message
    assert "strict_config=True" in message
    assert [r.getMessage() for r in caplog.records if r.name == "kvjax"] == [message]
    assert spec == spec_from_hf_config(GEMMA3_27B_IT, source="g/config.json")  # the rest is read as usual
    with pytest.warns(UnknownConfigFieldWarning, match=r"field 'some_new_field', unknown for model_type 'llama'"):
        assert spec_from_hf_config(_edit(LLAMA_31_8B, some_new_field=1)) == spec_from_hf_config(LLAMA_31_8B)


def test_strict_mode_refuses_unknown_fields(tmp_path):
    config = _edit(GEMMA3_27B_IT, audio_config={})
    config["text_config"]["new_norm"] = "x"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # strict raises instead of warning
        with pytest.raises(UnsupportedConfigError, match=r"fields 'audio_config', 'text_config.new_norm': unknown"):
            spec_from_hf_config(config, strict=True)
    (tmp_path / "config.json").write_text(json.dumps(_edit(LLAMA_31_8B, some_new_field=1)))
    with pytest.raises(UnsupportedConfigError, match="'some_new_field'"):
        spec_from_checkpoint(tmp_path, strict=True)
    with pytest.raises(UnsupportedConfigError, match="'some_new_field'"):
        load_model_spec(tmp_path, strict_config=True)
    with pytest.warns(UnknownConfigFieldWarning):
        assert load_model_spec(tmp_path).num_layers == 32


def test_a_refusal_comes_before_any_unknown_field_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UnsupportedConfigError, match="'rope_interleaved'"):
            spec_from_hf_config(_edit(LLAMA_31_8B, rope_interleaved=True, some_new_field=1))


def test_gemma3_multimodal_text_config_errors_name_the_text_config():
    bad = copy.deepcopy(GEMMA3_27B_IT)
    bad["text_config"]["final_logit_softcapping"] = 30.0
    with pytest.raises(UnsupportedConfigError, match="text_config.*'final_logit_softcapping'"):
        spec_from_hf_config(bad)


def test_rope_scaling_in_toml_is_validated(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        RopeScaling(kind="yarn", factor=2.0)
    with pytest.raises(ValueError, match="low_freq_factor"):
        RopeScaling(kind="linear", factor=2.0, low_freq_factor=1.0)
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_position_embeddings=8192)
    text = (FIXTURES.parent.parent.parent / "configs/models/llama-3.1-8b.toml").read_text()
    bad = tmp_path / "m.toml"
    bad.write_text(text.replace("low_freq_factor = 1.0", "low_freq = 1.0"))
    with pytest.raises(ValueError, match="rope_scaling.*low_freq"):
        ModelSpec.from_toml(bad)


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        spec_from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        spec_from_checkpoint(tmp_path)
