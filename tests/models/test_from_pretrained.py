"""from_pretrained on the transformers fixtures: prompt logits within float32 tolerance of
transformers', weights exactly as stored, no random draws, tensor-parallel sharding, the
multimodal Gemma 3 layout, and clear errors for broken checkpoints.

Tolerance: |kvjax - transformers| <= 1e-4 on float32 logits of magnitude up to ~25 (both
sides compute in float32; kvjax's matmuls use HIGHEST precision). Measured: <= 1.8e-5.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_helpers import FAMILIES, FIXTURES, copy_fixture, expected, read_all, rewrite_single_file

from kvjax.checkpoint_files import CheckpointError
from kvjax.hf_config import UnsupportedConfigError
from kvjax.model_catalog import load_model_spec
from kvjax.models import from_pretrained, jit_dense_forward, jit_paged_forward
from kvjax.models import layers as layers_mod

ATOL = 1e-4


def prompt_logit_error(model, family: str) -> float:
    """Largest |logit difference| to transformers over every stored position of every prompt.

    All prompts go in one right-padded batch (causal attention: padding after a prompt never
    reaches it), so each model compiles one forward."""
    exp = expected(family)
    prompts = exp["prompts"]
    tokens = np.zeros((len(prompts), 64), np.int32)  # [B, S]
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    out = np.asarray(jit_dense_forward(model)(jnp.asarray(tokens)))  # [B, S, V]
    worst = 0.0
    for row, ref in enumerate(exp["logits"]):
        for pos, values in zip(ref["positions"], ref["values"], strict=True):
            worst = max(worst, float(np.max(np.abs(out[row, pos] - np.asarray(values, np.float32)))))
    return worst


@pytest.fixture(autouse=True)
def no_random_weights(monkeypatch):
    """Loading never draws random weights: the sampler would raise."""
    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained drew random weights")

    monkeypatch.setattr(layers_mod, "_normal_chunk", refuse)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers(family):
    model = from_pretrained(FIXTURES / family, dtype="float32")
    assert model.spec == dataclasses.replace(load_model_spec(FIXTURES / family), dtype="float32")
    err = prompt_logit_error(model, family)
    print(f"{family}: max |logit - transformers| = {err:.2e}")
    assert err <= ATOL


def test_default_dtype_is_the_checkpoints_and_weights_are_exact():
    model = from_pretrained(FIXTURES / "llama3-tied-bf16")
    assert model.spec.dtype == "bfloat16" and model.embed[...].dtype == jnp.bfloat16
    assert model.lm_head is None  # tied
    stored = read_all(FIXTURES / "llama3-tied-bf16")
    np.testing.assert_array_equal(
        np.asarray(model.embed[...]).view(np.uint16), stored["model.embed_tokens.weight"].view(np.uint16)
    )
    q = stored["model.layers.1.self_attn.q_proj.weight"].astype(np.float32)  # [N * H, D]
    wq = np.asarray(model.blocks[1].attn.wq[...]).astype(np.float32)  # [D, N, H]
    np.testing.assert_array_equal(wq, q.reshape(4, 16, 64).transpose(2, 0, 1))
    f32 = from_pretrained(FIXTURES / "mistral")
    assert f32.spec.dtype == "float32" and f32.blocks[0].mlp.gate[...].dtype == jnp.float32
    up = read_all(FIXTURES / "mistral")["model.layers.0.mlp.up_proj.weight"]  # [F, D]
    np.testing.assert_array_equal(np.asarray(f32.blocks[0].mlp.up[...]), up.T)
    half = from_pretrained(FIXTURES / "qwen2", dtype=jnp.bfloat16)
    bias = read_all(FIXTURES / "qwen2")["model.layers.0.self_attn.k_proj.bias"]
    np.testing.assert_array_equal(np.asarray(half.blocks[0].attn.bk[...]), bias.astype(ml_dtypes.bfloat16).reshape(2, 16))
    with pytest.raises(ValueError, match="dtype"):
        from_pretrained(FIXTURES / "qwen2", dtype="int8")


def test_tensor_parallel_mesh_shards_heads_and_mlp_columns():
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2], axis_types=auto)
    model = from_pretrained(FIXTURES / "qwen2", mesh=mesh)
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert attn.wq[...].sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    assert attn.wk[...].sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)
    assert attn.wo[...].sharding.spec == jax.sharding.PartitionSpec("tp", None, None)
    assert attn.bq[...].sharding.spec == jax.sharding.PartitionSpec("tp", None)
    assert mlp.gate[...].sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert mlp.down[...].sharding.spec == jax.sharding.PartitionSpec("tp", None)
    assert attn.wk[...].addressable_shards[0].data.shape == (64, 1, 16)  # one of two kv heads per device
    assert prompt_logit_error(model, "qwen2") <= ATOL

    # the paged path with pools sharded over the same kv heads
    from kvjax.device import allocate_pools

    config = model.spec.cache_config(tokens_per_block=8, max_seq_len=64, primary_blocks=8)
    pools = allocate_pools(config, sharding=mesh)
    prompt = expected("qwen2")["prompts"][3][:20]
    slots = np.arange(20, dtype=np.int32)
    table = np.array([[0, 1, 2, 8, 8, 8, 8, 8]], np.int32)  # 8 = the null slot
    positions = np.arange(20, dtype=np.int32)[None]
    logits, pools = jit_paged_forward(model)(jnp.asarray([prompt], jnp.int32), positions, pools, table,
                                             np.array([20], np.int32), slots)
    dense = jit_dense_forward(model)(jnp.asarray([prompt], jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(dense), atol=1e-4)

    assert model.embed[...].sharding.spec == jax.sharding.PartitionSpec("tp", None)  # tied: the head too
    assert model.embed[...].addressable_shards[0].data.shape == (160, 64)  # vocab-parallel: 320 / 2 rows each

    # more devices than KV heads: each of the 2 heads replicated on 2 of the 4 devices (vLLM's rule)
    mesh4 = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4], axis_types=auto)
    model = from_pretrained(FIXTURES / "qwen2", mesh=mesh4)
    assert model.spec.num_kv_heads == 4 and model.blocks[0].attn.num_kv_heads == 4
    assert dataclasses.replace(model.spec, num_kv_heads=2) == load_model_spec(FIXTURES / "qwen2")
    stored = read_all(FIXTURES / "qwen2")["model.layers.1.self_attn.k_proj.weight"]  # [K * H, D]
    wk = model.blocks[1].attn.wk[...]  # [D, 4, H]: heads 0, 0, 1, 1
    np.testing.assert_array_equal(np.asarray(wk), np.repeat(stored.reshape(2, 16, 64).transpose(2, 0, 1), 2, axis=1))
    assert wk.addressable_shards[0].data.shape == (64, 1, 16) and model.blocks[1].attn.bk[...].shape == (4, 16)
    assert model.embed[...].addressable_shards[0].data.shape == (80, 64)
    assert prompt_logit_error(model, "qwen2") <= ATOL
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) divisible by 8"):
        from_pretrained(FIXTURES / "qwen2", mesh=jax.make_mesh((8,), ("tp",), axis_types=auto))
    explicit = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Explicit,))
    with pytest.raises(ValueError, match="Auto axes"):
        from_pretrained(FIXTURES / "qwen2", mesh=explicit)


def test_tensor_parallel_pads_a_vocabulary_that_does_not_split(tmp_path):
    """318 ids over 4 devices: the embedding and the untied head are padded to 320 (80 rows /
    columns each), the logits keep 318 columns and equal one device's."""
    d = copy_fixture("llama3", tmp_path)
    tensors = read_all(d)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:318]
    rewrite_single_file(d, tensors)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "vocab_size": 318}))
    one = from_pretrained(d)
    mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,))
    model = from_pretrained(d, mesh=mesh)
    assert model.spec.vocab_size == 318 and model.embed[...].shape == (320, 64) and model.lm_head[...].shape == (64, 320)
    assert model.embed[...].addressable_shards[0].data.shape == (80, 64)
    assert model.lm_head[...].addressable_shards[3].data.shape == (64, 80)
    assert not np.asarray(model.embed[...])[318:].any()
    tokens = jnp.asarray([[1, 317, 5, 200, 316, 9]], jnp.int32)
    logits = jit_dense_forward(model)(tokens)
    assert logits.shape == (1, 6, 318)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(jit_dense_forward(one)(tokens)), atol=1e-5)


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_multimodal_gemma3_serves_its_text_model(tmp_path, layout):
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration: a text_config and prefixed weights."""
    d = copy_fixture("gemma3", tmp_path)
    text = json.loads((d / "config.hub.json").read_text())
    outer = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "float32",
             "text_config": {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype", "transformers_version")},
             "vision_config": {"hidden_size": 16}, "mm_tokens_per_image": 4, "image_token_index": 300,
             "boi_token_index": 301, "eoi_token_index": 302}
    (d / "config.json").write_text(json.dumps(outer))
    tensors = {name.replace("model.", layout, 1): a for name, a in read_all(d).items()}
    tensors[("" if layout.startswith("language") else "model.") + "vision_tower.patch_embed.weight"] = np.ones((4, 4), np.float32)
    tensors["multi_modal_projector.mm_input_projection_weight"] = np.ones((4, 4), np.float32)
    rewrite_single_file(d, tensors)
    model = from_pretrained(d)
    assert prompt_logit_error(model, "gemma3") <= ATOL


def test_broken_checkpoints_raise_clear_errors(tmp_path):
    d = copy_fixture("qwen3", tmp_path)
    tensors = read_all(d)
    name = "model.layers.1.self_attn.k_norm.weight"

    rewrite_single_file(d, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        from_pretrained(d)
    rewrite_single_file(d, {**tensors, "model.layers.0.mlp.extra.weight": np.ones((2,), np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        from_pretrained(d)
    rewrite_single_file(d, {**tensors, name: np.ones((16,), np.float32)})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has shape \\[16\\], config.json implies \\[32\\]"):
        from_pretrained(d)
    rewrite_single_file(d, {**tensors, name: np.ones((32,), np.int32)})
    with pytest.raises(CheckpointError, match="is I32"):
        from_pretrained(d)
    rewrite_single_file(d, tensors)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated"):
        from_pretrained(d)
    f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        from_pretrained(d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}))
    with pytest.raises(UnsupportedConfigError, match="'rope_parameters'"):
        from_pretrained(d)
