"""`kvjax serve` flags reach the engine and the server (the blocking `serve` call and, but in
the warmup's own test, the warmup are replaced, so no server starts and nothing compiles); bad
flags give one line, exit status 2."""
import logging

import pytest

import kvjax.serve_command
import kvjax.server
from kvjax.cli import main

WARMUPS: list[str] = []


@pytest.fixture(autouse=True)
def no_warmup(request, monkeypatch):
    """Record the --warmup level instead of compiling (except where a test asks for the real one)."""
    WARMUPS.clear()
    if "real_warmup" not in request.keywords:
        monkeypatch.setattr(kvjax.serve_command, "warm_up", lambda core, level: WARMUPS.append(level))


@pytest.mark.real_warmup
def test_serve_warms_up_before_serving(monkeypatch, capsys, caplog):
    """By default the decode and single-chunk prefill programs compile before `serve` is called,
    with progress in the log; `--warmup none` compiles nothing."""
    seen = _fake_serve(monkeypatch)
    argv = ["serve", "micro", "--max-batch-size", "4", "--max-num-tokens", "32", "--primary-blocks", "40",
            "--tokens-per-block", "8", "--max-seq-len", "64", "--option", "min_batch_bucket=4",
            "--option", "min_chunk_bucket=32", "--option", "min_blocks_bucket=8"]
    with caplog.at_level(logging.INFO, logger="kvjax.serve"):
        assert main(argv) == 0, capsys.readouterr().err
    runner = seen["engine"].engine.runner
    # decode [4, 1] and one 32-token chunk, at the one table width (64 / 8 = 8 blocks); of the 3
    # shapes, the other mixes decodes with a chunk (two 32-token chunks would pad past the 32-token budget)
    assert runner.shapes == {(4, 0, 0, 8), (0, 1, 32, 8)} and runner.num_traces == 2
    text = caplog.text
    assert "warmup (common): 2/2 step programs ready" in text and "warmup (common) done: 2 of 3 step shapes" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvjax.serve"):
        assert main(argv + ["--warmup", "none"]) == 0
    assert seen["engine"].engine.runner.num_traces == 0
    assert "warmup off: the first request of each of the 3 step shapes compiles it" in caplog.text


def test_serve_flags(monkeypatch, capsys):
    seen = {}

    def fake_serve(engine, config, *, host, port, log_level):
        seen.update(engine=engine, config=config, host=host, port=port)

    monkeypatch.setattr(kvjax.server, "serve", fake_serve)
    code = main(["serve", "micro", "--port", "8123", "--served-model-name", "m", "--queue-policy", "lpm",
                 "--max-wait-steps", "7", "--max-batch-size", "3", "--max-num-tokens", "48", "--primary-blocks", "40",
                 "--tokens-per-block", "8", "--max-seq-len", "128", "--kv-cache-dtype", "fp8",
                 "--no-prefix-caching", "--max-pending", "5",
                 "--default-max-tokens", "9", "--shutdown-timeout", "2", "--option", "min_chunk_bucket=32"])
    assert code == 0, capsys.readouterr().err
    eng, cfg = seen["engine"], seen["config"]
    sched = eng.core.cfg.scheduler
    assert (sched.queue_policy.value, sched.max_wait_steps, sched.max_batch_size, sched.max_num_tokens) == ("lpm", 7, 3, 48)
    assert eng.core.cfg.buckets.min_chunk == 32
    cc = eng.core.cache_config
    assert (cc.tokens_per_block, cc.max_seq_len, cc.primary_blocks_for(128), cc.enable_block_reuse) == (8, 128, 40, False)
    assert cc.dtype == "float8_e4m3fn" and eng.core.pools.geometry.is_scaled
    assert (cfg.model_name, cfg.max_pending, cfg.default_max_tokens, cfg.shutdown_timeout) == ("m", 5, 9, 2.0)
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8123)
    assert eng.tokenizer is not None and eng.tokenizer.vocab_size == 512  # the built-in byte tokenizer
    assert WARMUPS == ["common"]  # the default


