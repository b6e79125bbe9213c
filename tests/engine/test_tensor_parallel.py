"""Tensor parallelism that scales past the KV heads and splits the vocabulary (`kvjax.models.parallel`).

- Every shipped model config (configs/models/*.toml) at its real head counts, norms, biases and
  activation, reduced in depth and width (2 layers: a local then a global one where the model
  mixes them; width 32, 8 dims per head, a 509-token vocabulary: prime, so every degree pads
  it), serves a greedy and a seeded sampled
  request at TP 2, 4 and 8 with exactly the tokens of one device, or is refused with
  `TensorParallelError` exactly where vLLM refuses (query heads or MLP width not divisible by
  tp, KV heads neither a multiple nor a divisor of it); each device holds V / tp embedding rows
  and max(1, K / tp) KV heads of every pool.
- The compiled step keeps the embedding and LM-head tables sharded: the partitioned program
  never holds a whole table, only each device's V / tp slice (untied and tied heads).
- The rules themselves: replication count and head order, vocabulary padding, refusals with no
  state change, KV-cache capacity per device counting the replicas; FP8 pools (scales per head)
  with replicated heads.
The engine-level test with offload / onboard through a tight pool at TP 4 (replicated heads)
is `test_distributed.py::test_tensor_parallel_in_one_process_matches_one_device`.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import MAX_SEQ_LEN, TPB, cache
from flax import nnx
from jax.sharding import PartitionSpec as P

from kvjax import capacity as C
from kvjax.device import allocate_pools
from kvjax.engine import Engine, EngineConfig, SchedulerConfig, SchedulerPolicy
from kvjax.engine.batching import Buckets
from kvjax.engine.engine import max_logit_difference
from kvjax.engine.sampling import SamplingParams, sample
from kvjax.engine.workloads import WorkItem
from kvjax.model_catalog import load_model_spec
from kvjax.model_spec import ModelSpec, available_models
from kvjax.models import Transformer
from kvjax.models.parallel import (
    TensorParallelError,
    padded_vocab_size,
    shard_model,
    tensor_parallel_layout,
    tensor_parallel_spec,
)

VOCAB = 509  # prime: padded at every degree (510, 512, 512)
WIDTH, HEAD_DIM, MLP = 32, 8, 64
LOCAL_WINDOW = 4  # shorter than prompt + output below (and than a block): local layers really slide


def mesh_of(tp: int):
    return jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp], axis_types=(jax.sharding.AxisType.Auto,))


def reduced(name: str) -> ModelSpec:
    """The shipped config with its real head counts, norms, biases, activation and window
    pattern, at test size (float32)."""
    spec = load_model_spec(name)
    windows = None
    if spec.attention_windows is not None:  # one layer of each kind, local first: (local,) or (local, global)
        windows = tuple(sorted({LOCAL_WINDOW if w < spec.max_seq_len else MAX_SEQ_LEN for w in spec.attention_windows}))
    kv = spec.num_kv_heads if isinstance(spec.num_kv_heads, int) else spec.num_kv_heads[:2]
    return dataclasses.replace(spec, num_layers=2, num_kv_heads=kv, head_dim=HEAD_DIM, hidden_size=WIDTH,
                               intermediate_size=MLP, vocab_size=VOCAB, max_seq_len=MAX_SEQ_LEN,
                               attention_windows=windows, dtype="float32")


def vllm_refusal(spec: ModelSpec, tp: int) -> str | None:
    """What vLLM's tensor parallelism refuses for this spec at `tp` (None: it serves it)."""
    if spec.num_attention_heads % tp:
        return "num_attention_heads"
    if spec.intermediate_size % tp:
        return "intermediate_size"
    if any(k % tp and tp % k for k in spec.kv_heads_per_layer):
        return "num_kv_heads"
    return None


