"""benchmarks/hybrid_bench.py part (a), quick: the state-memory table's numbers against a hand
computation (part (b) compiles a hybrid engine: run by hand, numbers in docs/benchmarks.md)."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import hybrid_bench  # noqa: E402


def test_state_memory_table(capsys):
    rows = hybrid_bench.main(["--part", "a", "--quick", "--tokens-per-block", "32"])["a"]
    out = capsys.readouterr().out
    by = {(r["model"], r["interval"]): r for r in rows}
    assert {m for m, _ in by} == {"qwen3.5-default", "qwen3_5", "lfm2", "granite"}
    assert {i for _, i in by} == {32, 64, 128, 256}
    # Qwen3.5 with transformers' defaults, bf16: 32 layers, every 4th full attention (8), 24 gated DeltaNet
    # layers of conv [3, 2 * 16 * 128 + 32 * 128] bf16 + delta-rule state [32, 128, 128] f32
    layer = 3 * 8192 * 2 + 32 * 128 * 128 * 4
    kv = 8 * 2 * 4 * 256 * 2  # 8 attention layers x (K, V) x 4 kv heads x 256 x bf16
    for k in (1, 2, 4, 8):
        r = by[("qwen3.5-default", 32 * k)]
        assert (r["attn"], r["block"], r["state"]) == (kv, 24 * layer, 24 * layer / (32 * k))
    # the fixture: 3 DeltaNet layers of 2624 bytes, 2 attention layers of 2 x 2 x 16 bf16
    assert (by[("qwen3_5", 64)]["block"], by[("qwen3_5", 64)]["attn"], by[("qwen3_5", 64)]["state"]) == (7872, 256, 123.0)
    # halving the snapshots halves the state per token; the budget then holds more tokens
    for m in ("qwen3.5-default", "qwen3_5", "lfm2", "granite"):
        held = [by[(m, 32 * k)]["tokens"] for k in (1, 2, 4, 8)]
        assert held == sorted(held) and held[0] > 0
    assert "qwen3.5-default" in out and "1,609,728.0" in out
