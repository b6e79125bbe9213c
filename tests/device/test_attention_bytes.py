"""What the XLA attention path holds and moves, read from the compiled program (XLA's memory
and cost analyses), for a decode step over 8 rows of 1024 positions whose table is exactly as
wide as the rows need (64 columns of 16 tokens, all live: bucket padding is not measured) and
whose pool holds exactly those pages plus the null slot.

Ideal, "live K/V bytes": the bytes of the K and V pages the rows hold,
`B * M * tokens * kv_heads * head_dim * 2 * itemsize` (FP8 block scales, 1/256 of that, left out).

The path loops over steps of table columns (online softmax), so
1. no copy of the whole K/V exists: its temporaries are one step's pages (`CHUNK_BYTES` per
   field as the dots read them), the same for a 64- or a 512-column table (before: a dense copy
   of every gathered page plus float32 scores, growing with the table: bf16 4.25 -> 17 MiB);
2. XLA's cost analysis counts a while loop's body ONCE (whatever its trip count) and charges
   each page-gather fusion with its whole pool operand, K and V fields both, instead of the
   pages it gathers. Its figure is therefore a model, not a count: per step, the pages are read
   from the pool, written once as the dot's operand (a copy the size of one step: cache-resident
   at 1 MiB, but the model cannot see caches) and read by the dot, so an honest per-step count
   is ~3x the step's live bytes (FP8: 1 + 2 + 2 bytes per value, its pages entering the dots as
   bfloat16). `benchmarks/attention_bytes.py` counts it op by op (`hlo_bytes`), and
   `test_the_op_by_op_count` holds the path to it. The XLA CPU path cannot reach ~1.5x: XLA CPU
   runs every dot and reduction as a library kernel (YNNPACK) on a materialised operand, fusing
   no gather or convert into it (a multiply-reduce becomes a dot, or a reduction of a
   materialised product), and converts float8 dot operands to float32 first. That needs the
   page read fused into the dot: the Pallas kernel."""
import functools
import importlib.util
import os
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

from kvjax.config import CacheConfig
from kvjax.device import allocate_pools, attention, paged_attention, paged_attention_reference

B, M, TPB, K, G, H = 8, 64, 16, 2, 4, 64
ITEM = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
DTYPES = tuple(ITEM)


def live_bytes(dtype: str, m: int = M) -> int:
    return B * m * TPB * K * H * 2 * ITEM[dtype]


def compiled(dtype: str, m: int = M, reference: bool = False):
    """The program, with the CPU step budget on any backend (compiled once per module)."""
    return _compiled(dtype, m, reference)


@functools.cache
def _compiled(dtype: str, m: int, reference: bool):
    cfg = CacheConfig(tokens_per_block=TPB, num_layers=1, num_kv_heads=K, head_dim=H, max_seq_len=m * TPB,
                      primary_blocks=B * m, secondary_blocks=0, dtype=dtype)
    pools = jax.eval_shape(lambda: allocate_pools(cfg))
    q = jax.ShapeDtypeStruct((B, 1, K * G, H), jnp.float32 if dtype == "float32" else jnp.bfloat16)
    table, lens = jax.ShapeDtypeStruct((B, m), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32)
    if reference:
        fn = jax.jit(lambda q, p, t, s: paged_attention_reference(q, p, 0, t, s))
    else:
        fn = jax.jit(lambda q, p, t, s: paged_attention(q, p, 0, t, s, impl="xla"))
    budget = attention.CHUNK_BYTES
    with mock.patch.object(attention, "CHUNK_BYTES_ACCELERATOR", budget):
        return fn.lower(q, pools, table, lens).compile()


