"""Read a Hugging Face `config.json` into a `ModelSpec`, refusing whatever kvjax would compute wrong.

Supported `model_type`s: `llama` (Llama 2/3.x), `mistral`, `qwen2` (Qwen2/2.5), `qwen3`,
`gemma3_text` (Gemma 3 text, e.g. gemma-3-1b) and `gemma3` (the multimodal Gemma 3
checkpoints; only their `text_config` is read, the vision tower is left unused). Hybrid model
types (`HYBRID_MODEL_TYPES`: recurrent + attention layers, e.g. Qwen3.5) have no `ModelSpec`:
their own modules read their configs (`kvjax.models.hybrid`, with this module's reader) and
`spec_from_hf_config` refuses them with `HybridModelNotServedError` (the engine does not serve
them yet).

Both spellings of a config are read: as published on the hub (`rope_theta`, `rope_scaling`,
`rope_local_base_freq`, `sliding_window_pattern`, `torch_dtype`) and as recent transformers
write it (`rope_parameters`, `layer_types`, `dtype`). A field that is absent takes the
transformers default of its model type, as transformers itself would.

Every field of a config is one of:
- numeric: read into the spec, with its supported values (`NUMERIC_FIELDS` documents them);
  an unsupported value raises `UnsupportedConfigError` naming the field, the value and what
  kvjax supports. That includes fields of other architectures that kvjax lacks
  (`quantization_config`, `rope_interleaved: true`, biases or softcapping where the family
  has none, ...), refused whenever their value would change the numbers;
- known not to change the numbers (`NOT_NUMERIC` and `NOT_NUMERIC_SUFFIXES`, each with the
  reason: provenance, token ids, generation defaults, training-only settings, tooling blocks):
  ignored;
- anything else is unknown: kvjax cannot tell whether it matters, so it reads the rest and
  names every unknown field in one `UnknownConfigFieldWarning` (also logged on the `kvjax`
  logger); with `strict=True` it raises `UnsupportedConfigError` instead.

Pure Python (no JAX): `kvjax capacity --model PATH` reads checkpoints without it.
"""
from __future__ import annotations

import json
import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvjax.errors import KVCacheError
from kvjax.model_spec import ModelSpec, RopeScaling

log = logging.getLogger("kvjax")
_KVJAX_DIR = str(Path(__file__).parent)  # as frames name their files (no resolving)


class UnsupportedConfigError(KVCacheError, ValueError):
    """A `config.json` field (or value) that kvjax cannot compute like transformers does."""


class HybridModelNotServedError(UnsupportedConfigError):
    """A hybrid model (recurrent + attention layers, `HYBRID_MODEL_TYPES`): kvjax computes it
    standalone (`kvjax.models.from_pretrained`) and serves it through its family's own spec
    (`kvjax.engine.hybrid_runner`), but has no `ModelSpec` for it: callers that need one get this."""


#: model_types of hybrid models (recurrent + attention layers) -> what they are; their configs
#: are read by their own modules under `kvjax.models.hybrid`, not into a `ModelSpec`
HYBRID_MODEL_TYPES: dict[str, str] = {
    "qwen3_5_text": "Qwen3.5, gated DeltaNet + gated attention",
    "qwen3_5": "Qwen3.5 multimodal checkpoint, gated DeltaNet + gated attention",
}


class UnknownConfigFieldWarning(UserWarning):
    """`config.json` fields kvjax does not know: ignored, but named so that a user can check them
    (`strict=True` / `strict_config=True` refuses them instead)."""


HYBRID_MODEL_TYPES.update({  # the families of kvjax.models.hybrid.lfm2 / .granite
    "lfm2": "LFM2, gated short convolutions + attention",
    "granitemoehybrid": "Granite-4.0-H dense, Mamba2 + attention",
})


