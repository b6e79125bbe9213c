"""`kvjax serve` sizing a hybrid checkpoint's KV and state pools from memory (TensorRT-LLM's rule,
`kvjax.capacity.hybrid_pool_split`), checked against a hand computation on the LFM2 fixture;
no step runs (nothing compiles)."""
import pathlib

import pytest

from kvjax.config import RECURRENT_STATES

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf_hybrid"
# LFM2 fixture in float32: 2 attention layers x (K, V) x 2 kv heads x head dim 16 x 4 bytes per
# token; 3 conv layers x a [3 - 1, 64] float32 conv state per state block
KV_PER_TOKEN, STATE_BLOCK = 2 * 2 * 2 * 16 * 4, 3 * 2 * 64 * 4


def serve_engine_of(*flags):
    from kvjax.cli import build_parser
    from kvjax.serve_command import serve_engine, serve_options

    args = build_parser().parse_args(["serve", str(FIXTURES / "lfm2"), "--dtype", "float32", "--max-num-seqs", "4",
                                      "--tokens-per-block", "8", "--max-seq-len", "128", *flags])
    return serve_engine(args, serve_options(args))


def hand_sized(budget: int, batch: int = 4, interval: int = 8) -> dict[int, int]:
    """Blocks by hand: each token costs its KV plus 1/interval of a state block, each running
    request a live and a write state block."""
    tokens = (budget - 2 * batch * STATE_BLOCK) // (KV_PER_TOKEN + STATE_BLOCK // interval)
    return {128: -(-tokens // 8), RECURRENT_STATES: tokens // interval + 2 * batch}


def test_serve_sizes_a_hybrid_cache_from_kv_cache_memory_and_device_memory(monkeypatch):
    import kvjax.serve_command as S

    assert STATE_BLOCK % 8 == 0
    engine, sizing = serve_engine_of("--kv-cache-memory-bytes", str(2**20), "--snapshot-interval", "8")
    try:
        cc = engine.core.cache_config
        assert cc.snapshot_interval == 8
        assert (cc.recurrent_block_bytes, cc.cache_size_per_token[128]) == (STATE_BLOCK, KV_PER_TOKEN)
        assert cc.primary_blocks == hand_sized(2**20) == {128: 184, RECURRENT_STATES: 192}
        assert "--kv-cache-memory-bytes" in sizing
    finally:
        engine.close()
    # a device reporting its memory: utilization x limit - in use - the activation reserve
    limit, in_use = 64 * 2**20, 3 * 2**20
    monkeypatch.setattr(S, "_device_memory_stats", lambda mesh: {"bytes_limit": limit, "bytes_in_use": in_use})
    engine, sizing = serve_engine_of("--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "16")
    try:
        from kvjax import capacity as C
        from kvjax.hybrid_capacity import hybrid_geometry_of_spec

        reserve = C.activation_reserve_bytes(hybrid_geometry_of_spec(engine.engine.model.spec), 16)
        # per token: (2 x 64 + 2 x 4 x 16 + 2 x 2 x 16 + 3 x 48, the MLP width 68 x 2 / 3 up to 16) x 4 + logits
        assert reserve == 16 * ((2 * 64 + 2 * 4 * 16 + 2 * 2 * 16 + 3 * 48) * 4 + 4 * 256)
        cc = engine.core.cache_config
        assert cc.snapshot_interval == 16  # the default: the step's token budget (--max-num-batched-tokens)
        assert cc.primary_blocks == hand_sized(limit // 2 - in_use - reserve, interval=16)
        assert "0.5 x" in sizing
    finally:
        engine.close()


def test_serve_refuses_a_hybrid_budget_below_the_running_requests_state_blocks():
    with pytest.raises(ValueError, match="state blocks of each of 4 requests"):
        serve_engine_of("--kv-cache-memory-bytes", str(2 * 4 * STATE_BLOCK - 1))


def test_snapshot_interval_defaults_to_the_token_budget_and_is_refused_for_other_models():
    from kvjax.engine.config import cache_config, default_snapshot_interval
    from kvjax.model_catalog import load_model_spec

    assert default_snapshot_interval(16, 256) == 256
    assert default_snapshot_interval(16, 200) == 192  # whole blocks
    assert default_snapshot_interval(16, 8) == 16  # at least one block
    with pytest.raises(ValueError, match="snapshot_interval is for hybrid models"):
        cache_config(load_model_spec("micro"), {"snapshot_interval": 16})
