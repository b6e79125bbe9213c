"""ModelSpec: every shipped TOML loads, real geometries give hand-computed KV bytes, bad files fail in one line."""
import dataclasses
from pathlib import Path

import pytest

from kvjax import CacheConfig
from kvjax.capacity import cache_size_per_token
from kvjax.model_catalog import load_model_spec
from kvjax.model_spec import MODELS_DIR, ModelSpec, available_models

REAL_MODELS = ["llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "gemma-3-27b", "qwen2.5-7b", "gemma-2b", "falcon-7b"]

TINY_TOML = """
name = "t"
num_layers = 2
num_attention_heads = 4
num_kv_heads = 2
head_dim = 8
hidden_size = 32
intermediate_size = 64
vocab_size = 100
max_seq_len = 128
"""


@pytest.mark.parametrize("name", available_models())
def test_every_shipped_model_loads(name):
    spec = load_model_spec(name)
    assert spec.name == name
    assert spec == ModelSpec.from_toml(MODELS_DIR / f"{name}.toml")
    assert spec.source  # each file says where its numbers come from
    config = spec.cache_config()
    assert isinstance(config, CacheConfig)
    assert config.num_layers == spec.num_layers and config.dtype == spec.dtype
    assert config.primary_blocks_for(config.windows[-1]) == config.max_blocks_per_seq


def test_required_models_are_shipped():
    assert set(REAL_MODELS + ["tiny", "tiny-swa"]) <= set(available_models())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama-3.1-8b", {131072: 2 * 32 * 8 * 128 * 2}),  # 131072 B/token
        ("llama-3.1-70b", {131072: 2 * 80 * 8 * 128 * 2}),  # 327680
        ("mistral-7b", {4096: 2 * 32 * 8 * 128 * 2}),  # every layer slides over 4096 tokens
        ("qwen2.5-7b", {131072: 2 * 28 * 4 * 128 * 2}),  # 57344
        ("gemma-2b", {8192: 2 * 18 * 1 * 256 * 2}),  # multi-query: 18432
        ("falcon-7b", {2048: 2 * 32 * 1 * 64 * 2}),  # multi-query: 8192
        ("gemma-3-27b", {1024: 2 * 52 * 16 * 128 * 2, 131072: 2 * 10 * 16 * 128 * 2}),
        ("tiny", {2048: 2 * 4 * 2 * 32 * 4}),
        ("tiny-swa", {64: 2 * 3 * 2 * 32 * 4, 2048: 2 * 1 * 2 * 32 * 4}),
    ],
)
def test_bytes_per_token(name, expected):
    assert cache_size_per_token(load_model_spec(name)) == expected


def test_gemma3_layer_pattern():
    spec = load_model_spec("gemma-3-27b")
    windows = spec.layer_windows
    assert len(windows) == 62
    assert [i for i, w in enumerate(windows) if w == 131072] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert windows.count(1024) == 52
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (32, 16, 128)
    assert spec.is_sliding(0) and not spec.is_sliding(5)
    assert spec.cache_config().window_to_layers[131072] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]


def test_tiny_geometry():
    tiny = load_model_spec("tiny")
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_attention_heads, tiny.num_kv_heads, tiny.head_dim) == (
        4, 256, 8, 2, 32)
    assert (tiny.vocab_size, tiny.dtype) == (4096, "float32")
    swa = load_model_spec("tiny-swa")
    assert swa.layer_windows == (64, 64, 64, 2048)
    assert dataclasses.replace(swa, attention_windows=None, name="x").layer_windows == (2048,) * 4


def test_load_by_path_and_cache_config_overrides(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(TINY_TOML)
    spec = load_model_spec(path)
    assert spec.num_kv_heads == 2 and spec.attention_windows is None and spec.dtype == "bfloat16"
    assert load_model_spec(str(path)) == spec
    config = spec.cache_config(primary_blocks=10, secondary_blocks=5, tokens_per_block=16, max_seq_len=64,
                               dtype="float32", enable_block_reuse=False)
    assert (config.primary_blocks, config.secondary_blocks, config.max_seq_len) == (10, 5, 64)
    assert not config.enable_block_reuse and config.dtype == "float32"


def test_per_layer_kv_heads(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(TINY_TOML.replace("num_kv_heads = 2", "num_kv_heads = [2, 4]"))
    spec = ModelSpec.from_toml(path)
    assert spec.kv_heads_per_layer == (2, 4)
    assert cache_size_per_token(spec) == {128: 2 * (2 + 4) * 8 * 2}


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.replace('name = "t"\n', ""), "missing required field 'name'"),
        (lambda t: t + "colour = 3\n", "unknown field 'colour'"),
        (lambda t: t.replace("num_layers = 2", 'num_layers = "2"'), "field 'num_layers': expected a positive int"),
        (lambda t: t.replace("num_layers = 2", "num_layers = 0"), "field 'num_layers'"),
        (lambda t: t.replace("num_layers = 2", "num_layers = true"), "field 'num_layers'"),
        (lambda t: t.replace("head_dim = 8", "head_dim = 8.0"), "field 'head_dim'"),
        (lambda t: t.replace("head_dim = 8", "head_dim = 7"), "field 'head_dim': RoPE needs an even"),
        (lambda t: t.replace("num_kv_heads = 2", "num_kv_heads = 3"), "field 'num_kv_heads': 3 does not divide"),
        (lambda t: t.replace("num_kv_heads = 2", "num_kv_heads = [2]"), "field 'num_kv_heads': has 1 entries"),
        (lambda t: t + 'dtype = "float64"\n', "field 'dtype'"),
        (lambda t: t + "attention_windows = []\n", "field 'attention_windows'"),
        (lambda t: t + "attention_windows = [64, -1]\n", "field 'attention_windows'"),
        (lambda t: t + 'rope_theta = "big"\n', "field 'rope_theta'"),
        (lambda t: t + "tie_embeddings = 1\n", "field 'tie_embeddings'"),
        (lambda t: t + "name = [\n", "invalid TOML"),
    ],
)
def test_bad_files_raise_one_line_value_error(tmp_path, edit, match):
    path = tmp_path / "bad.toml"
    path.write_text(edit(TINY_TOML))
    with pytest.raises(ValueError, match=match) as info:
        ModelSpec.from_toml(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message


def test_unknown_model_name_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gpt-17'.*llama-3.1-8b"):
        load_model_spec("gpt-17")
    with pytest.raises(ValueError, match="cannot read model file"):
        load_model_spec(tmp_path / "nope.toml")


def test_direct_construction_is_validated():
    with pytest.raises(ValueError, match="field 'vocab_size'"):
        ModelSpec(name="x", num_layers=1, num_attention_heads=1, num_kv_heads=1, head_dim=2, hidden_size=2,
                  intermediate_size=2, vocab_size=0, max_seq_len=8)


def test_load_a_checkpoint_directory_and_names_are_not_shadowed(tmp_path, monkeypatch):
    root = Path(__file__).resolve().parent
    spec = load_model_spec(root / "fixtures" / "hf" / "qwen3")
    assert spec.name == "qwen3" and spec.qk_norm and spec.source.endswith("config.json")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # a folder without config.json named like a built-in model
    assert load_model_spec("tiny").random_weights


def test_demo_models_are_random_weight_and_published_ones_are_not():
    assert {n for n in available_models() if load_model_spec(n).random_weights} == {"tiny", "tiny-swa", "micro", "micro-swa"}
    assert load_model_spec("tiny").embedding_scale == "sqrt_hidden_size"  # the demo's numbers depend on it
