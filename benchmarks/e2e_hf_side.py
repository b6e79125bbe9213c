"""The transformers side of `e2e_bench.py`, run in a Python that has torch and transformers (>= 5).

    python e2e_hf_side.py make DIR [--layers 30]            # a SmolLM2-135M-shaped checkpoint, random weights
    python e2e_hf_side.py single|offline DIR [--new-tokens 64]   # one measurement, one JSON line on stdout

Imports nothing of kvjax: the prompts come from `e2e_bench.prompts` (that module's top level
imports only the standard library), so both sides serve the same token ids.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from e2e_bench import OFFLINE_N, OFFLINE_NEW, prompts  # noqa: E402  (this folder is on sys.path: imports only the stdlib)


def make(path: str, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)


def measure(mode: str, path: str, new_tokens: int) -> dict:
    t_launch = float(os.environ.get("E2E_LAUNCH", 0))
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    p = prompts(model.config.vocab_size)

    def gen(ids: list[list[int]], n: int, attention_mask=None) -> float:
        x = torch.tensor(ids)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(x, attention_mask=attention_mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t

    if mode == "single":
        ttft_cold = gen([p["single"]], 1)
        ttft_cold_from_launch = time.time() - t_launch if t_launch else None
        ttft_warm = gen([p["single_warm"]], 1)
        total = gen([p["single_warm"]], new_tokens)
        return {"load_s": load_s, "ttft_cold_s": ttft_cold, "ttft_cold_from_launch_s": ttft_cold_from_launch,
                "ttft_warm_s": ttft_warm, "decode_tok_s": (new_tokens - 1) / (total - ttft_warm)}
    cfg = GenerationConfig(max_new_tokens=OFFLINE_NEW, min_new_tokens=OFFLINE_NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    with torch.inference_mode():
        model.generate_batch(inputs=p["offline"][:2], generation_config=cfg)  # warm-up
        t = time.perf_counter()
        model.generate_batch(inputs=p["offline"], generation_config=cfg)
        cb_s = time.perf_counter() - t
    width = max(len(x) for x in p["offline"])  # all the same length here: no padding is needed, mask anyway
    ids = [[0] * (width - len(x)) + x for x in p["offline"]]
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in p["offline"]])
    gen(ids[:2], 2, mask[:2])  # warm-up
    padded_s = gen(ids, OFFLINE_NEW, mask)
    return {"load_s": load_s, "cb_tok_s": OFFLINE_N * OFFLINE_NEW / cb_s, "padded_tok_s": OFFLINE_N * OFFLINE_NEW / padded_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["make", "single", "offline"])
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.what == "make":
        make(args.path, args.layers)
        return
    print(json.dumps(measure(args.what, args.path, args.new_tokens)))


if __name__ == "__main__":
    main()
