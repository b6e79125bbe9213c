"""A Flax NNX decoder that uses the paged KV cache (and a dense oracle for tests).

`Transformer.from_spec("tiny")` builds the built-in demo model from `configs/models/tiny.toml`
(random weights); `from_pretrained(path)` loads a Hugging Face checkpoint (Llama 3.x, Mistral,
Qwen2/2.5, Qwen3, Gemma 3 text) with its weights;
`shard_model(model, mesh)` places any built model's weights for tensor parallelism (heads, MLP
columns and the vocabulary split; KV heads replicated past their count, `tensor_parallel_spec`);
`dense_forward` recomputes everything, `paged_forward` goes through `kvjax.device`'s
`write_kv` / `paged_attention` (`paged_hidden`: several row groups, e.g. the engine's decode
and prefill rows, in one pass over the weights). `jit_dense_forward` / `jit_paged_forward` give jitted callables
(pools donated); `dense_greedy` is the token-level oracle for serving tests.
"""
from kvjax.models.attention import Attention, grouped_attention, visibility_mask
from kvjax.models.generate import dense_greedy
from kvjax.models.layers import MLP, RMSNorm, apply_rope, rope_frequencies
from kvjax.models.parallel import TensorParallelError, shard_model, tensor_parallel_spec
from kvjax.models.pretrained import from_pretrained
from kvjax.models.transformer import Block, RowGroup, Transformer, jit_dense_forward, jit_paged_forward

__all__ = [
    "Attention",
    "Block",
    "MLP",
    "RMSNorm",
    "RowGroup",
    "TensorParallelError",
    "Transformer",
    "apply_rope",
    "dense_greedy",
    "from_pretrained",
    "grouped_attention",
    "jit_dense_forward",
    "jit_paged_forward",
    "rope_frequencies",
    "shard_model",
    "tensor_parallel_spec",
    "visibility_mask",
]
