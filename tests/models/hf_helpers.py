"""Helpers of the checkpoint tests: the committed fixtures (tests/fixtures/hf, written by
tests/fixtures/make_hf_fixtures.py with transformers) and a minimal safetensors writer for
building broken or renamed checkpoints."""
import json
import shutil
import struct
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file())
SLIDING = ("mistral", "gemma3")

_CODES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int32): "I32"}


def expected(family: str) -> dict:
    return json.loads((FIXTURES / family / "expected.json").read_text())


def copy_fixture(family: str, dest: Path) -> Path:
    out = dest / family
    shutil.copytree(FIXTURES / family, out)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A safetensors file (numpy arrays; bfloat16 arrays from ml_dtypes are written as BF16)."""
    header, chunks, offset = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        code = "BF16" if a.dtype.name == "bfloat16" else _CODES[a.dtype]
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        chunks.append(a.tobytes())
        offset += a.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(chunks))


def read_all(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint, copied into memory (for rewriting it)."""
    from kvjax.checkpoint_files import CheckpointTensors

    t = CheckpointTensors(directory)
    return {name: np.array(t.array(name)) for name in t}


def rewrite_single_file(directory: Path, tensors: dict[str, np.ndarray]) -> None:
    """Replace the checkpoint's weights by one model.safetensors holding `tensors`."""
    for f in list(directory.glob("*.safetensors")) + list(directory.glob("*.safetensors.index.json")):
        f.unlink()
    write_safetensors(directory / "model.safetensors", tensors)
