"""Bytes the XLA attention path moves, by XLA's cost analysis of the compiled program: K/V are
read in the pool's dtype (no dense float32 copies), so a bfloat16 pool moves about half of a
float32 pool's bytes and an FP8 pool less than a bfloat16 one.

Units: the live K/V bytes of the step (every position of every row, K and V). XLA's model
charges each page gather with its whole operand (the pool: here exactly the live pages plus the
null slot), once per field, so ~2 of the ratio is that charge; what is left is the gathered
pages, read once by their dot, plus scores and the output."""
import jax
import jax.numpy as jnp
import pytest

from kvjax.config import CacheConfig
from kvjax.device import allocate_pools, paged_attention

B, M, TPB, K, G, H = 4, 16, 16, 2, 4, 64  # a decode step over 4 rows of 256 positions
ITEM = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}


def bytes_per_live_kv(dtype: str, impl: str = "xla") -> float:
    cfg = CacheConfig(tokens_per_block=TPB, num_layers=1, num_kv_heads=K, head_dim=H, max_seq_len=M * TPB,
                      primary_blocks=B * M, secondary_blocks=0, dtype=dtype)
    pools = jax.eval_shape(lambda: allocate_pools(cfg))
    q = jax.ShapeDtypeStruct((B, 1, K * G, H), jnp.float32 if dtype == "float32" else jnp.bfloat16)
    table, lens = jax.ShapeDtypeStruct((B, M), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)
    fn = jax.jit(lambda q, p, t, s: paged_attention(q, p, 0, t, s, impl=impl))
    cost = fn.lower(q, pools, table, lens).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["bytes accessed"] / (B * M * TPB * K * H * 2 * ITEM[dtype])


def test_pages_are_read_in_the_pool_dtype():
    f32, bf16, fp8 = (bytes_per_live_kv(d) for d in ("float32", "bfloat16", "float8_e4m3fn"))
    # measured: 4.45, 4.88, 7.76 live-KV units (before: 4.47, 6.88, 12.01: float32 copies of K/V)
    assert f32 <= 4.7 and bf16 <= 5.2 and fp8 <= 8.2, (f32, bf16, fp8)
    assert bf16 * 2 <= 0.6 * f32 * 4, (f32, bf16)  # in bytes: bfloat16 moves ~half of float32
    assert fp8 * 1 <= 0.85 * bf16 * 2, (bf16, fp8)  # and FP8 less than bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_xla_path_moves_no_more_than_the_reference_gather(dtype):
    """The per-position oracle gathers dense float32 copies: the XLA path must stay well below it."""
    from kvjax.device.attention import paged_attention_reference

    cfg = CacheConfig(tokens_per_block=TPB, num_layers=1, num_kv_heads=K, head_dim=H, max_seq_len=M * TPB,
                      primary_blocks=B * M, secondary_blocks=0, dtype=dtype)
    pools = jax.eval_shape(lambda: allocate_pools(cfg))
    q = jax.ShapeDtypeStruct((B, 1, K * G, H), jnp.float32 if dtype == "float32" else jnp.bfloat16)
    table, lens = jax.ShapeDtypeStruct((B, M), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)
    ref = jax.jit(lambda q, p, t, s: paged_attention_reference(q, p, 0, t, s)).lower(q, pools, table, lens).compile()
    cost = ref.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ref_units = cost["bytes accessed"] / (B * M * TPB * K * H * 2 * ITEM[dtype])
    assert bytes_per_live_kv(dtype) < 0.8 * ref_units, (bytes_per_live_kv(dtype), ref_units)
