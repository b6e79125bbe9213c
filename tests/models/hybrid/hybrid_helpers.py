"""Helpers of the hybrid model tests: the committed fixtures (tests/fixtures/hf_hybrid, written by
tests/fixtures/make_hybrid_fixtures_lfm2_granite.py with transformers 5.24) and the comparisons."""
import json
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf_hybrid"


def expected(family: str) -> dict:
    return json.loads((FIXTURES / family / "expected.json").read_text())


def logit_error(model, family: str) -> float:
    """Largest |logit difference| to transformers over every stored position of every prompt:
    all prompts in one right-padded batch through a jitted dense_forward (causal: the padding
    after a prompt never reaches its positions)."""
    import jax
    from flax import nnx

    exp = expected(family)
    width = max(len(p) for p in exp["prompts"])
    batch = np.zeros((len(exp["prompts"]), width), np.int32)
    for row, prompt in enumerate(exp["prompts"]):
        batch[row, :len(prompt)] = prompt
    graphdef, params = nnx.split(model)
    logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p).dense_forward(t))(params, jnp.asarray(batch)))
    worst = 0.0
    for row, ref in enumerate(exp["logits"]):
        got = logits[row, ref["positions"]]  # [P, V]
        worst = max(worst, float(np.abs(got - np.asarray(ref["values"], np.float32)).max()))
    return worst


def greedy_chunked(model, step, prompt: list[int], new_tokens: int, chunk: int, max_len: int = 64) -> list[int]:
    """Greedy continuation through `step` (`jit_forward_chunk(model)`): the prompt in chunks of
    `chunk` tokens, its remainder token by token, then decode steps (two compiled shapes in all)."""
    state = model.init_state(1, max_len)
    whole = len(prompt) // chunk * chunk
    pieces = [prompt[i:i + chunk] for i in range(0, whole, chunk)] + [[t] for t in prompt[whole:]]
    for piece in pieces:
        logits, state = step(jnp.asarray([piece], jnp.int32), state)
    out = []
    for i in range(new_tokens):
        tok = int(jnp.argmax(logits[0, -1]))
        out.append(tok)
        if i + 1 < new_tokens:
            logits, state = step(jnp.asarray([[tok]], jnp.int32), state)
    return out


def perturb(model, names: tuple[str, ...], seed: int = 7) -> None:
    """Move the named parameters (biases, norm scales) away from 0 / 1 so a dropped term shows
    (numpy draws: no JAX compilation per parameter shape)."""
    from flax import nnx

    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in names:
            value = np.asarray(var.get_value())
            var.set_value(jnp.asarray(value + 0.5 * rng.standard_normal(value.shape), value.dtype))


def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, copied into memory (for rewriting it)."""
    from kvjax.checkpoint_files import CheckpointTensors

    t = CheckpointTensors(directory)
    return {name: np.array(t.array(name)) for name in t}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file (float32, or bfloat16 arrays from ml_dtypes)."""
    header, chunks, offset = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        code = {"bfloat16": "BF16", "float32": "F32"}[a.dtype.name]
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        chunks.append(a.tobytes())
        offset += a.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(chunks))
