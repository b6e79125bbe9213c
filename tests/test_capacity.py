"""kvjax.capacity: TensorRT-LLM's sizing formulas, checked against hand-computed values."""
import sys

import pytest

from kvjax import capacity as C
from kvjax.model_catalog import load_model_spec

GiB = 2**30
MiB = 2**20


# --------------------------------------------------------------------------- per-beam requirements
@pytest.mark.parametrize(
    ("seq_len", "sink", "window", "tpb", "expected"),
    [
        (100, 0, 1024, 32, 4),  # ceil(100/32)
        (1024, 0, 1024, 32, 32),  # exactly the window: no SWA extra block
        (1025, 0, 1024, 32, 33),  # past the window: ceil(1024/32) + 1
        (2000, 0, 1024, 32, 33),
        (1025, 0, 1024, 64, 17),
        (10, 4, 100, 16, 2),  # sink 4 -> bubble 12: ceil((10 + 12)/16)
        (10, 16, 100, 16, 1),  # sink a multiple of tpb: no bubble
        (0, 0, 64, 16, 0),
    ],
)
def test_max_block_requirements_per_beam(seq_len, sink, window, tpb, expected):
    assert C.max_block_requirements_per_beam(seq_len, sink, window, tpb) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((257, 255, 0, 412, 4, 64), 26),  # TensorRT-LLM's own test: 2 + (5 + 1) * 4
        ((100, 28, 0, 1024, 1, 32), 4),  # beam 1: per_beam(128)
        ((10, 100, 0, 64, 2, 16), 10),  # window <= out: per_beam(110, window 64) = 4 + 1, times 2 beams
        # ctx = min(1024, 50) - 20 = 30, ctx_blocks = (30 + 12)//16 = 2, left = -2: 2 + (ceil(18/16) + 1) * 2
        ((30, 20, 4, 1024, 2, 16), 8),
        # ctx = min(1024, 128) - 28 = 100 tokens: 3 full shared blocks of 32, left 4: 3 + (ceil(32/32) + 1) * 3
        ((100, 28, 0, 1024, 3, 32), 9),
    ],
)
def test_max_block_requirements(args, expected):
    assert C.max_block_requirements(*args) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((1000, 100, 0, 100, 1, 32), 1100),  # out needs 4 blocks; 96 spare blocks cover all of in + out
        ((1000, 100, 0, 10, 1, 32), 292),  # 100 + (10 - 4) * 32
        ((1000, 100, 0, 3, 1, 32), 96),  # out alone needs 4 > 3 blocks: (3 // 1) * 32
        ((1000, 100, 0, 5, 2, 32), 64),  # beam 2: out needs 4 * 2 = 8 > 5: (5 // 2) * 32
        ((1000, 0, 0, 7, 1, 32), 224),  # empty output: the whole capacity serves the context
        ((1000, 0, 4, 7, 1, 32), 192),  # ... less the sink bubble's block: (7 - 1) * 32
    ],
)
def test_max_attention_window(args, expected):
    assert C.max_attention_window(*args) == expected


# --------------------------------------------------------------------------- shares and blocks
SWA_LAYERS = {64: [0, 1, 2], 2048: [3]}
SWA_BYTES = {64: 1536, 2048: 512}  # tiny-swa in float32: 2 * 3 layers * 2 heads * 32 * 4, and 1 layer


def test_window_size_shares_vswa():
    # weights 64 * 1536 = 98304 and 2048 * 512 = 1048576 -> 3/35 and 32/35
    shares = C.window_size_shares(SWA_LAYERS, SWA_BYTES)
    assert shares == pytest.approx({64: 3 / 35, 2048: 32 / 35})
    assert sum(shares.values()) == pytest.approx(1.0)


def test_window_size_shares_single_window():
    assert C.window_size_shares({4096: [0, 1]}, {4096: 100}) == {4096: 1.0}


