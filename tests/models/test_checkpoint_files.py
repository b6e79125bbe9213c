"""The safetensors reader: tensors as stored (bfloat16 included), sharded checkpoints through their
index, and a clear error naming the file for every broken checkpoint."""
import json

import ml_dtypes
import numpy as np
import pytest
from hf_helpers import FIXTURES, copy_fixture, read_all, rewrite_single_file, write_safetensors

from kvjax.checkpoint_files import INDEX_FILE, CheckpointError, CheckpointTensors, read_header


def test_sharded_checkpoint_reads_through_its_index():
    t = CheckpointTensors(FIXTURES / "llama3")
    files = {info.file.name for info in t.tensors.values()}
    assert len(files) == 3 and (FIXTURES / "llama3" / INDEX_FILE).is_file()
    a = t.array("model.layers.1.mlp.down_proj.weight")
    assert a.dtype == np.float32 and a.shape == (64, 96)
    assert not a.flags.writeable  # a view of the read-only mapping
    assert t.nbytes == sum(np.prod(t.info(n).shape) * 4 for n in t)


def test_bfloat16_tensors_come_out_as_stored():
    t = CheckpointTensors(FIXTURES / "llama3-tied-bf16")
    a = t.array("model.embed_tokens.weight")
    assert a.dtype == ml_dtypes.bfloat16 and a.shape == (320, 64)
    raw = (FIXTURES / "llama3-tied-bf16" / "model.safetensors").read_bytes()
    info = t.info("model.embed_tokens.weight")
    expected = np.frombuffer(raw[info.start:info.end], np.uint16).reshape(320, 64)
    np.testing.assert_array_equal(a.view(np.uint16), expected)
    assert np.all(np.isfinite(a.astype(np.float32)))


def test_roundtrip_of_the_test_writer(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((4,), ml_dtypes.bfloat16),
              "c": np.zeros((0, 5), np.float16)}
    write_safetensors(tmp_path / "model.safetensors", arrays)
    t = CheckpointTensors(tmp_path)
    for k, v in arrays.items():
        np.testing.assert_array_equal(np.asarray(t.array(k)).astype(np.float32), v.astype(np.float32))


def test_truncated_file_names_the_file_and_tensor(tmp_path):
    d = copy_fixture("mistral", tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '.*' needs bytes up to"):
        CheckpointTensors(d)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        CheckpointTensors(d)
    f.write_bytes(b"")
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointTensors(d)


def test_missing_files(tmp_path):
    d = copy_fixture("llama3", tmp_path)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00003.safetensors listed in .* is missing"):
        CheckpointTensors(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights.*pytorch_model.bin.*safetensors only"):
        CheckpointTensors(empty)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        CheckpointTensors(tmp_path / "nowhere")


def test_index_disagreeing_with_the_files(tmp_path):
    d = copy_fixture("llama3", tmp_path)
    index = json.loads((d / INDEX_FILE).read_text())
    name = "model.norm.weight"
    right = index["weight_map"][name]
    index["weight_map"][name] = next(f for f in set(index["weight_map"].values()) if f != right)
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"lists tensor '{name}'"):
        CheckpointTensors(d)
    index["weight_map"] = {"x": "model-00001-of-00003.safetensors"}  # hides the other shards
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists tensor 'x'"):
        CheckpointTensors(d)
    (d / INDEX_FILE).write_text("{}")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        CheckpointTensors(d)


def test_corrupt_headers(tmp_path):
    f = tmp_path / "model.safetensors"
    write_safetensors(f, {"a": np.zeros((2, 3), np.float32), "b": np.zeros((3,), np.float32)})
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])

    def rewrite(h):
        body = json.dumps(h).encode()
        body += b" " * (n - len(body)) if len(body) <= n else b""
        f.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n:])

    rewrite({**header, "a": {**header["a"], "shape": [2, 4]}})
    with pytest.raises(CheckpointError, match="tensor 'a' spans bytes"):
        read_header(f)
    rewrite({**header, "b": {**header["b"], "data_offsets": [0, 12]}})
    with pytest.raises(CheckpointError, match="overlap"):
        read_header(f)
    rewrite({**header, "a": {**header["a"], "dtype": "Q4"}})
    with pytest.raises(CheckpointError, match="unsupported dtype 'Q4'"):
        read_header(f)
    f.write_bytes((10).to_bytes(8, "little") + b"not json!!" + raw[8 + n:])
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        read_header(f)


def test_two_files_without_an_index_are_ambiguous(tmp_path):
    d = copy_fixture("mistral", tmp_path)
    tensors = read_all(d)
    names = sorted(tensors)
    rewrite_single_file(d, {n: tensors[n] for n in names[:3]})
    write_safetensors(d / "extra.safetensors", {n: tensors[n] for n in names[3:]})
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        CheckpointTensors(d)


@pytest.mark.parametrize("family", sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file()))
def test_spec_parameter_count_equals_the_checkpoints(family):
    """`ModelSpec.num_parameters` (what `kvjax capacity` subtracts without a checkpoint) counts
    exactly the tensors a checkpoint of that architecture holds."""
    from kvjax.model_catalog import load_model_spec

    spec = load_model_spec(FIXTURES / family)
    assert CheckpointTensors(FIXTURES / family).served_parameters(spec.tie_embeddings) == spec.num_parameters


def test_check_names_refuses_the_first_problem_by_name(tmp_path):
    arrays = {"a": np.zeros((2, 3), np.float32), "b": np.zeros((4,), ml_dtypes.bfloat16),
              "x.rotary_emb.inv_freq": np.zeros((2,), np.float32), "head": np.zeros((2,), np.float32)}
    write_safetensors(tmp_path / "model.safetensors", arrays)
    t = CheckpointTensors(tmp_path)
    t.check_names({"a": (2, 3), "b": (4,)}, lambda name: name == "head")  # recomputed buffer and `unused` pass
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'head' \(kvjax would not use it"):
        t.check_names({"a": (2, 3), "b": (4,)})
    with pytest.raises(CheckpointError, match=r"tensor 'c' is missing \(2 missing in all\)"):
        t.check_names({"a": (2, 3), "c": (1,), "d": (1,)})
    with pytest.raises(CheckpointError, match=r"tensor 'a' has shape \[2, 3\], config.json implies \[3, 2\]"):
        t.check_names({"a": (3, 2), "b": (4,)}, lambda name: True)
    write_safetensors(tmp_path / "model.safetensors", {"a": np.zeros((2,), np.int32)})
    with pytest.raises(CheckpointError, match="tensor 'a' is I32; kvjax loads float32, float16 and bfloat16"):
        CheckpointTensors(tmp_path).check_names({"a": (2,)})
