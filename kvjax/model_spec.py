"""`ModelSpec`: the shape of a decoder-only model, loaded from `configs/models/NAME.toml`.

It holds the real KV geometry of a model (layers, query / KV heads, head dim, attention windows,
dtype) plus what the built-in Flax model needs to build itself (widths, vocab, RoPE base, norm
epsilon, embedding tying). Pure Python: the CLI sizes caches of real models without JAX.

TOML keys are the dataclass fields below; unknown keys, missing required keys and wrong types
raise `ValueError` with a one-line message naming the file and the field.
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

from kvjax.config import DTYPE_BYTES, CacheConfig

MODELS_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"

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
class ModelSpec:
    """Geometry of a decoder-only transformer (a TOML file in `configs/models/`).

    `attention_windows` is a per-layer cycle like `CacheConfig.attention_windows` (layer `i`
    uses `attention_windows[i % len]`); `None` means every layer attends to the whole sequence.
    Gemma-3: `[1024, 1024, 1024, 1024, 1024, 131072]` (five local layers, then one global).
    `rope_local_theta`, when set, is the RoPE base of the sliding-window layers (Gemma-3).
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
    source: str = ""

    def __post_init__(self) -> None:
        _validate(self, "<ModelSpec>")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> "ModelSpec":
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
        for key in ("rope_theta", "rope_local_theta", "norm_eps"):
            v = values.get(key)
            if isinstance(v, int) and not isinstance(v, bool):
                values[key] = float(v)
        spec = object.__new__(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            object.__setattr__(spec, f.name, values.get(f.name, default))
        _validate(spec, source)
        return spec

    @classmethod
    def from_toml(cls, path: str | Path) -> "ModelSpec":
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

    @classmethod
    def load(cls, name_or_path: str | Path) -> "ModelSpec":
        """A model by name (`configs/models/NAME.toml`) or by path to a TOML file."""
        text = str(name_or_path)
        path = Path(text)
        if text.endswith(".toml") or path.parent != Path(".") or path.is_file():
            return cls.from_toml(path)
        candidate = MODELS_DIR / f"{text}.toml"
        if not candidate.is_file():
            raise ValueError(f"unknown model {text!r}; known models: {', '.join(available_models()) or 'none'}")
        return cls.from_toml(candidate)

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

    def cache_size_per_token(self, **kwargs: Any) -> dict[int, int]:
        """Window -> KV bytes per token (see `kvjax.capacity.cache_size_per_token`)."""
        from kvjax.capacity import cache_size_per_token

        return cache_size_per_token(self, **kwargs)


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
    if not isinstance(spec.tie_embeddings, bool):
        _fail(source, "tie_embeddings", f"expected true or false, got {spec.tie_embeddings!r}")
    if not isinstance(spec.source, str):
        _fail(source, "source", f"expected a string, got {spec.source!r}")
    if spec.head_dim % 2:
        _fail(source, "head_dim", f"RoPE needs an even head_dim, got {spec.head_dim}")
