"""`kvjax capacity --model DIR` of hybrid checkpoints (kvjax/hybrid_capacity.py): each family's
recurrent state bytes and TensorRT-LLM's split of the budget, checked against hand computations
from the fixtures' config.json values."""
from __future__ import annotations

import math

import pytest

from kvjax.checkpoint_files import CheckpointTensors
from kvjax.cli import main
from kvjax.hybrid_capacity import hybrid_geometry

GiB = 2**30
FIX = "tests/fixtures/hf_hybrid/"

# one recurrent layer's state, by hand from each fixture's config.json (bf16 = 2 bytes, f32 = 4)
STATE = {
    # gated DeltaNet: conv [K-1 = 3, C = 2 * 2 key heads * 16 + 4 value heads * 8 = 96] bf16
    # + delta-rule state [4 value heads, 16, 8] f32
    "qwen3_5": 3 * 96 * 2 + 4 * 16 * 8 * 4,
    # short conv: [conv_L_cache - 1 = 2, hidden 64] bf16
    "lfm2": 2 * 64 * 2,
    # Mamba2: conv [d_conv - 1 = 3, 8 heads * 8 + 2 groups * 2 * 12 = 112] bf16 + SSM [8, 8, 12] f32
    "granite": 3 * 112 * 2 + 8 * 8 * 12 * 4,
}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(STATE))
def test_capacity_sizes_a_hybrid_checkpoint_by_tensorrt_llms_rule(capsys, name):
    assert STATE == {"qwen3_5": 2624, "lfm2": 256, "granite": 3744}
    geo = hybrid_geometry(FIX + name)
    assert geo.state_bytes == STATE[name] and geo.num_recurrent_layers == 3 and geo.num_layers == 5
    tpb, interval, batch = 16, 32, 4
    code, out, err = run(capsys, "capacity", "--model", FIX + name, "--gpu-memory", "1GiB", "--fraction", "1",
                         "--activation-reserve", "0", "--tokens-per-block", str(tpb), "--snapshot-interval",
                         str(interval), "--max-num-seqs", str(batch), "--host-memory", "1MiB")
    assert code == 0, err
    weights = CheckpointTensors(FIX + name).served_parameters(geo.tie_embeddings) * 2  # bf16
    budget = GiB - weights
    block = 3 * STATE[name]  # every recurrent layer's state at one position
    attn = 2 * 2 * 2 * 16 * 2  # 2 attention layers x (K, V) x 2 kv heads x head dim 16 x bf16
    tokens = math.floor((budget - 2 * batch * block) / (attn + block / interval))
    states = tokens // interval + 2 * batch
    host_tokens = math.floor(2**20 / (attn + block / interval))
    assert f"= {budget} bytes" in out
    assert f"a token costs {attn} + {block} / {interval} = " in out
    assert f"the running requests {2 * batch} state blocks" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["-1"], ["256"])}
    assert rows["-1"][2:] == ["3", str(block), str(states), str((states - 2 * batch) * interval), str(host_tokens // interval)]
    assert rows["256"][1:] == ["2", str(attn * tpb), str(math.ceil(tokens / tpb)), str(math.ceil(tokens / tpb) * tpb),
                               str(host_tokens // tpb)]
    # what the split gives fits the budget, and one more snapshot's worth would not
    assert tokens * attn + states * block <= budget < (tokens + interval) * attn + (states + 1) * block


def test_capacity_refuses_a_snapshot_interval_off_the_blocks_or_for_a_dense_model(capsys):
    code, _, err = run(capsys, "capacity", "--model", FIX + "lfm2", "--gpu-memory", "1GiB",
                       "--tokens-per-block", "16", "--snapshot-interval", "24")
    assert code != 0 and "multiple of tokens_per_block=16" in err
    code, _, err = run(capsys, "capacity", "--model", "llama-3.1-8b", "--gpu-memory", "80GiB", "--snapshot-interval", "32")
    assert code != 0 and "--snapshot-interval is for hybrid checkpoints" in err