# one request at a time, prompts prefilled one token per step: every forward of a run has the one
# shape [1, 1, 32] (one compiled step per model and degree, the suite's cost); the paged
# attention, the replicated heads and the vocab-parallel head run at every position. Multi-token
# prefill chunks at TP run in test_distributed.py and test_from_pretrained.py.
ONE_SHAPE = EngineConfig(SchedulerConfig(policy=SchedulerPolicy.GUARANTEED_NO_EVICT, max_batch_size=1, max_num_tokens=1),
                         Buckets(min_batch=1, min_chunk=1, min_blocks=MAX_SEQ_LEN // TPB, prefill_rows=1))


def items(vocab: int) -> list[WorkItem]:
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, vocab, 7)]
    return [WorkItem("greedy", tuple(prompt), 5),
            WorkItem("sampled", tuple(prompt[:3] + [int(t) for t in rng.integers(0, vocab, 2)]), 4,
                     sampling=SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11))]


@pytest.mark.slow
@pytest.mark.parametrize("name", available_models())
def test_every_shipped_config_serves_one_devices_tokens_at_tp_2_4_8(name):
    spec = reduced(name)
    work = items(spec.vocab_size)
    model = Transformer.from_spec(spec, seed=0)
    ref = Engine(model, ONE_SHAPE).run(work, cache(model, secondary=0))
    served = []
    for tp in (2, 4, 8):
        model = Transformer.from_spec(spec, seed=0)
        refusal = vllm_refusal(spec, tp)
        if refusal is not None:
            with pytest.raises(TensorParallelError, match=f"{refusal} .* divisible by {tp}"):
                Engine(model, ONE_SHAPE, mesh=mesh_of(tp))
            assert model.spec == spec and model.embed[...].shape == (VOCAB, WIDTH)  # nothing moved
            continue
        engine = Engine(model, ONE_SHAPE, mesh=mesh_of(tp))
        res = engine.run(work, cache(model, secondary=0))
        assert res.outputs == ref.outputs, (tp, res.outputs, ref.outputs)
        assert engine.runner.shapes == {(1, 0, 0, MAX_SEQ_LEN // TPB)}  # one-token chunks join the decode group
        assert max_logit_difference(res, ref) < 1e-4
        k = max(spec.kv_heads_per_layer)
        assert model.spec.kv_heads_per_layer == tuple(max(h, tp) for h in spec.kv_heads_per_layer)
        assert model.embed[...].addressable_shards[0].data.shape == (padded_vocab_size(VOCAB, tp) // tp, WIDTH)
        pools = engine.core(cache(model, secondary=0)).pools
        assert pools.primary[0].addressable_shards[0].data.shape[3] == max(1, k // tp)  # heads per device
        served.append(tp)
    expected = [tp for tp in (2, 4, 8) if vllm_refusal(spec, tp) is None]
    assert served == expected
    if name in ("gemma-2b", "falcon-7b", "llama-3.1-8b", "qwen2.5-7b"):  # the motivating cases
        assert served == {"gemma-2b": [2, 4, 8], "falcon-7b": [], "llama-3.1-8b": [2, 4, 8], "qwen2.5-7b": [2, 4]}[name]


# ---------------------------------------------------------------------- the compiled program
@pytest.mark.parametrize("tied", [False, True])
def test_compiled_step_keeps_embedding_and_head_sharded(tied):
    """The serving step (paged forward, then sampling, as `ModelRunner` composes them) partitioned
    over 4 devices holds only each device's V / tp rows of the embedding and columns of the
    head: no all-gather (or anything else) ever builds a whole [V, D] / [D, V] table."""
    tp, vocab = 4, 1000  # divisible: 250 rows each
    mesh = mesh_of(tp)
    spec = dataclasses.replace(reduced("tiny"), vocab_size=vocab, tie_embeddings=tied)
    model = shard_model(Transformer.from_spec(spec, seed=0), mesh)
    assert model.embed[...].sharding.spec == P("tp", None)
    assert model.embed[...].addressable_shards[0].data.shape == (vocab // tp, WIDTH)
    if not tied:
        assert model.lm_head[...].sharding.spec == P(None, "tp")
        assert model.lm_head[...].addressable_shards[0].data.shape == (WIDTH, vocab // tp)
    graphdef, state = nnx.split(model)
    pools = allocate_pools(model.spec.cache_config(tokens_per_block=8, max_seq_len=64, primary_blocks=8), sharding=mesh)

    def step(state, tokens, pools):  # tokens [1, S] at positions 0..S-1 in slots 0..S-1
        s = tokens.shape[1]
        positions = jnp.arange(s, dtype=jnp.int32)[None]  # [1, S]
        table = jnp.arange(8, dtype=jnp.int32)[None]  # [1, 8]
        logits, pools = nnx.merge(graphdef, state).paged_forward(tokens, positions, pools, table,
                                                                 jnp.array([s], jnp.int32), positions[0])
        z = jnp.zeros((1,), jnp.int32)
        tok, _, _ = sample(logits[:, -1], jnp.full((1,), 0.8), jnp.full((1,), 0.9), z, z, jnp.full((1,), 40, jnp.int32))
        return logits, tok, pools

    tokens = jnp.asarray([[1, 999, 250, 251, 749]], jnp.int32)
    compiled = jax.jit(step, donate_argnums=(2,)).lower(state, tokens, pools).compile()
    hlo = compiled.as_text()
    assert f"f32[{vocab // tp},{WIDTH}]" in hlo  # the local embedding shard is a parameter
    for whole in (f"[{vocab},{WIDTH}]", f"[{WIDTH},{vocab}]"):
        assert whole not in hlo, whole
    assert "all-reduce" in hlo  # the masked partial lookups are summed
    logits, tok, _ = compiled(state, tokens, pools)
    ref = Transformer.from_spec(spec, seed=0).dense_forward(tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=1e-4)
    assert 0 <= int(tok[0]) < vocab


def test_padded_vocabulary_is_never_a_token():
    """509 ids at TP 4: the tables hold 512, the logits stay [.., 509], and even a head whose
    padded columns would win every argmax never yields one."""
    spec = dataclasses.replace(reduced("micro"), vocab_size=VOCAB)
    model = shard_model(Transformer.from_spec(spec, seed=0), mesh_of(4))
    assert model.embed[...].shape == (512, WIDTH) and model.lm_head[...].shape == (WIDTH, 512)
    head = np.asarray(model.lm_head[...]).copy()
    head[:, VOCAB:] = 1e4  # padded columns: huge logits if they were ever read
    model.lm_head[...] = jax.device_put(head, model.lm_head[...].sharding)
    logits = model.dense_forward(np.array([[5, 6, 7]], np.int32))
    assert logits.shape == (1, 3, VOCAB) and float(np.max(np.asarray(logits))) < 1e3
    ref = Transformer.from_spec(spec, seed=0).dense_forward(np.array([[5, 6, 7]], np.int32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=1e-5)


# ---------------------------------------------------------------------- the rules
def test_kv_heads_replicate_in_place_and_the_spec_counts_them():
    gemma = load_model_spec("gemma-2b")  # 8 query heads, 1 KV head
    assert tensor_parallel_spec(gemma, 1) is gemma and tensor_parallel_spec(gemma, 8).num_kv_heads == 8
    llama = load_model_spec("llama-3.1-8b")
    assert tensor_parallel_spec(llama, 8) is llama  # 8 KV heads: one per device, nothing replicated
    qwen = tensor_parallel_spec(load_model_spec("qwen2.5-7b"), 4)
    assert qwen.num_kv_heads == 4 and dataclasses.replace(qwen, num_kv_heads=4) == qwen
    per_layer = dataclasses.replace(reduced("micro"), num_kv_heads=(1, 4))
    assert tensor_parallel_spec(per_layer, 2).num_kv_heads == (2, 4)

    wk = np.arange(2 * 3 * 2 * 4).reshape(2, 3, 2, 4)  # stacked [L, D, K=2, H]
    out = tensor_parallel_layout("wk", wk, 8)  # r = 4: heads 0,0,0,0,1,1,1,1 -> device d reads head d // 4
    assert out.shape == (2, 3, 8, 4)
    for d in range(8):
        np.testing.assert_array_equal(out[:, :, d], wk[:, :, d // 4])
    np.testing.assert_array_equal(tensor_parallel_layout("bv", np.ones((2, 4)), 4), np.ones((4, 4)))
    assert tensor_parallel_layout("wq", wk, 8) is wk  # query heads are never replicated
    assert tensor_parallel_layout("wk", out, 8) is out  # already laid out
    emb = np.ones((509, 3), np.float32)
    padded = tensor_parallel_layout("embed", emb, 4)
    assert padded.shape == (512, 3) and not padded[509:].any() and padded[:509].all()
    assert tensor_parallel_layout("lm_head", emb.T, 2).shape == (3, 510)
    assert tensor_parallel_layout("embed", padded, 4) is padded
    assert tensor_parallel_layout("attn_norm", emb, 4) is emb


def test_refusals_are_typed_and_move_nothing():
    base = reduced("micro")  # 4 query heads, 2 KV heads
    cases = [(base, 8, "num_attention_heads \\(4\\) divisible by 8"),
             (dataclasses.replace(base, intermediate_size=66), 4, "intermediate_size \\(66\\) divisible by 4"),
             (dataclasses.replace(base, num_attention_heads=12, num_kv_heads=3), 4, "num_kv_heads \\(3\\)"),
             (dataclasses.replace(base, num_attention_heads=12, num_kv_heads=6), 4, "num_kv_heads \\(6\\)")]
    for spec, tp, match in cases:
        with pytest.raises(TensorParallelError, match=match):
            tensor_parallel_spec(spec, tp)
        assert isinstance(TensorParallelError(""), ValueError)
    model = Transformer.from_spec(base, seed=0)
    before = np.asarray(model.blocks[0].attn.wk[...])
    with pytest.raises(TensorParallelError, match="num_attention_heads"):
        shard_model(model, mesh_of(8))
    assert model.spec == base and model.blocks[0].attn.num_kv_heads == 2
    np.testing.assert_array_equal(np.asarray(model.blocks[0].attn.wk[...]), before)
    assert len(model.embed[...].sharding.device_set) == 1
    with pytest.raises(TensorParallelError, match="positive int"):
        tensor_parallel_spec(base, 0)


def test_kv_capacity_per_device_counts_the_replicas():
    """A replicated head costs each device a whole head: Gemma-2B (1 KV head) gets the same
    blocks from a per-device budget at TP 8 as on one device, Llama-3.1-8B (8 heads) 8 times as many."""
    budget = 4 << 30  # per device
    for name, gain in (("gemma-2b", 1), ("llama-3.1-8b", 8)):
        spec = load_model_spec(name)
        one = C.cache_config_from_memory(spec.cache_config(max_seq_len=8192), budget, tokens_per_block=32)
        tp8 = tensor_parallel_spec(spec, 8)
        total, _ = C.serving_kv_cache_bytes(utilization=0.9, activations=0, kv_cache_bytes=budget, num_devices=8)
        eight = C.cache_config_from_memory(tp8.cache_config(max_seq_len=8192), total, tokens_per_block=32)
        assert eight.primary_blocks_for(8192) == gain * one.primary_blocks_for(8192), name


@pytest.mark.slow
def test_fp8_cache_with_replicated_kv_heads():
    """FP8 pools carry per-(block, layer, K/V, head) scales beside the bytes: with Gemma-2B's one
    KV head replicated on 4 devices each device scales its own copy, and the tokens are one
    device's."""
    spec = reduced("gemma-2b")
    work = items(spec.vocab_size)
    model = Transformer.from_spec(spec, seed=0)
    ref = Engine(model, ONE_SHAPE).run(work, cache(model, secondary=0, kv_cache_dtype="float8_e4m3fn"))
    model = Transformer.from_spec(spec, seed=0)
    engine = Engine(model, ONE_SHAPE, mesh=mesh_of(4))
    res = engine.run(work, cache(model, secondary=0, kv_cache_dtype="float8_e4m3fn"))
    assert res.outputs == ref.outputs and max_logit_difference(res, ref) < 1e-4
    pools = engine.core(cache(model, secondary=0, kv_cache_dtype="float8_e4m3fn")).pools
    assert pools.primary_scales[0].shape[3] == 4 and pools.primary_scales[0].addressable_shards[0].data.shape[3] == 1