#: Fields that never change a forward pass's numbers, and why.
NOT_NUMERIC: dict[str, str] = {
    "architectures": "class names; model_type decides the architecture",
    "model_type": "read to pick the architecture",
    # provenance and tooling
    "transformers_version": "provenance",
    "_name_or_path": "provenance",
    "_model_name_or_path": "provenance (the model name transformers copies from a GGUF file)",
    "_commit_hash": "provenance",
    "is_llama_config": "nanotron's marker of a Llama-shaped config (SmolLM); model_type decides",
    "transformers.js_config": "settings of the transformers.js ONNX runtime",
    "unsloth_version": "provenance (Unsloth records the version that fine-tuned or saved the model)",
    "unsloth_fixed": "provenance (Unsloth's marker of a re-uploaded checkpoint with tokenizer / template fixes)",
    "tokenizer_class": "tokenizer setting",
    # what transformers returns or which kernel it picks
    "use_cache": "transformers' generate() switch",
    "cache_implementation": "transformers' cache class choice",
    "output_attentions": "what transformers returns, not what it computes",
    "output_hidden_states": "what transformers returns",
    "return_dict": "what transformers returns",
    "torchscript": "export switch",
    "_attn_implementation_autoset": "transformers' kernel choice",
    "_attn_implementation": "transformers' kernel choice (eager/sdpa/flash compute the same maths)",
    "_attn_implementation_internal": "transformers' kernel choice",
    "attn_implementation": "transformers' kernel choice (eager/sdpa/flash compute the same maths)",
    "chunk_size_feed_forward": "runs the MLP over chunks of tokens; same maths",
    "is_decoder": "the decoder-only families are causal whatever it says",
    # training only
    "initializer_range": "training-time initialisation",
    "initializer_factor": "training-time initialisation",
    "pretraining_tp": "splits the same matmuls into slices during pretraining; same maths",
    "use_bfloat16": "legacy training switch; the weights' dtype comes from torch_dtype / dtype",
    "tf_legacy_loss": "training loss",
    "neftune_noise_alpha": "training-time embedding noise",
    "gradient_checkpointing": "training memory switch",
    # generation defaults (kvjax takes sampling settings per request)
    **{
        k: "generation default (kvjax takes sampling settings per request)"
        for k in (
            "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
            "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
            "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
            "num_return_sequences", "output_scores", "return_dict_in_generate", "remove_invalid_values",
            "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
        )
    },
    # task heads kvjax does not build (it serves the causal LM head)
    **{
        k: "task-head setting; kvjax serves the causal LM head"
        for k in ("finetuning_task", "id2label", "label2id", "prefix", "task_specific_params", "problem_type")
    },
    "max_window_layers": "read with use_sliding_window (Qwen); only matters when sliding is on",
}

#: Name endings of fields that never change the numbers (any `*_token_id`, `*_dropout`, ...).
NOT_NUMERIC_SUFFIXES: dict[str, str] = {
    "_token_id": "a token id (tokenizer / generation setting)",
    "_token_ids": "token ids (tokenizer / generation setting)",
    "_dropout": "dropout: training only (inference never drops)",
    "_pdrop": "dropout: training only (inference never drops)",
}


def _never(v: Any) -> bool:
    return False


def _one_of(*allowed: Any) -> Callable[[Any], bool]:
    """Membership that keeps JSON's types apart: `true` is not 1, `0` is not false (a float
    allowed matches the same number written as an int)."""

    def accepted(v: Any) -> bool:
        for a in allowed:
            if a is None or isinstance(a, bool):
                if v is a:
                    return True
            elif isinstance(a, float):
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v == a:
                    return True
            elif type(v) is type(a) and v == a:
                return True
        return False

    return accepted


