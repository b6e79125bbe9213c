"""The tensors of a Hugging Face checkpoint directory, memory-mapped from its safetensors files.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte range of the data section) and the data. kvjax reads the header itself and maps
the data with numpy, so bfloat16 and float8 tensors (which numpy lacks and safetensors' numpy
API refuses) come out through `ml_dtypes`, and nothing is copied until a tensor is converted.

A sharded checkpoint has `model.safetensors.index.json` (`weight_map`: tensor -> file); a
single one `model.safetensors` (or any one `*.safetensors`). Every inconsistency is a
`CheckpointError` naming the file: a missing shard, a truncated file, a header whose byte
ranges overlap or do not match the shapes, an index that disagrees with the files.

Pure numpy (no JAX): `kvjax capacity` sizes weights from the headers alone.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from kvjax.errors import KVCacheError

INDEX_FILE = "model.safetensors.index.json"

#: safetensors dtype -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
_MAX_HEADER = 100 * 1024 * 1024

#: buffers some checkpoints carry that kvjax recomputes
RECOMPUTED_SUFFIXES = (".rotary_emb.inv_freq",)
#: multimodal Gemma 3: the parts that text serving does not load
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
#: where the text model's tensors live: text-only checkpoints, multimodal Gemma 3 as published, as transformers 5 saves it
TEXT_PREFIXES = ("model.", "language_model.model.", "model.language_model.")
#: stored dtypes the loaders convert from
LOADABLE_DTYPES = ("F32", "F16", "BF16")


class CheckpointError(KVCacheError, ValueError):
    """A checkpoint directory or safetensors file kvjax cannot read (names the file and the problem)."""


def numpy_dtype(code: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype code (bfloat16 / float8 via ml_dtypes)."""
    simple = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
              "U8": np.uint8, "BOOL": np.bool_}
    if code in simple:
        return np.dtype(simple[code])
    import ml_dtypes

    return np.dtype({"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}[code])


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset in `file`
    end: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo of one safetensors file, every range checked against the file size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{file}: truncated or not a safetensors file (header of {n} bytes, file of {size})")
            raw = fh.read(n)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: corrupt header entry for tensor {name!r}: {entry!r}") from None
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {dtype!r}")
        if any(not isinstance(d, int) or d < 0 for d in shape) or not (isinstance(start, int) and isinstance(end, int)):
            raise CheckpointError(f"{file}: corrupt header entry for tensor {name!r}: {entry!r}")
        if end - start != math.prod(shape) * DTYPE_SIZES[dtype] or start < 0:
            raise CheckpointError(f"{file}: tensor {name!r} spans bytes [{start}, {end}) but {dtype}{list(shape)} needs "
                                  f"{math.prod(shape) * DTYPE_SIZES[dtype]}")
        if base + end > size:
            raise CheckpointError(f"{file}: truncated: tensor {name!r} needs bytes up to {base + end} but the file has {size}")
        out[name] = TensorInfo(name, dtype, shape, file, base + start, base + end)
    spans = sorted((t.start, t.end, t.name) for t in out.values() if t.nbytes)
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(spans):
        if start_b < end_a:
            raise CheckpointError(f"{file}: tensors {a!r} and {b!r} overlap")
    return out


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint (the index's shards, else the single file)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(index)
        return sorted({directory / f for f in weight_map.values()})
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(other)}: kvjax reads safetensors only)" if other else ""
        raise CheckpointError(f"{directory}: no *.safetensors weights{hint}")
    if len(files) > 1:
        raise CheckpointError(f"{directory}: {len(files)} safetensors files but no {INDEX_FILE} to say which tensor is where")
    return files


def _weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
    except OSError as e:
        raise CheckpointError(f"{index}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


class CheckpointTensors:
    """All tensors of a checkpoint directory; `array(name)` is a read-only memory-mapped view."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        files = safetensors_files(self.directory)
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{self.directory}: shard {f.name} listed in {INDEX_FILE} is missing")
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_header(f).items():
                if name in self.tensors:
                    raise CheckpointError(f"{f}: tensor {name!r} is also in {self.tensors[name].file.name}")
                self.tensors[name] = info
        index = self.directory / INDEX_FILE
        if index.is_file():
            for name, file in _weight_map(index).items():
                found = self.tensors.get(name)
                if found is None or found.file.name != file:
                    where = "missing from every shard" if found is None else f"in {found.file.name}"
                    raise CheckpointError(f"{index}: lists tensor {name!r} in {file} but it is {where}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing") from None

    def check_names(self, shapes: Mapping[str, tuple[int, ...]], unused: Callable[[str], bool] = lambda name: False
                    ) -> None:
        """Refuse (`CheckpointError` naming the tensor) unless the checkpoint holds exactly the tensors
        in `shapes`, with those shapes, in a dtype kvjax loads; besides them only recomputed buffers
        and the tensors `unused` accepts (a stored copy of a tied head, a vision tower) may be stored.

        One check for every loader, run on the headers before anything is allocated."""
        missing = [name for name in shapes if name not in self.tensors]
        if missing:
            raise CheckpointError(f"{self.directory}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
        for name, shape in shapes.items():
            info = self.tensors[name]
            if info.shape != shape:
                raise CheckpointError(f"{self.directory}: tensor {name!r} has shape {list(info.shape)}, config.json "
                                      f"implies {list(shape)}")
            if info.dtype not in LOADABLE_DTYPES:
                raise CheckpointError(f"{self.directory}: tensor {name!r} is {info.dtype}; kvjax loads float32, "
                                      "float16 and bfloat16 weights")
        for name in self.tensors:
            if name not in shapes and not name.endswith(RECOMPUTED_SUFFIXES) and not unused(name):
                raise CheckpointError(f"{self.directory}: unexpected tensor {name!r} (kvjax would not use it; "
                                      "refusing rather than ignore it)")

    def array(self, name: str) -> np.ndarray:
        """The tensor as stored (dtype and shape), backed by the file: no copy until converted.

        Each call maps just this tensor's bytes, and the mapping goes when the array does, so a
        loader that converts tensor by tensor keeps one tensor's file pages resident, not the file's.
        """
        info = self.info(name)
        dtype = numpy_dtype(info.dtype)
        if info.nbytes == 0:
            return np.empty(info.shape, dtype)
        raw = np.memmap(info.file, dtype=np.uint8, mode="r", offset=info.start, shape=(info.nbytes,))
        return raw.view(dtype).reshape(info.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def served_parameters(self, tied: bool) -> int:
        """Elements of the tensors a text model loads (no vision tower, recomputed buffers, or a
        stored copy of a tied output head)."""
        total = 0
        for name, info in self.tensors.items():
            if name.startswith(VISION_PREFIXES) or name.endswith(RECOMPUTED_SUFFIXES):
                continue
            if tied and name in ("lm_head.weight", "language_model.lm_head.weight"):
                continue
            total += info.size
        return total
