"""Seconds to load a Hugging Face checkpoint with `kvjax.models.from_pretrained`.

With no path it writes a synthetic SmolLM-135M-shaped Llama checkpoint (30 layers, width 576,
bfloat16, random weights) into a temporary directory first, so no download is needed:

    python benchmarks/load_bench.py [CHECKPOINT_DIR] [--repeat 3] [--dtype bfloat16]

Prints the best and every wall time of `from_pretrained` plus one `block_until_ready` on
every parameter (the weights are on the device when the clock stops), and the best CPU time
of the process (steadier than wall time on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import struct
import tempfile
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, vocab_size=49152)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: u64 header size, a JSON header of offsets, then the raw bytes."""
    codes = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16"}
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def synthetic_llama(directory: Path, seed: int = 0) -> Path:
    """A SmolLM-135M-shaped Llama checkpoint (tied embeddings, bfloat16) with random weights."""
    c = SMOL
    d, f, n, k, h, v = (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"],
                        c["head_dim"], c["vocab_size"])
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": np.ones(d, ml_dtypes.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(d, ml_dtypes.bfloat16),
            p + "post_attention_layernorm.weight": np.ones(d, ml_dtypes.bfloat16),
            p + "self_attn.q_proj.weight": w(n * h, d), p + "self_attn.k_proj.weight": w(k * h, d),
            p + "self_attn.v_proj.weight": w(k * h, d), p + "self_attn.o_proj.weight": w(d, n * h),
            p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d), p + "mlp.down_proj.weight": w(d, f),
        })
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
              **c}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    write_safetensors(directory / "model.safetensors", tensors)
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", help="checkpoint directory (default: a synthetic 135M Llama)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    from kvjax.models import from_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.path) if args.path else synthetic_llama(Path(tmp) / "llama-135m")
        times, cpu = [], []
        for _ in range(args.repeat):
            start, start_cpu = time.perf_counter(), time.process_time()
            model = from_pretrained(path, dtype=args.dtype)
            jax.block_until_ready(jax.tree.leaves(model))
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            del model
        print(f"from_pretrained({path.name}): best {min(times):.2f} s wall, {min(cpu):.2f} s CPU; "
              f"all {[round(t, 2) for t in times]} s wall")


if __name__ == "__main__":
    main()
