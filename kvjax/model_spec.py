"""`ModelSpec`: the shape of a decoder-only model, from `configs/models/NAME.toml` or a checkpoint.

It holds the real KV geometry of a model (layers, query / KV heads, head dim, attention windows,
dtype) plus everything the Flax model needs to compute like the published architecture (widths,
vocab, RoPE bases and scaling, norm style, biases, q/k norms, activation, embedding scale and
tying). Architectures are feature flags here, not forks of the model: Llama 3.x, Mistral,
Qwen2/2.5, Qwen3 and Gemma 3 are combinations of these fields (see `kvjax.hf_config`, which
reads a Hugging Face `config.json` into a spec; `kvjax.model_catalog.load_model_spec` takes a
name, a TOML file or a checkpoint directory). Pure Python: the CLI sizes caches without JAX.

TOML keys are the dataclass fields below (`rope_scaling` is an inline table); unknown keys,
missing required keys and wrong types raise `ValueError` with a one-line message naming the
file and the field.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

from kvjax.config import DTYPE_BYTES, CacheConfig
from kvjax.package_data import configs_dir

MODELS_DIR = configs_dir() / "models"

EMBEDDING_SCALES = ("none", "sqrt_hidden_size")
MLP_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
ROPE_SCALING_KINDS = ("linear", "llama3")

_REQUIRED = (
    "name",
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "max_seq_len",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Rescaled RoPE frequencies for long context (applies to the global layers only).

    `linear`: every inverse frequency divided by `factor`. `llama3` (Llama 3.1+): wavelengths
    longer than `original_max_position_embeddings / low_freq_factor` are divided by `factor`,
    shorter than `... / high_freq_factor` kept, and the band between interpolated smoothly.
    """

    kind: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        src = "rope_scaling"
        if self.kind not in ROPE_SCALING_KINDS:
            _fail(src, "kind", f"expected one of {list(ROPE_SCALING_KINDS)}, got {self.kind!r}")
        _positive_float(src, "factor", self.factor)
        llama3 = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        for field in llama3:
            value = getattr(self, field)
            if self.kind == "llama3":
                if field == "original_max_position_embeddings":
                    _positive_int(src, field, value)
                else:
                    _positive_float(src, field, value)
            elif value is not None:
                _fail(src, field, f"only llama3 scaling takes it, got {value!r} with kind {self.kind!r}")
        hi, lo = self.high_freq_factor, self.low_freq_factor
        if self.kind == "llama3" and hi is not None and lo is not None and not hi > lo:  # both checked above
            _fail(src, "high_freq_factor", f"must exceed low_freq_factor ({hi} <= {lo})")

    @classmethod
    def from_dict(cls, data: Any, source: str) -> RopeScaling:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: field 'rope_scaling': expected a table, got {data!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: field 'rope_scaling': unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        values: dict[str, Any] = {k: float(v) if k in ("factor", "low_freq_factor", "high_freq_factor") and isinstance(v, int)
                  and not isinstance(v, bool) else v for k, v in data.items()}
        try:
            return cls(**values)
        except TypeError as e:
            raise ValueError(f"{source}: field 'rope_scaling': {e}") from None
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Geometry of a decoder-only transformer (a TOML file in `configs/models/`).

    `attention_windows` is a per-layer cycle like `CacheConfig.attention_windows` (layer `i`
    uses `attention_windows[i % len]`); `None` means every layer attends to the whole sequence.
    Gemma-3: `[1024, 1024, 1024, 1024, 1024, 131072]` (five local layers, then one global).
    `rope_local_theta`, when set, is the RoPE base of the sliding-window layers (Gemma-3);
    `rope_scaling` rescales the other layers' frequencies.

    Architecture features (defaults are Llama's):
    - `embedding_scale`: "none", or "sqrt_hidden_size" (Gemma, and kvjax's demo models):
      embeddings times sqrt(hidden_size), the factor rounded to the model dtype first.
    - `norm_weight_offset`: 0.0 for `x_hat * w` (Llama: normalise in float32, cast, then scale),
      1.0 for `x_hat * (1 + w)` (Gemma: scale in float32, then cast).
    - `sandwich_norms`: also normalise the attention and MLP outputs before each residual add (Gemma 3).
    - `qkv_bias`, `out_bias`: biases on the q/k/v projections (Qwen2) and on the output projection.
    - `qk_norm`: RMSNorm over head_dim on every query and key head before RoPE (Qwen3, Gemma 3).
    - `query_pre_attn_scalar`: attention scale is `query_pre_attn_scalar ** -0.5` (Gemma 3)
      instead of `head_dim ** -0.5`.
    - `mlp_activation`: gated MLP `down(act(gate(x)) * up(x))` with act "silu" (SwiGLU),
      "gelu_tanh" (GeGLU, tanh approximation) or "gelu" (exact).
    - `random_weights`: a kvjax demo/test model whose weights are drawn from a seed by design
      (`kvjax run` builds it); every other built-in spec describes a published model and needs
      its checkpoint.
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int | tuple[int, ...]
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_seq_len: int
    attention_windows: tuple[int, ...] | None = None
    dtype: str = "bfloat16"
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    embedding_scale: str = "none"
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    query_pre_attn_scalar: float | None = None
    mlp_activation: str = "silu"
    random_weights: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        _validate(self, "<ModelSpec>")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> ModelSpec:
        """Build from a mapping of TOML keys; errors name `source` and the offending field."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a table of model fields, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"{source}: unknown field {unknown[0]!r} (known: {', '.join(sorted(fields))})")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"{source}: missing required field {missing[0]!r}")
        values = dict(data)
        for key in ("num_kv_heads", "attention_windows"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        for key in ("rope_theta", "rope_local_theta", "norm_eps", "norm_weight_offset", "query_pre_attn_scalar"):
            v = values.get(key)
            if isinstance(v, int) and not isinstance(v, bool):
                values[key] = float(v)
        if values.get("rope_scaling") is not None:
            values["rope_scaling"] = RopeScaling.from_dict(values["rope_scaling"], source)
        spec = object.__new__(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            object.__setattr__(spec, f.name, values.get(f.name, default))
        _validate(spec, source)
        return spec

    @classmethod
    def from_toml(cls, path: str | Path) -> ModelSpec:
        """Load one model file."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"{path}: cannot read model file ({e.strerror or e})") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: invalid TOML ({e})") from None
        return cls.from_dict(data, source=str(path))

    # ------------------------------------------------------------------ derived views
    @property
    def kv_heads_per_layer(self) -> tuple[int, ...]:
        h = self.num_kv_heads
        return (h,) * self.num_layers if isinstance(h, int) else tuple(h)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Attention window of every layer, clamped to `max_seq_len`."""
        w = self.attention_windows or (self.max_seq_len,)
        return tuple(min(w[i % len(w)], self.max_seq_len) for i in range(self.num_layers))

    def is_sliding(self, layer: int) -> bool:
        return self.layer_windows[layer] < self.max_seq_len

    @property
    def dtype_bytes(self) -> float:
        return DTYPE_BYTES[self.dtype]

    def uses_local_rope(self, layer: int) -> bool:
        """Whether `layer` rotates with `rope_local_theta` (unscaled) instead of `rope_theta` + `rope_scaling`."""
        return self.rope_local_theta is not None and self.is_sliding(layer)

    @property
    def attention_scale(self) -> float:
        return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5

    @property
    def num_parameters(self) -> int:
        """Parameters of the model this spec builds (embedding counted once when tied)."""
        d, h, n, f, v = self.hidden_size, self.head_dim, self.num_attention_heads, self.intermediate_size, self.vocab_size
        total = v * d * (1 if self.tie_embeddings else 2) + d  # embeddings, head, final norm
        for k in self.kv_heads_per_layer:
            total += d * (n + 2 * k) * h + n * h * d + 3 * d * f  # projections, gated MLP
            total += d * (4 if self.sandwich_norms else 2)  # norms
            total += 2 * h if self.qk_norm else 0
            total += (n + 2 * k) * h if self.qkv_bias else 0
            total += d if self.out_bias else 0
        return total

    def cache_config(
        self,
        *,
        primary_blocks: int | dict[int, int] | None = None,
        secondary_blocks: int | dict[int, int] = 0,
        tokens_per_block: int = 32,
        max_seq_len: int | None = None,
        dtype: str | None = None,
        **overrides: Any,
    ) -> CacheConfig:
        """A `CacheConfig` with this model's KV geometry.

        `max_seq_len` defaults to the model's (and clamps the windows); `dtype` to the model's.
        Without `primary_blocks` every window gets enough blocks for one full-length sequence.
        Other `CacheConfig` fields pass through `overrides`.
        """
        config = CacheConfig(
            tokens_per_block=tokens_per_block,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_seq_len=self.max_seq_len if max_seq_len is None else max_seq_len,
            dtype=self.dtype if dtype is None else dtype,
            attention_windows=self.attention_windows,
            primary_blocks=1 if primary_blocks is None else primary_blocks,
            secondary_blocks=secondary_blocks,
            **overrides,
        )
        if primary_blocks is None:
            config = dataclasses.replace(config, primary_blocks=config.max_blocks_per_seq)
        return config


def checkpoint_dir(name_or_path: str | Path) -> Path | None:
    """The checkpoint directory `name_or_path` names, or None for a model name / TOML file.

    A directory counts when it holds a `config.json` or is written as a path (`./x`, `a/b`), so
    a stray folder named like a built-in model does not shadow it."""
    text = str(name_or_path)
    path = Path(text)
    if path.is_dir() and ((path / "config.json").is_file() or path.parent != Path(".") or text.startswith(".")):
        return path
    return None


def available_models() -> list[str]:
    """Names of the model files in `configs/models/`."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.toml"))


