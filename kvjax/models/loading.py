"""`load_model`: a built model and its tokenizer from what a user names (a built-in model, a
model TOML, a Hugging Face checkpoint directory, or a model already built).

Below the engine: `LLMEngine.from_options` and `kvjax.LLM` both load through it, so the engine
never imports the offline `LLM` layer above it.
"""
from __future__ import annotations

import os
from typing import Any

from kvjax.model_catalog import hybrid_checkpoint, servable_model
from kvjax.tokenizer import Tokenizer


def load_model(model: Any, *, seed: int = 0, dtype: Any = None, mesh: Any = None):
    """(model, tokenizer) for a built-in model name / TOML path, a checkpoint directory, or a
    built model (returned as is, with no tokenizer)."""
    if not isinstance(model, (str, os.PathLike)):
        if not hasattr(model, "spec"):
            raise TypeError(f"model must be a name, a path or a kvjax model with .spec, got {type(model).__name__}")
        return model, None
    hybrid = hybrid_checkpoint(os.fspath(model))
    if hybrid is not None:  # LFM2, Granite-4.0-H, Qwen3.5: no ModelSpec; their own loader
        from kvjax.models.pretrained import from_pretrained

        tokenizer = Tokenizer.from_pretrained(hybrid) if (hybrid / "tokenizer.json").is_file() else None
        return from_pretrained(hybrid, dtype=dtype, mesh=mesh), tokenizer
    spec, path = servable_model(os.fspath(model))
    if path is not None:
        from kvjax.models.pretrained import from_pretrained

        return from_pretrained(path, dtype=dtype, mesh=mesh), Tokenizer.from_pretrained(path)
    from kvjax.models.transformer import Transformer

    return Transformer.from_spec(spec, seed=seed, dtype=dtype), Tokenizer.builtin(spec.vocab_size)
