"""`kvjax serve` flags reach the engine and the server (the blocking `serve` call is replaced,
so no server starts and nothing compiles); bad flags give one line, exit status 2."""
import kvjax.server
from kvjax.cli import main


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


def test_serve_bad_flags(capsys):
    assert main(["serve", "micro", "--option", "bogus=1"]) == 2
    assert "unknown option 'bogus'" in capsys.readouterr().err
    assert main(["serve", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["serve", "micro", "--queue-policy", "random"]) == 2
    assert "invalid choice" in capsys.readouterr().err