def test_calculate_max_num_blocks_vswa():
    # window 64: 3/35 * 35 MiB / 1536 B = 2048 tokens = 128 blocks of 16; window 2048: 32 MiB / 512 = 4096 blocks.
    blocks = C.calculate_max_num_blocks(SWA_LAYERS, SWA_BYTES, 16, 35 * MiB, 35 * MiB // 2)
    assert blocks == {64: (128, 64), 2048: (4096, 2048)}


def test_calculate_max_num_blocks_max_tokens_caps_primary_only():
    blocks = C.calculate_max_num_blocks(SWA_LAYERS, SWA_BYTES, 16, 35 * MiB, 35 * MiB // 2, max_tokens=1000)
    assert blocks == {64: (63, 64), 2048: (63, 2048)}  # ceil(1000 / 16) = 63


def test_calculate_max_num_blocks_rounding():
    # 100 tokens' worth of bytes: primary rounds up (ceil_div(100, 16) = 7), secondary down (100 // 16 = 6).
    assert C.calculate_max_num_blocks({2048: [0]}, {2048: 2048}, 16, 2048 * 100, 2048 * 100) == {2048: (7, 6)}
    assert C.calculate_max_num_blocks({2048: [0]}, {2048: 2048}, 16, 0) == {2048: (0, 0)}


# --------------------------------------------------------------------------- bytes per token
def test_cache_size_per_token_of_specs_and_configs():
    llama = load_model_spec("llama-3.1-8b")
    assert C.cache_size_per_token(llama) == {131072: 131072}  # 2 * 32 * 8 * 128 * 2
    assert C.cache_size_per_token(llama.cache_config()) == {131072: 131072}
    # fp8: 1 byte per value plus a float32 scale per (block of 32, layer, K/V, kv head)
    assert C.cache_size_per_token(llama, dtype="float8_e4m3fn") == {131072: 65536 + 2 * 32 * 8 * 4 // 32}
    assert C.kv_scale_bytes_per_token(llama, dtype="float8_e4m3fn", tokens_per_block=64) == {131072: 32}
    assert C.kv_scale_bytes_per_token(llama) == {131072: 0}
    assert C.cache_size_per_token(llama, cache_type="self_k_only") == {131072: 65536}
    assert C.cache_size_per_token(llama, max_seq_len=8192) == {8192: 131072}
    gemma = load_model_spec("gemma-3-27b")
    # 52 local layers and 10 global ones, 16 KV heads of 128 in bf16
    assert C.cache_size_per_token(gemma) == {1024: 2 * 52 * 16 * 128 * 2, 131072: 2 * 10 * 16 * 128 * 2}
    assert all(isinstance(v, int) for v in C.cache_size_per_token(gemma).values())
    # a VSWA CacheConfig with per-window block counts, re-clamped below its local window: one window left
    vswa = C.cache_config_from_memory(gemma, 10 * GiB)
    assert C.cache_size_per_token(vswa, max_seq_len=512) == {512: 2 * 62 * 16 * 128 * 2}
    assert C.cache_config_from_memory(vswa, 10 * GiB, max_seq_len=512).windows == (512,)


# --------------------------------------------------------------------------- batch size
def test_max_batch_size():
    tiny = load_model_spec("tiny").cache_config(primary_blocks=100, tokens_per_block=16)
    assert C.max_batch_size(tiny, 100, 28) == 100 // 8
    swa = load_model_spec("tiny-swa").cache_config(primary_blocks={64: 50, 2048: 100}, tokens_per_block=16)
    # window 64 needs ceil(64/16) + 1 = 5 blocks per request -> 10; window 2048 needs 8 -> 12
    assert C.max_batch_size(swa, 100, 28) == 10
    # beam 2 in the global window: ctx 128 - 28 = 100 -> 6 shared blocks, left 4: 6 + (ceil(32/16) + 1) * 2 = 12
    assert C.max_batch_size(tiny, 100, 28, beam_width=2) == 100 // 12


# --------------------------------------------------------------------------- from memory
def test_cache_config_from_memory_vswa():
    spec = load_model_spec("tiny-swa")
    config = C.cache_config_from_memory(spec, 35 * MiB, 35 * MiB // 2, tokens_per_block=16)
    assert config.primary_blocks == {64: 128, 2048: 4096}
    assert config.secondary_blocks == {64: 64, 2048: 2048}
    assert config.tokens_per_block == 16 and config.attention_windows == (64, 64, 64, 2048)


def test_cache_config_from_memory_single_window():
    spec = load_model_spec("llama-3.1-8b")
    config = C.cache_config_from_memory(spec, 40 * GiB, 8 * GiB)
    # 40 GiB / 131072 B = 327680 tokens = 10240 blocks of 32 (the TensorRT-LLM default block size)
    assert (config.primary_blocks, config.secondary_blocks, config.tokens_per_block) == (10240, 2048, 32)
    fp8 = C.cache_config_from_memory(spec, 40 * GiB, dtype="float8_e4m3fn", max_seq_len=8192, max_beam_width=2)
    # 40 GiB / (65536 + 64 scale bytes per token) = 654720 tokens = 20460 blocks of 32
    assert (fp8.primary_blocks, fp8.dtype, fp8.max_seq_len, fp8.max_beam_width) == (20460, "float8_e4m3fn", 8192, 2)
    capped = C.cache_config_from_memory(spec, 40 * GiB, max_tokens=1000)
    assert capped.primary_blocks == 32  # ceil(1000 / 32)
    # a CacheConfig can be re-sized too
    assert C.cache_config_from_memory(config, 4 * GiB).primary_blocks == 1024


def test_cache_config_from_memory_gemma3():
    spec = load_model_spec("gemma-3-27b")
    config = C.cache_config_from_memory(spec, 100 * GiB)
    local, glob = 2 * 52 * 16 * 128 * 2, 2 * 10 * 16 * 128 * 2
    total = 1024 * local + 131072 * glob
    # share(1024) = 1024 * local / total; tokens = floor(100 GiB * share / local) = floor(100 GiB * 1024 / total)
    assert config.primary_blocks[1024] == -(-(100 * GiB * 1024 // total) // 32)
    assert config.primary_blocks[131072] == -(-(100 * GiB * 131072 // total) // 32)


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("fn", "args", "match"),
    [
        (C.max_block_requirements_per_beam, (-1, 0, 64, 16), "seq_len"),
        (C.max_block_requirements_per_beam, (10, 0, 0, 16), "window"),
        (C.max_block_requirements_per_beam, (10, 0, 64, 0), "tokens_per_block"),
        (C.max_block_requirements_per_beam, (10.0, 0, 64, 16), "seq_len must be an int"),
        (C.max_block_requirements, (1, 1, 0, 64, 0, 16), "beam_width"),
        (C.max_block_requirements, (1, True, 0, 64, 1, 16), "output_len"),
        (C.max_attention_window, (1, 1, 0, -1, 1, 16), "capacity_blocks"),
        (C.window_size_shares, ({64: [0]}, {128: 10}), "windows"),
        (C.window_size_shares, ({}, {}), "must not be empty"),
        (C.window_size_shares, ({64: [0]}, {64: 0}), "must be > 0"),
        (C.window_size_shares, ({64: []}, {64: 10}), "no layers"),
        (C.calculate_max_num_blocks, ({64: [0]}, {64: 10}, 16, -5), "primary_bytes"),
        (C.calculate_max_num_blocks, ({64: [0]}, {64: 10}, 16, 100, float("inf")), "secondary_bytes"),
        (C.calculate_max_num_blocks, ({64: [0]}, {64: 10}, 16, 100, 0, -1), "max_tokens"),
        (C.cache_size_per_token, (object(),), "CacheConfig or a ModelSpec"),
    ],
)
def test_bad_inputs_raise_value_error(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(*args)


def test_from_memory_errors():
    spec = load_model_spec("llama-3.1-8b")
    with pytest.raises(ValueError, match="gives no block"):
        C.cache_config_from_memory(spec, 1000)
    with pytest.raises(ValueError, match="computed from the byte budgets"):
        C.cache_config_from_memory(spec, GiB, primary_blocks=3)
    with pytest.raises(ValueError, match="primary_bytes"):
        C.cache_config_from_memory(spec, -1)
    with pytest.raises(ValueError, match="max_batch_size needs a CacheConfig"):
        C.max_batch_size(spec, 10, 10)


def test_capacity_does_not_import_jax():
    import subprocess

    code = "import sys, kvjax.capacity, kvjax.model_spec; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_weights_activations_and_the_kv_budget():
    from kvjax.capacity import activation_reserve_bytes, kv_cache_budget, weight_bytes

    spec = load_model_spec("llama-3.1-70b")
    assert spec.num_parameters == 70_553_706_496 and weight_bytes(spec) == 2 * 70_553_706_496
    assert weight_bytes(spec, "float8_e4m3fn") == 70_553_706_496
    assert activation_reserve_bytes(spec, 1) == (2 * 8192 + 2 * 8192 + 2 * 1024 + 3 * 28672) * 2 + 4 * 128256
    assert kv_cache_budget(100, 0.5, 20, 10) == 20
    with pytest.raises(ValueError, match="the weights alone"):
        kv_cache_budget(80 * 2**30, 0.9, weight_bytes(spec), 0)
    with pytest.raises(ValueError, match="nothing is left"):
        kv_cache_budget(100, 0.5, 40, 10)
    with pytest.raises(ValueError, match="utilization"):
        kv_cache_budget(100, 1.5, 0, 0)