def units(dtype: str, reference: bool = False) -> float:
    """Bytes accessed by XLA's cost model, in live K/V bytes."""
    cost = compiled(dtype, reference=reference).cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return cost["bytes accessed"] / live_bytes(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_copy_of_the_whole_kv(dtype):
    temp = {m: compiled(dtype, m).memory_analysis().temp_size_in_bytes for m in (M, 8 * M)}
    # measured: 2.08 / 2.14 / 2.15 MiB (f32 / bf16 / fp8) at both widths; before 8.25 / 4.25 / 4.26 MiB
    # at 64 columns, growing with the table (33 / 17 / 17 MiB at 256)
    assert temp[8 * M] <= temp[M] + (64 << 10), temp  # the table's width does not grow the temporaries
    assert temp[M] <= 2.5 * attention.CHUNK_BYTES, temp  # about one step's K and V pages
    dense = B * 8 * M * TPB * K * H * (4 if dtype == "float32" else 2)  # one field of every page, as the dots read it
    assert temp[8 * M] <= dense / 4, (temp, dense)


def test_bytes_accessed_by_the_cost_model():
    """The model's figure (see the module docstring for what it counts): below the one-gather
    path it replaces, and in bytes the narrower pools move less."""
    f32, bf16, fp8 = (units(d) for d in DTYPES)
    # measured: 2.62, 3.42, 4.86 live-KV units (before, one gather of every page: 4.39, 4.78, 7.59)
    assert f32 <= 2.9 and bf16 <= 3.7 and fp8 <= 5.2, (f32, bf16, fp8)
    assert bf16 * 2 <= 0.7 * f32 * 4, (f32, bf16)  # in bytes: bfloat16 moves ~2/3 of float32
    assert fp8 * 1 <= 0.75 * bf16 * 2, (bf16, fp8)  # and FP8 ~0.7 of bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_xla_path_moves_less_than_the_reference_gather(dtype):
    """The per-position oracle gathers dense float32 copies: the XLA path stays well below it."""
    assert units(dtype) < 0.6 * units(dtype, reference=True), (units(dtype), units(dtype, reference=True))


def _bench():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "attention_bytes.py")
    spec = importlib.util.spec_from_file_location("attention_bytes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_op_by_op_count():
    """Counted op by op, each loop step once per trip: the pages are read once, copied once in
    the dots' dtype (bfloat16 for FP8) and read again, the floor of any dot formulation on XLA
    CPU (1 + 2 * dot_itemsize / pool_itemsize). If a step ever reads the pool straight from a dot
    (`copy` ~0), the XLA path got cheaper than docs/device.md says: update it and these bounds."""
    bench = _bench()
    assert bench.SHAPES["decode"] == (B, M, 1) and (bench.TPB, bench.KV_HEADS, bench.GROUP, bench.HEAD_DIM) == (TPB, K, G, H)
    # measured: 3.43 / 3.82 / 6.67 (f32 / bf16 / fp8) = pages 1.00 + copies 1.00 / 1.00 / 2.01 + the rest
    high = {"float32": 3.7, "bfloat16": 4.1, "float8_e4m3fn": 7.2}
    for dtype in DTYPES:
        trips = bench.xla_steps(dtype, B, M, 1, chunk_bytes=attention.CHUNK_BYTES)
        counted = {k: n / live_bytes(dtype) for k, n in bench.hlo_bytes(compiled(dtype).as_text(), trips).items()}
        copy = (4 if dtype == "float32" else 2) / ITEM[dtype]
        assert abs(counted["read"] - 1) < 0.02 and abs(counted["copy"] - copy) < 0.02, (dtype, counted)
        assert 1 + 2 * copy <= sum(counted.values()) <= high[dtype], (dtype, counted)


def test_float8_dot_operands_are_converted_to_float32():
    """Why FP8 pages enter the dots as bfloat16: fed as float8, XLA CPU converts them to float32
    in a fusion of its own (~9 page bytes moved against ~5)."""
    probe = _bench().fp8_dot_probe()
    assert probe["float8_convert"] == "f32" and probe["float8_bytes"] > 1.5 * probe["bfloat16_bytes"], probe
