"""The cache geometry of a hybrid checkpoint (recurrent + attention layers: LFM2, Granite-4.0-H,
Qwen3.5) for sizing: its attention layers' KV per token and one recurrent layer's state bytes,
read from the family's own spec (`kvjax.models.hybrid`), and the `CacheConfig` with a
`RECURRENT_STATES` window that `kvjax.capacity.cache_config_from_memory` sizes by TensorRT-LLM's
rule (docs/semantics.md, "Recurrent states"). `kvjax capacity --model DIR` uses it; the engine's
own hybrid wiring is elsewhere.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvjax.config import RECURRENT_STATES, CacheConfig

#: the checkpoints' model_type -> their family (`kvjax.models.pretrained.HYBRID_LOADERS`)
HYBRID_FAMILIES = {"lfm2": "LFM2", "granitemoehybrid": "Granite-4.0-H", "qwen3_5_text": "Qwen3.5", "qwen3_5": "Qwen3.5"}


@dataclasses.dataclass(frozen=True)
class HybridGeometry:
    """What sizing needs of a hybrid model. `recurrent[i]`: layer i keeps a recurrent state;
    `state_bytes`: one such layer's state for one sequence (conv + SSM / delta-rule state), in
    the model dtype (float32 SSM states); the rest as `ModelSpec`'s fields of the same names
    (so `kvjax.capacity.activation_reserve_bytes` reads it)."""

    name: str
    family: str
    dtype: str
    recurrent: tuple[bool, ...]
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    state_bytes: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool

    @property
    def num_layers(self) -> int:
        return len(self.recurrent)

    @property
    def num_recurrent_layers(self) -> int:
        return sum(self.recurrent)

    @property
    def kv_heads_per_layer(self) -> tuple[int, ...]:
        return (self.num_kv_heads,) * self.num_layers

    def cache_config(
        self, *, tokens_per_block: int, max_seq_len: int | None = None, dtype: str | None = None,
        snapshot_interval: int | None = None, **overrides: Any,
    ) -> CacheConfig:
        """A `CacheConfig` of this geometry (1 primary block per window: size it with
        `cache_config_from_memory`). `dtype`: the attention KV dtype (default the model's)."""
        seq = self.max_seq_len if max_seq_len is None else max_seq_len
        return CacheConfig(
            tokens_per_block=tokens_per_block,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_seq_len=seq,
            dtype=self.dtype if dtype is None else dtype,
            attention_windows=tuple(RECURRENT_STATES if r else seq for r in self.recurrent),
            recurrent_state_bytes=self.state_bytes,
            snapshot_interval=snapshot_interval,
            primary_blocks=1,
            **overrides,
        )


def hybrid_model_type(path: str | Path) -> str | None:
    """The checkpoint directory's model_type if it is a hybrid family's, else None."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # the ordinary reader reports a broken config
    return model_type if model_type in HYBRID_FAMILIES else None


def hybrid_geometry(path: str | Path, *, strict: bool = False) -> HybridGeometry:
    """The geometry of a hybrid checkpoint directory (`hybrid_geometry_from_config` of its
    config.json)."""
    path = Path(path)
    if hybrid_model_type(path) is None:
        raise ValueError(f"{path}: not a hybrid checkpoint (model_type one of {', '.join(HYBRID_FAMILIES)})")
    config = json.loads((path / "config.json").read_text())
    return hybrid_geometry_from_config(config, name=path.resolve().name, source=str(path / "config.json"), strict=strict)


def hybrid_geometry_from_config(
    config: dict, *, name: str = "checkpoint", source: str = "<config.json>", strict: bool = False
) -> HybridGeometry:
    """The geometry of a hybrid family's parsed config.json, from the family's strict config
    reader (`UnsupportedConfigError` for a config the family refuses; fields it leaves out take
    transformers' defaults)."""
    return hybrid_geometry_of_spec(hybrid_spec_from_config(config, name=name, source=source, strict=strict))


def hybrid_spec(path: str | Path, *, strict: bool = False) -> Any:
    """The family spec (`Lfm2Spec`, `GraniteSpec`, `Qwen35Spec`) of a hybrid checkpoint
    directory, from its config.json alone (no weights read): what `kvjax run` builds its
    workload and cache from."""
    path = Path(path)
    if hybrid_model_type(path) is None:
        raise ValueError(f"{path}: not a hybrid checkpoint (model_type one of {', '.join(HYBRID_FAMILIES)})")
    config = json.loads((path / "config.json").read_text())
    return hybrid_spec_from_config(config, name=path.resolve().name, source=str(path / "config.json"), strict=strict)


def hybrid_spec_from_config(config: dict, *, name: str, source: str, strict: bool = False) -> Any:
    """The family spec of a hybrid family's parsed config.json (its own config reader)."""
    from kvjax.models.hybrid import GraniteSpec, Lfm2Spec
    from kvjax.models.hybrid.qwen3_5 import qwen35_spec_from_config

    model_type = config.get("model_type")
    if model_type not in HYBRID_FAMILIES:
        raise ValueError(f"{source}: model_type {model_type!r} is not a hybrid family ({', '.join(HYBRID_FAMILIES)})")
    if model_type in ("qwen3_5_text", "qwen3_5"):
        return qwen35_spec_from_config(config, name=name, source=source, strict=strict)
    if model_type == "lfm2":
        return Lfm2Spec.from_hf_config(config, name=name, source=source, strict=strict)
    return GraniteSpec.from_hf_config(config, name=name, source=source, strict=strict)


def hybrid_geometry_of_spec(spec: Any) -> HybridGeometry:
    """The geometry of a hybrid family's spec (`Lfm2Spec`, `GraniteSpec`, `Qwen35Spec`): what
    `kvjax serve` sizes a loaded hybrid model's cache and activation reserve from. Which layers
    are recurrent and their state's bytes come from the serving layout (`hybrid_layout`), the
    one home of each family's state fields."""
    from kvjax.models.hybrid import GraniteSpec, Lfm2Spec
    from kvjax.models.hybrid.paged import hybrid_layout, is_hybrid_spec
    from kvjax.models.hybrid.qwen3_5 import Qwen35Spec

    if not is_hybrid_spec(spec):
        raise ValueError(f"{type(spec).__name__} is not a hybrid family's spec (Lfm2Spec, GraniteSpec, Qwen35Spec)")
    lay = hybrid_layout(spec)
    family = {Qwen35Spec: "Qwen3.5", Lfm2Spec: "LFM2", GraniteSpec: "Granite-4.0-H"}[type(spec)]
    ffn = spec.intermediate_size if isinstance(spec, Qwen35Spec) else spec.ffn_size
    return HybridGeometry(
        spec.name, family, spec.dtype, lay.recurrent, spec.num_kv_heads, spec.head_dim, spec.max_seq_len,
        lay.state_bytes, spec.hidden_size, spec.num_attention_heads, ffn, spec.vocab_size, spec.tie_embeddings,
    )
