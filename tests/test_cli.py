"""The `kvjax` command: capacity figures equal hand-computed values, the demo runs and compares,
and a bad flag or config file gives one line, `kvjax: error: ...`, never a traceback."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvjax.cli import main, parse_size

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> dict[int, list[str]]:
    """Capacity table rows keyed by window."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if len(cells) == 8 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


# ---------------------------------------------------------------------- capacity
def test_capacity_llama_3_1_8b(capsys):
    code, out, err = run_cli(capsys, "capacity", "--model", "configs/models/llama-3.1-8b.toml",
                             "--gpu-memory", "141GiB", "--host-memory", "512GiB")
    assert code == 0 and err == ""
    # 2 (K, V) x 32 layers x 8 kv heads x 128 dims x 2 bytes (bf16)
    per_token = 2 * 32 * 8 * 128 * 2
    assert per_token == 131072 and f"KV bytes/token   {per_token}" in out
    # weights: 8,030,261,248 parameters (embeddings + head 2 x 128256 x 4096, 32 layers of
    # 4096 x (32 + 2 x 8) x 128 + 32 x 128 x 4096 + 3 x 4096 x 14336 + 2 x 4096 norms, final norm) in bf16
    weights = 2 * (2 * 128256 * 4096 + 32 * (4096 * 48 * 128 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 4096)
    assert weights == 2 * 8_030_261_248
    # activations for 8192 tokens: (2 x 4096 + 2 x 4096 + 2 x 1024 + 3 x 14336) x 2 bytes + float32 logits
    reserve = 8192 * ((2 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336) * 2 + 4 * 128256)
    primary = int(0.9 * 141 * GiB) - weights - reserve
    assert f"= {primary} bytes" in out and "weights          14.96 GiB (8.03B parameters from the spec, bfloat16)" in out
    tokens = primary // per_token
    blocks = math.ceil(tokens / 32)  # TensorRT-LLM rounds up
    secondary = 512 * GiB // per_token // 32  # 131072 host blocks
    assert (tokens, blocks, secondary) == (877288, 27416, 131072)
    assert table_rows(out)[131072] == ["131072", "32", "131072", "100.00%", str(blocks), str(blocks * 32),
                                       str(secondary), str(secondary * 32)]
    # 2048 + 512 tokens = 80 blocks per request
    assert f"max batch        {blocks // 80} requests of 2048 input + 512 output tokens" in out


def test_capacity_says_when_the_weights_alone_do_not_fit(capsys):
    # Llama-3.1-70B in bf16 is 131.4 GiB: more than a whole 80 GiB card
    code, out, err = run_cli(capsys, "capacity", "--model", "llama-3.1-70b", "--gpu-memory", "80GiB")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "the weights alone (131.42 GiB) do not fit in 0.9 x 80.00 GiB = 72.00 GiB" in err
    code, out, err = run_cli(capsys, "capacity", "--model", "llama-3.1-8b", "--gpu-memory", "20GiB")
    assert code == 2 and "nothing is left for the KV cache" in err
    code, out, err = run_cli(capsys, "capacity", "--model", "llama-3.1-8b", "--gpu-memory", "24GiB",
                             "--gpu-memory-utilization", "0.95", "--activation-reserve", "1GiB")
    primary = int(0.95 * 24 * GiB) - 2 * 8_030_261_248 - GiB
    assert code == 0 and f"= {primary} bytes" in out and "activations      1.00 GiB (given)" in out


def test_capacity_of_a_checkpoint_directory(capsys):
    code, out, err = run_cli(capsys, "capacity", "--model", "tests/fixtures/hf/gemma3", "--gpu-memory", "1GiB",
                             "--input-len", "64", "--output-len", "16", "--max-num-tokens", "64")
    assert code == 0, err
    from kvjax.model_catalog import load_model_spec

    spec = load_model_spec("tests/fixtures/hf/gemma3")
    assert f"{spec.num_parameters:,} parameters in the checkpoint, float32" in out
    rows = table_rows(out)
    assert sorted(rows) == [8, 256] and rows[8][1] == "3" and rows[256][1] == "1"  # local, local, global, local


def test_capacity_gemma_3_27b_variable_windows(capsys):
    code, out, _ = run_cli(capsys, "capacity", "--model", "gemma-3-27b", "--gpu-memory", "141GiB",
                           "--input-len", "4096", "--output-len", "1024", "--activation-reserve", "0")
    assert code == 0
    # layers cycle 5 x local (1024) + 1 global: 52 local, 10 global; 2 x 16 heads x 128 x 2 B = 8192 B per layer
    local, glob = 52 * 8192, 10 * 8192
    assert (local, glob) == (425984, 81920)
    # memory share proportional to window x bytes/token, so tokens per window = budget x window / total
    total = 1024 * local + 131072 * glob
    primary = int(0.9 * 141 * GiB) - 2 * 27_009_346_304  # weights: 27.0B bf16 parameters (text model)
    local_blocks = math.ceil(primary * 1024 // total / 32)
    global_blocks = math.ceil(primary * 131072 // total / 32)
    assert (local_blocks, global_blocks) == (236, 30147)
    rows = table_rows(out)
    assert rows[1024][:5] == ["1024", "52", "425984", "3.90%", "236"]
    assert rows[131072][:5] == ["131072", "10", "81920", "96.10%", "30147"]
    # a 5120-token request holds 1024/32 + 1 (SWA extra) = 33 local blocks: 236 // 33 = 7
    assert "max batch        7 requests of 4096 input + 1024 output tokens" in out


def test_capacity_multi_query_fp8(capsys):
    code, out, _ = run_cli(
        capsys,
        "capacity",
        "--model",
        "falcon-7b",
        "--gpu-memory",
        "80GB",
        "--fraction",
        "0.5",
        "--dtype",
        "float8_e4m3fn",
        "--tokens-per-block",
        "64",
        "--activation-reserve",
        "0",
    )
    assert code == 0
    scales = 2 * 32 * 1 * 4 // 64  # a float32 scale per (block, layer, K/V, kv head), over 64 tokens
    per_token = 2 * 32 * 1 * 64 * 1 + scales  # one kv head (multi-query), head dim 64, 1 byte
    assert f"KV bytes/token   {per_token} (all layers, K and V; {scales} of them FP8 block scales)" in out
    blocks = math.ceil((int(0.5 * 80e9) - 2 * 6_921_570_752) // per_token / 64)  # after 6.92B bf16 weights
    assert table_rows(out)[2048][4] == str(blocks)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("141GiB", 141 * GiB), ("512GB", 512 * 10**9), ("100MiB", 100 * 2**20), ("1.5TiB", int(1.5 * 2**40)),
     ("4096", 4096), ("2 gib", 2 * GiB), ("64KB", 64000)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["capacity", "--model", "llama-3.1-8b", "--gpu-memory", "lots"], "argument --gpu-memory: invalid size 'lots'"),
        (["capacity", "--model", "llama-3.1-8b"], "the following arguments are required: --gpu-memory"),
        (["capacity", "--model", "llama-3.1-8b", "--gpu-memory", "1GiB", "--fraction", "2"], "expected a number in (0, 1]"),
        (["capacity", "--model", "no-such-model", "--gpu-memory", "1GiB"], "unknown model 'no-such-model'"),
        (["capacity", "--model", "tiny", "--gpu-memory", "32MiB", "--activation-reserve", "9741000"], "gives no block"),
        (["capacity", "--model", "llama-3.1-8b", "--gpu-memory", "1KiB"], "the weights alone"),
        (["serve"], "the following arguments are required: model"),
        (["serve", "tiny", "--port", "-1"], "expected an int >= 0"),
        (["run"], "the following arguments are required: --workload"),
        (["demo", "--policy", "fifo"], "argument --policy: invalid choice"),
        (["demo", "--users", "0"], "expected a positive int"),
        (["run", "--workload", "no-such-workload"], "unknown workload 'no-such-workload'"),
        (
            ["run", "--workload", "chat", "--model", "llama-3.1-8b"],
            "model 'llama-3.1-8b' describes a published model but kvjax has no weights",
        ),
        (["demo", "--model", "gemma-3-27b"], "pass its Hugging Face checkpoint directory"),
        (["run", "--workload", "chat", "--model", "tests/fixtures"], "cannot read the checkpoint's config"),
        (["demo", "--set", "users"], "--set expects KEY=VALUE"),
        (["demo", "--set", "colour=3"], "unknown key 'colour'"),
        (["demo", "--tokens-per-block", "12"], "tokens_per_block must be a positive power of two"),
    ],
)
def test_bad_flags_give_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("kvjax: error: ") and err.count("\n") == 1, err
    assert message in err


def test_bad_config_files(capsys, tmp_path):
    bad_workload = tmp_path / "bad.toml"
    bad_workload.write_text('[workload]\nkind = "chat"\nusers = "many"\n')
    code, _, err = run_cli(capsys, "run", "--workload", str(bad_workload))
    assert code == 2 and err.count("\n") == 1 and f"{bad_workload}: workload 'chat': users must be an int" in err
    bad_model = tmp_path / "model.toml"
    bad_model.write_text(
        (ROOT / "configs/models/llama-3.1-8b.toml").read_text().replace("num_layers = 32", 'num_layers = "four"')
    )
    code, _, err = run_cli(capsys, "capacity", "--model", str(bad_model), "--gpu-memory", "1GiB")
    assert code == 2 and err.count("\n") == 1 and "field 'num_layers'" in err
    bad_cache = tmp_path / "cache.toml"
    bad_cache.write_text('[workload]\nkind = "chat"\n[cache]\nprimary_blocks = -3\n')
    code, _, err = run_cli(capsys, "run", "--workload", str(bad_cache), "--model", "micro")
    assert code == 2 and err.count("\n") == 1 and "[cache]" in err and "primary_blocks" in err


def test_entry_point_prints_no_traceback(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("[workload\n")
    exe = Path(sys.executable).with_name("kvjax")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvjax.cli"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd + ["run", "--workload", str(bad)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("kvjax: error: ") and proc.stderr.count("\n") == 1
    assert "invalid TOML" in proc.stderr


# ---------------------------------------------------------------------- serving
QUICK = ["--model", "micro", "--tokens-per-block", "8", "--max-seq-len", "256", "--no-progress",
         "--set", "system_prompt_tokens=24", "--set", "user_tokens=[4, 8]", "--max-num-tokens", "64"]


def test_demo_on_a_tiny_setting(capsys, tmp_path):
    code, out, err = run_cli(capsys, "demo", "--users", "2", "--turns", "2", "--max-new-tokens", "3",
                             "--out", str(tmp_path), *QUICK)
    assert code == 0, err
    assert "reuse on" in out and "reuse off" in out
    for row in ("prefill tokens computed", "prefill tokens reused", "TTFT mean", "throughput (output)", "hit rate (tokens)"):
        assert row in out
    (identical,) = [line.split()[-2:] for line in out.splitlines() if line.startswith("generated tokens identical")]
    assert identical == ["yes", "yes"]
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["identical_outputs"] is True
    on, off = (run["summary"] for run in data["runs"])
    assert on["requests"] == off["requests"] == 4
    assert on["prefill_reused_tokens"] > 0 and off["prefill_reused_tokens"] == 0
    assert on["prefill_computed_tokens"] + on["prefill_reused_tokens"] == on["admitted_prompt_tokens"]
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def test_run_a_workload_file(capsys, tmp_path):
    # the demo test's geometry: this process's runner for micro already compiled its shapes
    code, out, err = run_cli(capsys, "run", "--workload", "configs/workloads/chat.toml", "--no-reuse",
                             "--out", str(tmp_path), "--users", "3", "--turns", "1", "--policy", "max_utilization", *QUICK)
    assert code == 2 and "unrecognized arguments: --users" in err  # demo-only flags
    code, out, err = run_cli(capsys, "run", "--workload", "configs/workloads/chat.toml", "--no-reuse",
                             "--out", str(tmp_path), "--set", "users=3", "--set", "turns=1", "--set", "max_new_tokens=2",
                             "--policy", "max_utilization", *QUICK)
    assert code == 0, err
    assert "reuse off" in out and "reuse on" not in out
    data = json.loads((tmp_path / "run-chat.json").read_text())
    (run,) = data["runs"]
    assert run["summary"]["requests"] == 3 and run["summary"]["prefill_reused_tokens"] == 0
    assert data["cache"]["tokens_per_block"] == 8 and data["engine"]["policy"] == "max_utilization"
    assert len(run["requests"]) == 3 and len(run["steps"]) == run["summary"]["steps"]
    assert all(r["output_tokens"] == 2 for r in run["requests"])


def test_run_a_checkpoint_directory(capsys, tmp_path):
    code, out, err = run_cli(
        capsys,
        "run",
        "--workload",
        "chat",
        "--model",
        "tests/fixtures/hf/mistral",
        "--out",
        str(tmp_path),
        "--set",
        "users=1",
        "--set",
        "turns=2",
        "--set",
        "max_new_tokens=4",
        "--set",
        "system_prompt_tokens=24",
        "--set",
        "user_tokens=[4, 8]",
        "--tokens-per-block",
        "8",
        "--max-seq-len",
        "128",
        "--max-num-tokens",
        "64",
        "--no-progress",
    )
    assert code == 0, err
    assert "on model 'mistral'" in out
    data = json.loads((tmp_path / "run-chat.json").read_text())
    (run,) = data["runs"]
    assert data["model"] == "mistral" and run["summary"]["requests"] == 2 and run["summary"]["prefill_reused_tokens"] > 0


def test_run_refuses_a_max_seq_len_beyond_the_model(capsys):
    """The chat workload asks 512 tokens of a fixture trained for 256: refused by name, with the flag that fixes it."""
    assert main(["run", "--model", "tests/fixtures/hf/llama3", "--workload", "chat"]) == 2
    err = capsys.readouterr().err
    assert "max_seq_len=512 exceeds the model's 256" in err and "--max-seq-len" in err
