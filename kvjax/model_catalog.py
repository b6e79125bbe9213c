"""Which model a name or a path means: a built-in model (`configs/models/NAME.toml`), a model
TOML file, or a Hugging Face checkpoint directory (its `config.json`).

Above both readers of a spec: `kvjax.model_spec` (the `ModelSpec` type and its TOML form) and
`kvjax.hf_config` (a `config.json` into a `ModelSpec`), so neither imports the other back.
Pure Python: the CLI sizes caches without JAX.
"""
from __future__ import annotations

from pathlib import Path

from kvjax.hf_config import HYBRID_MODEL_TYPES, read_config, spec_from_checkpoint
from kvjax.model_spec import MODELS_DIR, ModelSpec, available_models, checkpoint_dir

__all__ = ["load_model_spec", "servable_model"]


def load_model_spec(name_or_path: str | Path, *, strict_config: bool = False) -> ModelSpec:
    """A model by name (`configs/models/NAME.toml`), a TOML file, or a Hugging Face
    checkpoint directory (its `config.json`, read by `kvjax.hf_config`; `strict_config`
    refuses config fields kvjax does not know instead of warning about them)."""
    text = str(name_or_path)
    path = Path(text)
    if checkpoint_dir(text) is not None:
        return spec_from_checkpoint(path, strict=strict_config)
    if text.endswith(".toml") or path.parent != Path(".") or path.is_file():
        return ModelSpec.from_toml(path)
    candidate = MODELS_DIR / f"{text}.toml"
    if not candidate.is_file():
        raise ValueError(f"unknown model {text!r}; known models: {', '.join(available_models()) or 'none'}")
    return ModelSpec.from_toml(candidate)


def hybrid_checkpoint(name_or_path: str | Path) -> Path | None:
    """The checkpoint directory `name_or_path` names if it holds a hybrid model (its
    `config.json`'s model_type in `HYBRID_MODEL_TYPES`: loaded by `from_pretrained`, served by
    the engine's `HybridRunner`, no `ModelSpec`), else None."""
    path = checkpoint_dir(name_or_path)
    if path is None or not (path / "config.json").is_file():
        return None
    config = read_config(path)
    return path if isinstance(config, dict) and config.get("model_type") in HYBRID_MODEL_TYPES else None


def servable_model(name_or_path: str | Path, *, strict_config: bool = False) -> tuple[ModelSpec, Path | None]:
    """(spec, checkpoint directory or None) of a model someone asked to serve.

    A built-in spec of a published model (`random_weights = false`) has no weights: refuse it
    rather than build random parameters of its size. `strict_config`: see `load_model_spec`."""
    spec = load_model_spec(name_or_path, strict_config=strict_config)
    path = checkpoint_dir(name_or_path)
    if path is None and not spec.random_weights:
        demos = ", ".join(n for n in available_models() if load_model_spec(n).random_weights)
        raise ValueError(
            f"model {spec.name!r} describes a published model but kvjax has no weights for it: pass its Hugging Face "
            f"checkpoint directory instead; random-weight demo models: {demos}"
        )
    return spec, path
