"""The persistent compilation cache: where it goes, the switch, the user's own setting kept,
and a second process that compiles nothing (every program read from the cache)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

from kvjax import compilation_cache as kcc

ROOT = Path(__file__).resolve().parents[1]

# a tiny model's jitted forward, with counts of JAX's compile / cache events ("compiles": programs
# asked of the backend, each then read from the cache (a hit) or compiled by XLA (a miss))
SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
counts = {"compiles": 0, "hits": 0, "misses": 0}
names = {"/jax/core/compile/backend_compile_duration": "compiles", "/jax/compilation_cache/cache_hits": "hits",
         "/jax/compilation_cache/cache_misses": "misses"}
def count(event, *args, **kwargs):
    if event in names:
        counts[names[event]] += 1
jax.monitoring.register_event_duration_secs_listener(count)
jax.monitoring.register_event_listener(count)
from kvjax.compilation_cache import enable_compilation_cache
from kvjax.model_spec import ModelSpec
from kvjax.models import Transformer, jit_dense_forward
spec = ModelSpec(name="s", num_layers=2, num_attention_heads=2, num_kv_heads=1, head_dim=8, hidden_size=16,
                 intermediate_size=32, vocab_size=31, max_seq_len=64, dtype="float32")
model = Transformer.from_spec(spec, seed=0)  # compiles the weight sampler before the cache is on
used = enable_compilation_cache()
before = dict(counts)
logits = jit_dense_forward(model)(jnp.zeros((1, 8), jnp.int32))
print(json.dumps({"dir": used, "sum": float(logits.sum()), **{k: counts[k] - before[k] for k in counts}}))
"""


def _run(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in (kcc.DIR_ENV, kcc.SWITCH_ENV)}
    env.update(env_extra, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing(tmp_path):
    cache = tmp_path / "jax-cache"
    first = _run({kcc.DIR_ENV: str(cache)})
    assert first["dir"] == str(cache) and first["compiles"] >= 1 and first["misses"] >= 1 and first["hits"] == 0
    entries = len(list(cache.iterdir()))
    assert entries >= 1
    second = _run({kcc.DIR_ENV: str(cache)})
    # every program the first process compiled (a miss each), the second reads: no XLA compilation
    assert second["misses"] == 0 and second["hits"] == second["compiles"] == first["misses"], (first, second)
    assert second["sum"] == first["sum"] and len(list(cache.iterdir())) == entries


@pytest.fixture
def restore_jax_cache():
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
             jax.config.jax_persistent_cache_min_entry_size_bytes)
    yield
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", saved[2])
    cc.reset_cache()


def test_where_the_cache_goes(tmp_path, monkeypatch, restore_jax_cache):
    monkeypatch.delenv(kcc.DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kcc.default_cache_dir() == tmp_path / "xdg" / "kvjax" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kcc.default_cache_dir() == tmp_path / "home" / ".cache" / "kvjax" / "jax"
    monkeypatch.setenv(kcc.DIR_ENV, str(tmp_path / "env"))
    assert kcc.default_cache_dir() == tmp_path / "env"

    jax.config.update("jax_compilation_cache_dir", None)
    assert kcc.enable_compilation_cache() == str(tmp_path / "env") and (tmp_path / "env").is_dir()
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    assert kcc.enable_compilation_cache(tmp_path / "kw") == str(tmp_path / "kw") == jax.config.jax_compilation_cache_dir
    # a directory the user set in jax.config stands, thresholds included
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "user"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
    assert kcc.enable_compilation_cache() == str(tmp_path / "user")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.0
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv(kcc.SWITCH_ENV, off)
        assert kcc.enable_compilation_cache(tmp_path / "kw") is None
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "user")


def test_serve_flags(tmp_path, monkeypatch, restore_jax_cache):
    """`kvjax serve --compilation-cache-dir DIR` puts the cache there (EngineCore's later call keeps
    it); `--no-compilation-cache` turns it off; both at once is refused."""
    from kvjax.cli import build_parser
    from kvjax.serve_command import compilation_cache

    monkeypatch.delenv(kcc.SWITCH_ENV, raising=False)
    parse = build_parser().parse_args
    args = parse(["serve", "tiny", "--compilation-cache-dir", str(tmp_path / "c")])
    assert compilation_cache(args) == str(tmp_path / "c") == jax.config.jax_compilation_cache_dir
    assert kcc.enable_compilation_cache() == str(tmp_path / "c")  # what EngineCore does next
    with pytest.raises(ValueError, match="contradict"):
        compilation_cache(parse(["serve", "tiny", "--no-compilation-cache", "--compilation-cache-dir", "x"]))
    saved = jax.config.jax_enable_compilation_cache
    try:
        assert compilation_cache(parse(["serve", "tiny", "--no-compilation-cache"])) is None
        assert kcc.enable_compilation_cache() is None
    finally:
        jax.config.update("jax_enable_compilation_cache", saved)