# ---------------------------------------------------------------------- validation
def _fail(source: str, field: str, message: str) -> None:
    raise ValueError(f"{source}: field {field!r}: {message}")


def _positive_int(source: str, field: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        _fail(source, field, f"expected a positive int, got {v!r}")


def _positive_float(source: str, field: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        _fail(source, field, f"expected a positive number, got {v!r}")


def _validate(spec: ModelSpec, source: str) -> None:
    if not isinstance(spec.name, str) or not spec.name:
        _fail(source, "name", f"expected a non-empty string, got {spec.name!r}")
    for field in ("num_layers", "num_attention_heads", "head_dim", "hidden_size", "intermediate_size",
                  "vocab_size", "max_seq_len"):
        _positive_int(source, field, getattr(spec, field))
    kv = spec.num_kv_heads
    if isinstance(kv, (tuple, list)):
        if len(kv) != spec.num_layers:
            _fail(source, "num_kv_heads", f"has {len(kv)} entries but num_layers = {spec.num_layers}")
        for h in kv:
            _positive_int(source, "num_kv_heads", h)
        object.__setattr__(spec, "num_kv_heads", tuple(kv))
    else:
        _positive_int(source, "num_kv_heads", kv)
    for h in set(spec.kv_heads_per_layer):
        if spec.num_attention_heads % h:
            _fail(source, "num_kv_heads", f"{h} does not divide num_attention_heads = {spec.num_attention_heads}")
    w = spec.attention_windows
    if w is not None:
        if not isinstance(w, (tuple, list)) or not w:
            _fail(source, "attention_windows", f"expected a non-empty list of positive ints, got {w!r}")
        for x in w:
            _positive_int(source, "attention_windows", x)
        object.__setattr__(spec, "attention_windows", tuple(w))
    if not isinstance(spec.dtype, str) or spec.dtype not in DTYPE_BYTES:
        _fail(source, "dtype", f"expected one of {sorted(DTYPE_BYTES)}, got {spec.dtype!r}")
    _positive_float(source, "rope_theta", spec.rope_theta)
    if spec.rope_local_theta is not None:
        _positive_float(source, "rope_local_theta", spec.rope_local_theta)
    _positive_float(source, "norm_eps", spec.norm_eps)
    for field in ("tie_embeddings", "sandwich_norms", "qkv_bias", "out_bias", "qk_norm", "random_weights"):
        if not isinstance(getattr(spec, field), bool):
            _fail(source, field, f"expected true or false, got {getattr(spec, field)!r}")
    if spec.rope_scaling is not None and not isinstance(spec.rope_scaling, RopeScaling):
        if not isinstance(spec.rope_scaling, dict):
            _fail(source, "rope_scaling", f"expected a table or RopeScaling, got {spec.rope_scaling!r}")
        object.__setattr__(spec, "rope_scaling", RopeScaling.from_dict(spec.rope_scaling, source))
    if spec.embedding_scale not in EMBEDDING_SCALES:
        _fail(source, "embedding_scale", f"expected one of {list(EMBEDDING_SCALES)}, got {spec.embedding_scale!r}")
    if spec.mlp_activation not in MLP_ACTIVATIONS:
        _fail(source, "mlp_activation", f"expected one of {list(MLP_ACTIVATIONS)}, got {spec.mlp_activation!r}")
    if isinstance(spec.norm_weight_offset, bool) or spec.norm_weight_offset not in (0.0, 1.0):
        _fail(source, "norm_weight_offset", f"expected 0.0 (x * w) or 1.0 (x * (1 + w)), got {spec.norm_weight_offset!r}")
    if spec.query_pre_attn_scalar is not None:
        _positive_float(source, "query_pre_attn_scalar", spec.query_pre_attn_scalar)
    if not isinstance(spec.source, str):
        _fail(source, "source", f"expected a string, got {spec.source!r}")
    if spec.head_dim % 2:
        _fail(source, "head_dim", f"RoPE needs an even head_dim, got {spec.head_dim}")