#: Fields of other architectures (or other variants of a supported one) that would change the
#: numbers and that kvjax lacks: refused unless their value is the one that changes nothing.
#: A family that reads the field itself (Gemma 3's softcapping, Qwen's sliding window) checks it
#: there instead. field -> (value accepted?, what kvjax supports).
UNSUPPORTED_UNLESS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "quantization_config": (_never, "absent: kvjax loads float32, float16 and bfloat16 weights only"),
    "compression_config": (_never, "absent: kvjax loads float32, float16 and bfloat16 weights only"),
    "rope_interleaved": (_one_of(False, None), "false (rotate-half RoPE, as transformers computes it)"),
    "partial_rotary_factor": (_one_of(1.0, None), "1.0 (RoPE over the whole head)"),
    "attn_logit_softcapping": (_one_of(None), "null (no attention logit softcapping)"),
    "final_logit_softcapping": (_one_of(None), "null (no final logit softcapping)"),
    "attention_bias": (_one_of(False, None), "false for this model type (no attention biases)"),
    "mlp_bias": (_one_of(False, None), "false (no MLP biases)"),
    "use_sliding_window": (_one_of(False, None), "false for this model type (no sliding window)"),
    "sliding_window": (_one_of(None), "null for this model type (no sliding window)"),
    "use_bidirectional_attention": (_one_of(False, None), "false (causal attention)"),
    "use_qk_norm": (_one_of(False, None), "false for this model type (no q/k norms)"),
    "qk_layernorm": (_one_of(False, None), "false for this model type (no q/k norms)"),
    "attention_chunk_size": (_one_of(None), "null (no chunked attention)"),
    "num_experts": (_one_of(None, 0), "absent or 0 (dense MLP; mixture-of-experts is not supported)"),
    "num_local_experts": (_one_of(None, 0), "absent or 0 (dense MLP; mixture-of-experts is not supported)"),
    "n_routed_experts": (_one_of(None, 0), "absent or 0 (dense MLP; mixture-of-experts is not supported)"),
    "embedding_multiplier": (_one_of(None, 1.0), "1.0 (unscaled embeddings)"),
    "residual_multiplier": (_one_of(None, 1.0), "1.0 (unscaled residuals)"),
    "attention_multiplier": (_one_of(None), "absent (attention scale head_dim ** -0.5)"),
    "logits_scaling": (_one_of(None, 1.0), "1.0 (unscaled logits)"),
    "is_encoder_decoder": (_one_of(False, None), "false (decoder-only models)"),
    "add_cross_attention": (_one_of(False, None), "false (no cross-attention)"),
    "tie_encoder_decoder": (_one_of(False, None), "false (decoder-only models)"),
    "pruned_heads": (_one_of({}, None), "{} (no pruned heads)"),
}

#: Numeric fields, per model type, with the values kvjax supports (for docs and errors).
NUMERIC_FIELDS: dict[str, str] = {
    "vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
    "num_key_value_heads, head_dim, max_position_embeddings, rms_norm_eps": "any positive value",
    "torch_dtype / dtype": "float32, bfloat16, float16",
    "tie_word_embeddings": "true or false",
    "hidden_act (llama, mistral, qwen2, qwen3) / hidden_activation (gemma3)": "silu, gelu_pytorch_tanh, gelu_new, gelu",
    "rope_theta, rope_scaling / rope_parameters": "rope_type default, linear, llama3; partial_rotary_factor 1.0",
    "rope_local_base_freq (gemma3)": "any positive value (the sliding layers' own RoPE base, unscaled)",
    "attention_bias (llama, qwen3, gemma3)": "true or false (biases on q, k, v and o)",
    "mlp_bias (llama)": "false",
    "sliding_window (mistral, gemma3; qwen2/3 with use_sliding_window)": "a positive int or null",
    "use_sliding_window, layer_types, sliding_window_pattern": "sliding_attention / full_attention layers",
    "layer_types (llama, mistral)": "what the other fields give (full_attention; mistral: sliding_attention with a window)",
    "hidden_act (gemma3)": "absent, null or equal to hidden_activation (which Gemma 3 reads)",
    "query_pre_attn_scalar (gemma3)": "any positive value",
    "attn_logit_softcapping, final_logit_softcapping (gemma3)": "null (Gemma 3 has none)",
    "use_bidirectional_attention (gemma3)": "false",
    "use_mrope (qwen2)": "false",
    **{f"{k} (where the model type does not read it)": v[1] for k, v in UNSUPPORTED_UNLESS.items()},
}

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
_LAYER_TYPES = ("full_attention", "sliding_attention")

