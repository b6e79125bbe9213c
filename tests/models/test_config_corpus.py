"""Every config.json of the corpus (tests/fixtures/hf_configs, see its README.md) loads as published:
configs written by transformers 4.40 to 5.24 for every family, three converted from GGUF by
transformers, and real configs of published models. The known-good ones load in strict mode,
so none has a field kvjax does not know; the deliberately unsupported ones are refused by name."""
import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from kvjax.hf_config import UnsupportedConfigError, spec_from_checkpoint, spec_from_hf_config
from kvjax.model_catalog import load_model_spec
from kvjax.model_spec import ModelSpec

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
GOOD = sorted(p for p in CORPUS.rglob("*.json") if p.parent.name != "refused")
REFUSED_DIR = CORPUS / "refused"
# deliberately unsupported configs -> the field kvjax must name
REFUSED_BY = {
    "qwen2.5-7b-instruct-yarn-4.57.6.json": "rope_scaling",
    "qwen2.5-7b-instruct-yarn-5.0.0.json": "rope_parameters",
    "qwen2.5-7b-instruct-yarn-5.24.0.json": "rope_parameters",
    "llama-3.1-8b-instruct-awq-4.57.6.json": "quantization_config",
    "llama-3.1-8b-instruct-awq-5.0.0.json": "quantization_config",
    "llama-3.1-8b-instruct-awq-5.24.0.json": "quantization_config",
    "mixtral-8x7b-v0.1.json": "model_type",
    "gemma-2-2b.json": "model_type",
}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


def _id(p: Path) -> str:
    return str(p.relative_to(CORPUS))


