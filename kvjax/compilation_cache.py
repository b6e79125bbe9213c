"""JAX's persistent compilation cache, on by default for kvjax's programs.

A serving process compiles dozens of bucketed programs (prefill and decode shapes); with the
cache, a second start of the same model reads them from disk instead of compiling again.
`enable_compilation_cache()` runs where kvjax builds an engine (`EngineCore`, so `kvjax.LLM`,
`Engine.run` and `kvjax serve`). Where the cache lives, first match wins:

1. the `cache_dir` argument;
2. a directory already set in `jax.config` (`jax_compilation_cache_dir`): the user's choice stands,
   thresholds included;
3. `$KVJAX_COMPILATION_CACHE_DIR`;
4. `$XDG_CACHE_HOME/kvjax/jax`, else `~/.cache/kvjax/jax`.

`KVJAX_COMPILATION_CACHE=0` (or `false` / `no` / `off`) turns it off, as does
`jax_enable_compilation_cache=False`. When kvjax picks the directory it also caches every
program, however fast it compiled or small it is (jax's defaults skip programs compiled in
under a second: most of a small model's programs on CPU).
"""
from __future__ import annotations

import os
from pathlib import Path

DIR_ENV = "KVJAX_COMPILATION_CACHE_DIR"
SWITCH_ENV = "KVJAX_COMPILATION_CACHE"
_OFF = ("0", "false", "no", "off")


def default_cache_dir() -> Path:
    """`$KVJAX_COMPILATION_CACHE_DIR`, else `$XDG_CACHE_HOME/kvjax/jax`, else `~/.cache/kvjax/jax`."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvjax" / "jax"


def enable_compilation_cache(cache_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Point JAX's persistent compilation cache at kvjax's directory (see the module docstring).

    Returns the directory in use, or None when the cache is off. Idempotent; safe after JAX has
    already compiled other programs (a cache JAX found unconfigured is re-initialised).
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    if os.environ.get(SWITCH_ENV, "").strip().lower() in _OFF or not jax.config.jax_enable_compilation_cache:
        return None
    configured = jax.config.jax_compilation_cache_dir
    if cache_dir is None and configured:
        return str(configured)
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    if str(path) != configured:
        jax.config.update("jax_compilation_cache_dir", str(path))
        cc.reset_cache()  # JAX decides once whether a cache is in use; make it look again
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return str(path)