# transformers' defaults per model type, for fields a config leaves out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_theta=10000.0, hidden_act="silu"),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, rope_theta=10000.0, hidden_act="silu", sliding_window=4096),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_theta=10000.0, hidden_act="silu", sliding_window=4096,
                  max_window_layers=28),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, hidden_act="silu",
                  sliding_window=4096, max_window_layers=28),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        hidden_activation="gelu_pytorch_tanh", sliding_window=4096, sliding_window_pattern=6,
                        query_pre_attn_scalar=256),
}

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")

# top-level fields of the multimodal gemma3 config that text-only serving never reads
_GEMMA3_MULTIMODAL = {
    "vision_config": "vision tower (images are not served)",
    "mm_tokens_per_image": "image tokens (images are not served)",
    "boi_token_index": "image marker token",
    "eoi_token_index": "image marker token",
    "image_token_index": "image placeholder token",
    "image_token_id": "image placeholder token",
    "boi_token_id": "image marker token",
    "eoi_token_id": "image marker token",
    "text_config": "read as the model's config",
}


class _Fields:
    """A config being read: remembers which fields were used and sorts the rest at `finish`."""

    def __init__(self, data: dict, source: str, model_type: str, label: str | None = None,
                 defaults: dict[str, Any] | None = None):
        self.data = data
        self.source = source
        self.model_type = model_type
        self.label = label or model_type  # the model_type errors name (gemma3's outer config reads as gemma3_text)
        self.defaults = _DEFAULTS[model_type] if defaults is None else defaults  # a family read elsewhere brings its own
        self.used: set[str] = set()

    def error(self, field: str, message: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(f"{self.source}: config field {field!r}: {message}")

    def has(self, field: str) -> bool:
        return field in self.data

    def get(self, field: str, default: Any = ..., *, none_ok: bool = False) -> Any:
        self.used.add(field)
        if field in self.data and (self.data[field] is not None or none_ok):
            return self.data[field]
        if default is not ...:
            return default
        if field in self.defaults:
            return self.defaults[field]
        if field in self.data:
            return None
        raise self.error(field, "missing (and transformers has no default for it)")

    def int(self, field: str, default: Any = ...) -> int:
        v = self.get(field, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise self.error(field, f"expected a positive int, got {v!r}")
        return v

    def number(self, field: str, default: Any = ...) -> float:
        v = self.get(field, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise self.error(field, f"expected a positive number, got {v!r}")
        return float(v)

    def flag(self, field: str, default: Any = ...) -> bool:
        v = self.get(field, default)
        if not isinstance(v, bool):
            raise self.error(field, f"expected true or false, got {v!r}")
        return v

    def require(self, field: str, allowed: tuple, default: Any) -> Any:
        """A numeric field kvjax supports only at these values."""
        v = self.get(field, default, none_ok=True)
        if v not in allowed:
            raise self.error(field, f"value {v!r} is not supported (supported: {', '.join(map(repr, allowed))})")
        return v

    def finish(self, extra_ignored: dict[str, str] | None = None, prefix: str = "") -> list[str]:
        """Check the fields nothing read: refuse those that would change the numbers, ignore the
        known harmless ones, and return the unknown ones (named with `prefix`)."""
        ignored = {**NOT_NUMERIC, **(extra_ignored or {})}
        unknown = []
        for field in sorted(self.data):
            if field in self.used or field in ignored or field.endswith(tuple(NOT_NUMERIC_SUFFIXES)):
                continue
            if field in UNSUPPORTED_UNLESS:
                accepted, supported = UNSUPPORTED_UNLESS[field]
                value = self.data[field]
                if not accepted(value):
                    raise self.error(field, f"value {value!r} is not supported for model_type {self.label!r} "
                                            f"(supported: {supported})")
                continue
            unknown.append(prefix + field)
        return unknown


def _unknown_fields(unknown: list[str], source: str, model_type: str, strict: bool) -> None:
    """One warning (or, strict, one error) naming every unknown field of a config."""
    if not unknown:
        return
    names = ", ".join(map(repr, unknown))
    fields, they, change = ("fields", "they", "change") if len(unknown) > 1 else ("field", "it", "changes")
    if strict:
        raise UnsupportedConfigError(
            f"{source}: config {fields} {names}: unknown for model_type {model_type!r}; kvjax cannot tell whether "
            f"{they} {change} the model's numbers, and strict config checking refuses unknown fields (without it "
            "they are ignored with a warning)"
        )
    message = (
        f"{source}: kvjax ignores config {fields} {names}, unknown for model_type {model_type!r}: it cannot tell "
        f"whether {they} {change} the model's numbers; check {'them' if len(unknown) > 1 else 'it'} against the "
        "model's documentation, or refuse such checkpoints with strict_config=True (--strict-config on the command "
        "line)"
    )
    log.warning("%s", message)
    # attributed to the first caller outside kvjax (whichever kvjax entry point read the config)
    warnings.warn(message, UnknownConfigFieldWarning, skip_file_prefixes=(_KVJAX_DIR,))


# ---------------------------------------------------------------------- pieces
def _dtype(f: _Fields, fallback: str | None) -> str:
    values = {k: f.get(k, None) for k in ("dtype", "torch_dtype")}
    given = {k: v for k, v in values.items() if v is not None}
    for k, v in given.items():
        if v not in _DTYPES:
            raise f.error(k, f"value {v!r} is not supported (supported: {', '.join(_DTYPES)})")
    if len(set(given.values())) > 1:
        raise f.error("dtype", f"dtype {given['dtype']!r} and torch_dtype {given['torch_dtype']!r} disagree")
    if given:
        return _DTYPES[next(iter(given.values()))]
    return fallback or "float32"


def _rope_dict(f: _Fields, field: str, params: Any, default_theta: float) -> tuple[float, RopeScaling | None]:
    """One RoPE parameter dict (`rope_parameters` or legacy `rope_scaling` + `rope_theta`)."""
    if params is None:
        return default_theta, None
    if not isinstance(params, dict):
        raise f.error(field, f"expected a table, got {params!r}")
    known = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "partial_rotary_factor"}
    unknown = sorted(set(params) - known)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise f.error(field, f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")
    if unknown:
        raise f.error(field, f"key {unknown[0]!r} is not supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise f.error(field, f"partial_rotary_factor {params['partial_rotary_factor']!r} is not supported (supported: 1.0)")
    theta = params.get("rope_theta", default_theta)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise f.error(field, f"rope_theta must be a positive number, got {theta!r}")
    if kind == "default":
        extra = sorted(set(params) & {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
        if extra:
            raise f.error(field, f"key {extra[0]!r} does nothing with rope_type 'default'; refusing an ambiguous config")
        return float(theta), None
    try:
        if kind == "linear":
            extra = sorted(set(params) & {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
            if extra:
                raise f.error(field, f"key {extra[0]!r} is not used by rope_type 'linear'; refusing an ambiguous config")
            return float(theta), RopeScaling(kind="linear", factor=float(params["factor"]))
        return float(theta), RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=params["original_max_position_embeddings"],
        )
    except KeyError as e:
        raise f.error(field, f"rope_type {kind!r} needs {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, UnsupportedConfigError):
            raise
        raise f.error(field, str(e)) from None


def _rope(f: _Fields) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of a single-RoPE model, from either spelling."""
    default_theta = f.number("rope_theta")
    legacy = f.get("rope_scaling", None)
    new = f.get("rope_parameters", None)
    if new is not None:
        if legacy is not None:
            raise f.error("rope_scaling", "given together with rope_parameters; refusing an ambiguous config")
        theta, scaling = _rope_dict(f, "rope_parameters", new, default_theta)
        if (
            f.has("rope_theta")
            and f.data["rope_theta"] is not None
            and "rope_theta" in new
            and float(f.data["rope_theta"]) != theta
        ):
            raise f.error("rope_theta", f"{f.data['rope_theta']} disagrees with rope_parameters' {theta}")
        return theta, scaling
    return _rope_dict(f, "rope_scaling", legacy, default_theta) if legacy is not None else (default_theta, None)


def _activation(f: _Fields, field: str) -> str:
    act = f.get(field)
    if act not in _ACTIVATIONS:
        raise f.error(field, f"value {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[act]


def _layer_types(f: _Fields, layers: int, fallback: list[str]) -> list[str]:
    types = f.get("layer_types", None)
    if types is None:
        return fallback
    if not isinstance(types, list) or len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise f.error("layer_types", f"expected {layers} entries of {', '.join(_LAYER_TYPES)}, got {types!r}")
    return list(types)


def _same_layer_types(f: _Fields, implied: list[str]) -> None:
    """`layer_types` of a family whose layers the other fields decide: it must agree with them."""
    if f.has("layer_types") and f.get("layer_types", None) not in (None, implied):
        raise f.error("layer_types", f"{f.data['layer_types']!r} disagrees with the model's other fields, which give "
                                     f"{implied[0]!r} on every layer; refusing an ambiguous config")


def _windows(types: list[str], window: int | None, max_seq_len: int) -> tuple[int, ...] | None:
    """Per-layer windows as the shortest cycle that reproduces them (None: all global)."""
    per_layer = [window if t == "sliding_attention" and window is not None else max_seq_len for t in types]
    if all(w >= max_seq_len for w in per_layer):
        return None
    for period in range(1, len(per_layer) + 1):
        if all(per_layer[i] == per_layer[i % period] for i in range(len(per_layer))):
            return tuple(per_layer[:period])
    raise AssertionError("unreachable: the full list is a cycle")


def _geometry(f: _Fields, name: str, source: str) -> dict[str, Any]:
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv = f.get("num_key_value_heads", f.defaults.get("num_key_value_heads", heads))
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
        raise f.error("num_key_value_heads", f"expected a positive int, got {kv!r}")
    head_dim = f.get("head_dim", f.defaults.get("head_dim", hidden // heads))
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise f.error("head_dim", f"expected a positive int, got {head_dim!r}")
    return dict(
        name=name,
        source=source,
        num_layers=f.int("num_hidden_layers"),
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        vocab_size=f.int("vocab_size"),
        max_seq_len=f.int("max_position_embeddings"),
        norm_eps=f.number("rms_norm_eps"),
        tie_embeddings=f.flag("tie_word_embeddings", f.defaults["tie_word_embeddings"]),
    )


def _sliding(f: _Fields) -> int | None:
    """`sliding_window`: absent takes the model type's default, null means no window."""
    w = f.get("sliding_window", none_ok=True)
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise f.error("sliding_window", f"expected a positive int or null, got {w!r}")
    return w


# ---------------------------------------------------------------------- families
def _llama_like(f: _Fields, name: str, source: str, dtype: str | None) -> ModelSpec:
    kind = f.model_type
    values = _geometry(f, name, source)
    theta, scaling = _rope(f)
    layers = values["num_layers"]
    if kind == "llama":
        qkv_bias = out_bias = f.flag("attention_bias", False)
        f.require("mlp_bias", (False,), False)
        _same_layer_types(f, ["full_attention"] * layers)
        windows = None
    elif kind == "mistral":
        qkv_bias = out_bias = False
        window = _sliding(f)
        _same_layer_types(f, ["sliding_attention" if window is not None else "full_attention"] * layers)
        windows = _windows(["sliding_attention"] * layers, window, values["max_seq_len"])
    else:  # qwen2 / qwen3
        use = f.flag("use_sliding_window", False)
        window = _sliding(f) if use else None
        if not use:
            f.used.add("sliding_window")  # transformers drops it when use_sliding_window is false
        start = f.int("max_window_layers") if use else layers
        types = _layer_types(f, layers, ["sliding_attention" if i >= start else "full_attention" for i in range(layers)])
        windows = _windows(types, window, values["max_seq_len"])
        if kind == "qwen2":
            f.require("use_mrope", (False,), False)
            qkv_bias, out_bias = True, False  # Qwen2 always has q/k/v biases, never an output bias
            f.used.add("attention_bias")  # transformers' Qwen2 ignores it (its biases are fixed)
        else:
            qkv_bias = out_bias = f.flag("attention_bias", False)
    return ModelSpec(
        **values,
        attention_windows=windows,
        dtype=_dtype(f, dtype),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        qk_norm=kind == "qwen3",
        mlp_activation=_activation(f, "hidden_act"),
    )


def _gemma3(f: _Fields, name: str, source: str, dtype: str | None) -> ModelSpec:
    values = _geometry(f, name, source)
    layers = values["num_layers"]
    # hub configs say sliding_window_pattern; transformers 5 writes _sliding_window_pattern next to layer_types
    patterns = {k: f.int(k) for k in ("sliding_window_pattern", "_sliding_window_pattern") if f.has(k)}
    pattern = next(iter(patterns.values()), f.defaults["sliding_window_pattern"])
    from_pattern = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    types = _layer_types(f, layers, from_pattern)
    if len(set(patterns.values())) > 1 or (patterns and f.has("layer_types") and types != from_pattern):
        raise f.error("layer_types", f"disagrees with sliding_window_pattern {patterns}; refusing an ambiguous config")
    window = _sliding(f)
    if window is not None and window >= values["max_seq_len"] and "sliding_attention" in types:
        raise f.error("sliding_window", f"{window} >= max_position_embeddings {values['max_seq_len']}: the local layers "
                                        "would be indistinguishable from global ones (and need their own RoPE base)")
    # RoPE: global layers (rope_theta + rope_scaling), local layers (rope_local_base_freq, unscaled)
    params = f.get("rope_parameters", None)
    if params is not None:
        if f.get("rope_scaling", None) is not None:
            raise f.error("rope_scaling", "given together with rope_parameters; refusing an ambiguous config")
        if not isinstance(params, dict) or set(params) - set(_LAYER_TYPES):
            raise f.error("rope_parameters", f"expected a table keyed by {', '.join(_LAYER_TYPES)}, got {params!r}")
        theta, scaling = _rope_dict(f, "rope_parameters", params.get("full_attention"), f.number("rope_theta"))
        local_theta, local_scaling = _rope_dict(
            f, "rope_parameters", params.get("sliding_attention"), f.number("rope_local_base_freq")
        )
        if local_scaling is not None:
            raise f.error("rope_parameters", "scaled RoPE on the sliding_attention layers is not supported")
    else:
        theta, scaling = _rope_dict(f, "rope_scaling", f.get("rope_scaling", None), f.number("rope_theta"))
        local_theta = f.number("rope_local_base_freq")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        f.require(field, (None,), None)
    f.require("use_bidirectional_attention", (False, None), False)
    bias = f.flag("attention_bias", False)
    activation = _activation(f, "hidden_activation")
    if f.has("hidden_act") and f.get("hidden_act", None) not in (None, f.get("hidden_activation")):
        raise f.error("hidden_act", f"{f.data['hidden_act']!r} disagrees with hidden_activation "
                                    f"{f.get('hidden_activation')!r} (Gemma 3 reads hidden_activation); refusing an "
                                    "ambiguous config")
    return ModelSpec(
        **values,
        attention_windows=_windows(types, window, values["max_seq_len"]),
        dtype=_dtype(f, dtype),
        rope_theta=theta,
        rope_local_theta=local_theta,
        rope_scaling=scaling,
        embedding_scale="sqrt_hidden_size",
        norm_weight_offset=1.0,
        sandwich_norms=True,
        qkv_bias=bias,
        out_bias=bias,
        qk_norm=True,
        query_pre_attn_scalar=f.number("query_pre_attn_scalar"),
        mlp_activation=activation,
    )


# ---------------------------------------------------------------------- entry points
def spec_from_hf_config(
    config: dict, *, name: str = "checkpoint", source: str = "<config.json>", strict: bool = False
) -> ModelSpec:
    """The `ModelSpec` of a Hugging Face `config.json` (already parsed); see the module docstring.

    Unknown fields are named in one `UnknownConfigFieldWarning` and ignored; `strict=True`
    raises `UnsupportedConfigError` for them instead."""
    if not isinstance(config, dict):
        raise UnsupportedConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type == "gemma3":  # multimodal wrapper: serve its text model
        outer = _Fields(config, source, "gemma3_text", label="gemma3")
        outer.used.update({"model_type", "text_config"})
        dtype = _dtype(outer, None) if any(config.get(k) for k in ("dtype", "torch_dtype")) else None
        outer.get("tie_word_embeddings", None)  # the text config's own value decides
        unknown = outer.finish(_GEMMA3_MULTIMODAL)
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedConfigError(f"{source}: config field 'text_config': expected a table, got {text!r}")
        text = dict(text)
        if "tie_word_embeddings" not in text and isinstance(config.get("tie_word_embeddings"), bool):
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        if text.get("model_type", "gemma3_text") != "gemma3_text":
            raise UnsupportedConfigError(f"{source}: text_config model_type {text.get('model_type')!r} is not gemma3_text")
        f = _Fields(text, f"{source} text_config", "gemma3_text")
        spec = _gemma3(f, name, source, dtype)
        unknown += f.finish(prefix="text_config.")
        _unknown_fields(unknown, source, model_type, strict)
        return spec
    if model_type in HYBRID_MODEL_TYPES:
        raise HybridModelNotServedError(
            f"{source}: model_type {model_type!r} is a hybrid model ({HYBRID_MODEL_TYPES[model_type]}: recurrent and "
            "attention layers) and has no ModelSpec: kvjax.models.from_pretrained loads it, kvjax.LLM, Engine, "
            "`kvjax serve` and `kvjax run` serve it, `kvjax capacity` sizes it (docs/models.md, 'Serving hybrid models')"
        )
    if model_type not in _DEFAULTS:
        raise UnsupportedConfigError(
            f"{source}: config field 'model_type': {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    f = _Fields(config, source, model_type)
    spec = _gemma3(f, name, source, None) if model_type == "gemma3_text" else _llama_like(f, name, source, None)
    _unknown_fields(f.finish(), source, model_type, strict)
    return spec


def read_config(path: str | Path) -> dict:
    """Parsed `config.json` of a checkpoint directory (or the file itself), with clear errors."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        text = file.read_text()
    except OSError as e:
        raise ValueError(f"{file}: cannot read the checkpoint's config ({e.strerror or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from None


def spec_from_checkpoint(path: str | Path, *, strict: bool = False) -> ModelSpec:
    """The `ModelSpec` of a checkpoint directory (reads only `config.json`); `strict` refuses
    unknown config fields instead of warning about them."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    directory = file.parent
    return spec_from_hf_config(read_config(file), name=directory.resolve().name, source=str(file), strict=strict)


# ---------------------------------------------------------------------- for families read elsewhere
# The hybrid models' configs (`kvjax.models.hybrid`) are read with the same reader, so that
# they refuse, warn and default exactly as the families above.
ConfigFields = _Fields
report_unknown_fields = _unknown_fields
config_dtype = _dtype
config_activation = _activation