def _load(path: Path) -> ModelSpec:
    """Strict, and with any warning an error: a known-good config has no field kvjax does not know."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return spec_from_checkpoint(path, strict=True)


def _architecture(spec: ModelSpec) -> dict:
    return {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("name", "source", "random_weights")}


def test_the_corpus_covers_every_family_release_and_source():
    types = {json.loads(p.read_text())["model_type"] for p in GOOD}
    assert types == set(FAMILIES)
    releases = {p.parent.name for p in (CORPUS / "transformers").glob("*/*.json")}
    assert {"4.40.2", "4.45.2", "4.50.3", "4.51.3", "4.53.3", "4.55.4", "4.57.6", "5.0.0", "5.24.0"} <= releases
    for release in ("4.51.3", "4.53.3", "4.55.4", "4.57.6", "5.0.0", "5.24.0"):  # every family, written by each recent release
        written = {json.loads(p.read_text())["model_type"] for p in (CORPUS / "transformers" / release).glob("*.json")}
        assert written == set(FAMILIES), release
    real = list((CORPUS / "real").glob("*.json"))
    assert len(real) >= 10
    assert {json.loads(p.read_text())["model_type"] for p in real} >= {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"}
    assert sorted(p.name for p in REFUSED_DIR.glob("*.json")) == sorted(REFUSED_BY)
    readme = (CORPUS / "README.md").read_text()
    for p in real + list((CORPUS / "gguf").glob("*.json")) + list(REFUSED_DIR.glob("*.json")):
        assert p.name in readme, f"README.md does not say where {p.name} came from"


@pytest.mark.parametrize("path", GOOD, ids=_id)
def test_known_good_configs_load_strictly(path):
    spec = _load(path)
    assert spec.num_layers >= 1 and spec.head_dim >= 1 and spec.vocab_size >= 1
    assert spec.source == str(path)


@pytest.mark.parametrize("path", sorted(REFUSED_DIR.glob("*.json")), ids=_id)
def test_unsupported_configs_are_refused_by_field(path):
    field = REFUSED_BY[path.name]
    with pytest.raises(UnsupportedConfigError, match=f"'{field}'"):
        spec_from_checkpoint(path)


def _by_model() -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for p in sorted((CORPUS / "transformers").glob("*/*.json")):
        out.setdefault(p.stem, []).append(p)
    return out


@pytest.mark.parametrize("model", sorted(_by_model()))
def test_every_transformers_release_spells_the_same_model(model):
    """4.40's torch_dtype / rope_scaling and 5.x's dtype / rope_parameters / layer_types give one spec."""
    specs = {p.parent.name: _architecture(_load(p)) for p in _by_model()[model]}
    first = next(iter(specs.values()))
    assert all(s == first for s in specs.values()), sorted(specs)


# transformers-written config -> the real published config (or built-in spec) of the same model
SAME_MODEL = {
    "llama-3.2-1b": CORPUS / "real" / "llama-3.2-1b.json",
    "smollm2-135m": CORPUS / "real" / "smollm2-135m.json",
    "qwen3-0.6b": CORPUS / "real" / "qwen3-0.6b.json",
    "gemma-3-1b": CORPUS / "real" / "gemma-3-1b-it.json",
    "mistral-7b-v0.1": "mistral-7b",
}


@pytest.mark.parametrize("model", sorted(SAME_MODEL))
def test_transformers_written_configs_match_the_published_model(model):
    expected = SAME_MODEL[model]
    want = load_model_spec(expected) if isinstance(expected, str) else _load(expected)
    got = _load(CORPUS / "transformers" / "5.24.0" / f"{model}.json")
    assert _architecture(got) == _architecture(want)


def test_real_configs_give_the_builtin_specs():
    for real, builtin in (("llama-3.1-8b", "llama-3.1-8b"), ("llama-3.1-70b", "llama-3.1-70b")):
        assert _architecture(_load(CORPUS / "real" / f"{real}.json")) == _architecture(load_model_spec(builtin))


def test_real_config_features():
    smol = _load(CORPUS / "real" / "smollm2-135m.json")  # is_llama_config, rope_interleaved false, transformers.js_config
    assert (smol.num_kv_heads, smol.head_dim, smol.rope_theta, smol.tie_embeddings) == (3, 64, 100000.0, True)
    mistral = _load(CORPUS / "real" / "mistral-7b-v0.3.json")  # sliding_window null: every layer global
    assert mistral.attention_windows is None and mistral.vocab_size == 32768
    qwen15 = _load(CORPUS / "real" / "qwen1.5-1.8b-chat.json")
    assert (qwen15.qkv_bias, qwen15.out_bias, qwen15.num_kv_heads) == (True, False, 16)
    gemma4b = _load(CORPUS / "transformers" / "5.24.0" / "gemma-3-4b-it.json")
    assert gemma4b.attention_windows == (1024,) * 5 + (131072,)
    assert gemma4b.rope_scaling is not None and gemma4b.rope_scaling.factor == 8.0


GGUF_OF = {  # GGUF-converted config -> the transformers-written config of the same model
    "smollm2-135m-gguf": "smollm2-135m",
    "qwen2.5-0.5b-instruct-gguf": "qwen2.5-0.5b",
    "gemma-3-1b-it-gguf": "gemma-3-1b",
}


@pytest.mark.parametrize("name", sorted(GGUF_OF))
def test_gguf_converted_configs_give_the_model_they_were_made_from(name):
    """transformers names a GGUF file's `general.name` `_model_name_or_path` and copies its token ids
    (`unk_token_id`, ...): both are ignored, and the spec is the model's, but for its norm epsilon
    (the GGUF's float32) and its dtype (the config names none: kvjax's float32 default)."""
    path = CORPUS / "gguf" / f"{name}.json"
    assert "_model_name_or_path" in json.loads(path.read_text())
    gguf = _load(path)
    ref = _load(CORPUS / "transformers" / "5.24.0" / f"{GGUF_OF[name]}.json")
    assert gguf.norm_eps == pytest.approx(ref.norm_eps, rel=1e-6) and gguf.dtype == "float32"
    assert _architecture(dataclasses.replace(gguf, norm_eps=ref.norm_eps, dtype=ref.dtype)) == _architecture(ref)


def test_corpus_configs_as_parsed_json_match_the_checkpoint_reader():
    path = CORPUS / "real" / "qwen2.5-3b.json"
    assert spec_from_hf_config(json.loads(path.read_text()), name=path.parent.name, source=str(path),
                               strict=True) == _load(path)


def test_from_pretrained_warns_or_refuses_unknown_fields(tmp_path):
    """The strict switch reaches the loader: refused before any weight is read; off, the model loads."""
    from hf_helpers import copy_fixture

    from kvjax.hf_config import UnknownConfigFieldWarning
    from kvjax.model_catalog import servable_model
    from kvjax.models import from_pretrained

    d = copy_fixture("qwen3", tmp_path)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "fancy_new_norm": True}))
    with pytest.raises(UnsupportedConfigError, match="'fancy_new_norm'"):
        from_pretrained(d, strict_config=True)
    with pytest.raises(UnsupportedConfigError, match="'fancy_new_norm'"):
        servable_model(d, strict_config=True)
    with pytest.warns(UnknownConfigFieldWarning, match="'fancy_new_norm'"):
        model = from_pretrained(d)
    assert model.spec == spec_from_hf_config(config, name=d.name, source=str(d / "config.json"))