def test_serve_bad_flags(capsys):
    assert main(["serve", "micro", "--option", "bogus=1"]) == 2
    assert "unknown option 'bogus'" in capsys.readouterr().err
    assert main(["serve", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["serve", "micro", "--queue-policy", "random"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def _fake_serve(monkeypatch):
    seen = {}

    def fake_serve(engine, config, *, host, port, log_level):
        seen.update(engine=engine, config=config, log_level=log_level)

    monkeypatch.setattr(kvjax.server, "serve", fake_serve)
    return seen


def test_serve_vllm_flags(monkeypatch, capsys):
    """vLLM's spellings reach the same engine settings, with vLLM's meanings."""
    import math

    import jax.numpy as jnp
    import numpy as np

    from kvjax.models import Transformer

    seen = _fake_serve(monkeypatch)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    code = main(["serve", "micro", "--max-model-len", "128", "--max-num-seqs", "3", "--max-num-batched-tokens", "48",
                 "--block-size", "8", "--kv-cache-dtype", "fp8_e4m3", "--no-enable-prefix-caching", "--seed", "7",
                 "--model-seed", "3", "--dtype", "half", "--served-model-name", "a", "b", "--api-key", "k1",
                 "--kv-cache-memory-bytes", "1MiB", "--disable-log-requests", "--disable-log-stats",
                 "--log-level", "warning"])
    assert code == 0, capsys.readouterr().err
    eng, cfg = seen["engine"], seen["config"]
    sched = eng.core.cfg.scheduler
    assert (sched.max_batch_size, sched.max_num_tokens) == (3, 48)
    cc = eng.core.cache_config
    assert (cc.tokens_per_block, cc.max_seq_len, cc.enable_block_reuse, cc.dtype) == (8, 128, False, "float8_e4m3fn")
    assert eng.max_seq_len == 128 and eng.seed == 7  # --seed seeds sampling, as vLLM's
    # 1 MiB of fp8 KV: 2 (K, V) x 2 layers x 2 kv heads x 16 dims x 1 byte + a float32 scale per
    # (block, layer, K/V, kv head) over 8 tokens = 132 bytes per token; blocks round up, as TensorRT-LLM
    per_token = 2 * 2 * 2 * 16 + 2 * 2 * 2 * 4 // 8
    assert cc.primary_blocks_for(128) == math.ceil((1 << 20) // per_token / 8) == 993
    model = eng.engine.model
    assert model.dtype == jnp.float16  # --dtype half
    ref = Transformer.from_spec("micro", seed=3, dtype="float16")  # --model-seed: the weights
    np.testing.assert_array_equal(np.asarray(model.embed[...]), np.asarray(ref.embed[...]))
    assert (cfg.model_name, cfg.other_model_names, cfg.api_keys) == ("a", ("b",), ("k1",))
    assert (cfg.log_requests, cfg.log_stats_interval) == (False, None)


def test_serve_sizes_the_cache_from_device_memory(monkeypatch, capsys):
    """With device memory figures (a GPU), the cache gets utilization x limit - in use - activations."""
    import kvjax.serve_command
    from kvjax import capacity as C
    from kvjax.model_catalog import load_model_spec

    gib = 2**30
    stats = {"bytes_limit": 2 * gib, "bytes_in_use": 100 * 2**20}
    monkeypatch.setattr(kvjax.serve_command, "_device_memory_stats", lambda mesh: stats)
    seen = _fake_serve(monkeypatch)
    assert main(["serve", "micro", "--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "64",
                 "--log-level", "warning"]) == 0, capsys.readouterr().err
    spec = load_model_spec("micro")
    reserve = C.activation_reserve_bytes(spec, 64)
    budget = int(0.5 * 2 * gib) - 100 * 2**20 - reserve
    per_token = 2 * 2 * 2 * 16 * 4  # float32 K and V over 2 layers x 2 kv heads x 16 dims
    cc = seen["engine"].core.cache_config
    assert cc.primary_blocks_for(1024) == -(-(budget // per_token) // 16)
    # the weights alone over the usable memory: refused, and the message says so
    stats["bytes_in_use"] = gib + 1
    assert main(["serve", "micro", "--gpu-memory-utilization", "0.5"]) == 2
    assert "the weights alone" in capsys.readouterr().err


def test_serve_refuses_a_cache_too_small_for_max_model_len(monkeypatch, capsys):
    _fake_serve(monkeypatch)
    assert main(["serve", "micro", "--primary-blocks", "15", "--block-size", "8", "--max-model-len", "128"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "15 blocks of 8 tokens, 16 needed" in err and "to at most 120" in err
    assert main(["serve", "micro", "--primary-blocks", "16", "--kv-cache-memory-bytes", "1MiB"]) == 2
    assert "give one" in capsys.readouterr().err


def test_serve_tensor_parallel(monkeypatch, capsys):
    """--tensor-parallel-size shards weights and KV heads over that many devices (8 CPU devices here)."""
    seen = _fake_serve(monkeypatch)
    assert main(["serve", "micro", "--tensor-parallel-size", "2", "--primary-blocks", "64", "--log-level", "warning"]) == 0
    eng = seen["engine"]
    assert eng.engine.mesh is not None and eng.engine.mesh.devices.size == 2
    assert eng.engine.model.embed[...].sharding.mesh.devices.size == 2
    assert main(["serve", "micro", "--tensor-parallel-size", "16"]) == 2
    assert "--tensor-parallel-size 16 needs 16 devices, but JAX sees 8" in capsys.readouterr().err
    assert main(["serve", "micro", "--tensor-parallel-size", "8"]) == 2  # 4 query heads do not split 8 ways
    err = capsys.readouterr().err
    assert err.startswith("kvjax: error: ") and err.count("\n") == 1 and "num_attention_heads (4) divisible by 8" in err
    # 4 devices, 2 KV heads: each replicated twice; a device's 1 MiB holds one head's K/V, so the
    # cache (sized per device) gets as many tokens as one device holding micro's 2 heads in 2 MiB
    assert main(["serve", "micro", "--tensor-parallel-size", "4", "--kv-cache-memory-bytes", "1MiB",
                 "--log-level", "warning"]) == 0, capsys.readouterr().err
    eng = seen["engine"]
    cc = eng.core.cache_config
    assert cc.num_kv_heads == 4 and eng.engine.model.spec.num_kv_heads == 4
    per_device_token = 2 * 2 * 1 * 16 * 4  # float32 K and V over 2 layers x 1 kv head x 16 dims
    assert cc.primary_blocks_for(1024) == -(-((1 << 20) // per_device_token) // 16)
    assert eng.core.pools.primary[0].addressable_shards[0].data.shape[3] == 1


def test_strict_config_refuses_unknown_fields(monkeypatch, capsys, tmp_path):
    """A config.json with a field kvjax does not know loads with one warning, and is refused by
    name with --strict-config (serve and capacity)."""
    import json
    import shutil
    import warnings

    ckpt = tmp_path / "ckpt"
    shutil.copytree("tests/fixtures/hf/mistral", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "brand_new_knob": 3}))
    _fake_serve(monkeypatch)
    flags = ["--primary-blocks", "32", "--block-size", "8", "--max-model-len", "128", "--log-level", "warning"]
    assert main(["serve", str(ckpt), "--strict-config", *flags]) == 2
    assert "brand_new_knob" in capsys.readouterr().err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["serve", str(ckpt), *flags]) == 0, capsys.readouterr().err
    assert sum("brand_new_knob" in str(w.message) for w in caught) == 1  # the config is read once
    assert main(["capacity", "--model", str(ckpt), "--gpu-memory", "8GiB", "--strict-config"]) == 2
    assert "brand_new_knob" in capsys.readouterr().err
    assert main(["serve", "tests/fixtures/hf/mistral", "--strict-config", *flags]) == 0, capsys.readouterr().err
    assert main(["serve", "micro", "--strict-config"]) == 2
    assert "a built-in model has none" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "micro", "--swap-space", "4"],
     "unrecognized arguments: --swap-space 4 (--swap-space: kvjax's host tier is --secondary-blocks"),
    (["serve", "micro", "--enforce-eager", "--trust-remote-code"], "--enforce-eager: not supported: JAX compiles"),
    (["serve", "micro", "--pipeline-parallel-size=2"], "--pipeline-parallel-size: not supported; use --tensor-parallel-size"),
    (["run", "--workload", "chat", "--max-model-len", "64"], "--max-model-len: this command's flag is --max-seq-len"),
    (["serve", "micro", "--max-seq-length", "64"], "--max-seq-length: did you mean --max-seq-len?"),
    (["serve", "micro", "--kv-cache-dtype", "fp8_inc"], "kvjax has no 'fp8_inc' KV cache"),
    (["serve", "micro", "--dtype", "bf16"], "invalid choice 'bf16'"),
    (["serve", "micro", "--gpu-memory-utilization", "1.5"], "expected a number in (0, 1]"),
    (["serve", "micro", "--no-prefix-caching", "--enable-prefix-caching"], "contradicts"),
    (["serve", "micro", "--api-key", " "], "--api-key must not be empty"),
    (["serve", "micro", "--kv-cache-memory-bytes", "lots"], "invalid size 'lots'"),
])
def test_serve_vllm_flag_errors(capsys, argv, message):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kvjax: error: ") and err.count("\n") == 1, err
    assert message in err


def test_api_keys_from_the_flag_or_vllm_env():
    from kvjax.server.auth import api_keys

    assert api_keys(None, {}) == ()
    assert api_keys(None, {"VLLM_API_KEY": "e"}) == ("e",)
    assert api_keys(["a", "b"], {"VLLM_API_KEY": "e"}) == ("a", "b")  # the flag wins, as in vLLM
    with pytest.raises(ValueError, match="must not be empty"):
        api_keys([""], {})


@pytest.mark.parametrize("flag, on", [([], False), (["--async-scheduling"], True), (["--no-async-scheduling"], False)])
def test_serve_async_scheduling_flag(monkeypatch, capsys, flag, on):
    """vLLM's --async-scheduling / --no-async-scheduling reach the core (default off)."""
    seen = _fake_serve(monkeypatch)
    assert main(["serve", "micro", "--primary-blocks", "16", "--max-model-len", "128", *flag]) == 0, capsys.readouterr().err
    core = seen["engine"].core
    assert core.cfg.async_scheduling is on and core.overlap is on
