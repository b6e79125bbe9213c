"""Pallas kernels on CPU: Mosaic GPU kernels run under the GPU interpreter with race
detection and must agree exactly with their references; every Mosaic GPU kernel is
cross-lowered for CUDA against an abstract "NVIDIA H200"."""
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import copy_pages, gather_pages, paged_attention, write_pages
from pallas_kernels.cross_lower import lower_for_h200
from pallas_kernels.tuning import AttentionTuning, CopyTuning

S = jax.ShapeDtypeStruct
LAYOUTS = ("block_first", "layer_first")


def interp():
    return plgpu.InterpretGPUParams(detect_races=True)


def assert_no_races():
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mi

    assert not mi.get_races().races_found


def small_pool(layout, dtype, rng, slots=7, layers=2, f=2, h=2, t=8, d=64):
    shape = (slots, layers, f, h, t, d) if layout == "block_first" else (layers, slots, f, h, t, d)
    x = rng.standard_normal(shape).astype(np.float32)
    if layout == "block_first":
        x[-1] = 0
    else:
        x[:, -1] = 0
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mgpu_gather_pages_interpret(layout):
    rng = np.random.default_rng(0)
    pool = small_pool(layout, jnp.bfloat16, rng)
    table = jnp.array([[0, 3, 6, 6], [5, 1, 2, 6]], jnp.int32)  # 6 = null slot
    lens = jnp.array([11, 24], jnp.int32)  # a partial block and a full one
    layer = jnp.array([1], jnp.int32)
    got = jax.jit(functools.partial(gather_pages.gather_pages_mgpu, layout=layout, interpret=interp()))(pool, table, lens, layer)
    want = gather_pages.gather_pages_portable(pool, table, lens, layer, layout=layout)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert_no_races()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mgpu_write_pages_interpret(layout):
    rng = np.random.default_rng(1)
    pool = small_pool(layout, jnp.float32, rng)
    kv = jnp.asarray(rng.standard_normal((5, 2, 2, 64)), jnp.float32)
    slot = jnp.array([0, 3, -1, 5, 3], jnp.int32)
    off = jnp.array([1, 7, 0, 2, 0], jnp.int32)
    want = np.array(pool)
    for i in range(5):
        if slot[i] >= 0:
            idx = (int(slot[i]), 1) if layout == "block_first" else (1, int(slot[i]))
            want[idx][:, :, int(off[i])] = kv[i]
    got = jax.jit(functools.partial(write_pages.write_pages_mgpu, layout=layout, interpret=interp()),
                  donate_argnums=0)(jnp.array(pool), kv, slot, off, jnp.array([1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert_no_races()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mgpu_copy_pages_interpret(layout):
    rng = np.random.default_rng(2)
    ba = 0 if layout == "block_first" else 1
    pool = small_pool(layout, jnp.bfloat16, rng)
    idx = jnp.array([3, 0, 6], jnp.int32)
    staged = jax.jit(functools.partial(copy_pages.gather_blocks_mgpu, block_axis=ba, interpret=interp()))(pool, idx)
    want = np.moveaxis(np.take(np.asarray(pool), np.asarray(idx), axis=ba), ba, 0)
    np.testing.assert_array_equal(np.asarray(staged), want)
    dst = jnp.array([1, -1, 4], jnp.int32)
    num = jnp.array([8, 8, 3], jnp.int32)  # full, padding, partial copy of 3 tokens
    expect = np.array(pool)
    for i in range(3):
        if dst[i] >= 0:
            view = expect[int(dst[i])] if ba == 0 else expect[:, int(dst[i])]
            view[..., : int(num[i]), :] = want[i][..., : int(num[i]), :]
    got = jax.jit(functools.partial(copy_pages.scatter_blocks_mgpu, block_axis=ba, interpret=interp()),
                  donate_argnums=0)(jnp.array(pool), staged, dst, num)
    np.testing.assert_array_equal(np.asarray(got), expect)
    assert_no_races()


def _lowered(fn, *args, donate=()):
    txt = lower_for_h200(fn, *args, donate_argnums=donate)
    assert "mosaic_gpu" in txt, "expected a Mosaic GPU custom call"
    return txt


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mgpu_kernels_cross_lower_for_h200(layout):
    ba = 0 if layout == "block_first" else 1
    big = (257, 4, 2, 8, 16, 128) if ba == 0 else (4, 257, 2, 8, 16, 128)
    pool = S(big, jnp.bfloat16)
    i32 = lambda *s: S(s, jnp.int32)  # noqa: E731
    _lowered(functools.partial(gather_pages.gather_pages_mgpu, layout=layout), pool, i32(8, 32), i32(8), i32(1))
    txt = _lowered(functools.partial(write_pages.write_pages_mgpu, layout=layout), pool,
                   S((64, 2, 8, 128), jnp.bfloat16), i32(64), i32(64), i32(1), donate=(0,))
    assert "tf.aliasing_output" in txt  # the donated pool is updated in place
    _lowered(functools.partial(copy_pages.gather_blocks_mgpu, block_axis=ba), pool, i32(16))
    _lowered(functools.partial(copy_pages.scatter_blocks_mgpu, block_axis=ba), pool,
             S((16, 4, 2, 8, 16, 128), jnp.bfloat16), i32(16), i32(16), donate=(0,))
    # a [H, T, D] chunk over the shared-memory budget is split per head
    wide = (33, 2, 2, 32, 64, 128) if ba == 0 else (2, 33, 2, 32, 64, 128)
    _lowered(functools.partial(copy_pages.scatter_blocks_mgpu, block_axis=ba), S(wide, jnp.bfloat16),
             S((4, 2, 2, 32, 64, 128), jnp.bfloat16), i32(4), i32(4))


@pytest.mark.parametrize("q_len,heads,tpb", [(1, 8, 16), (4, 32, 16), (1, 8, 64), (2, 4, 128)])
def test_mgpu_paged_attention_cross_lowers(q_len, heads, tpb):
    """The wgmma kernel cannot run under the 0.12 GPU interpreter (no wgmma rule on CPU), so
    CI checks that it lowers; benchmarks/gpu_check.sh checks its numbers on a GPU."""
    pool = S((65, 2, 2, 2, tpb, 128), jnp.bfloat16)
    fn = functools.partial(paged_attention.paged_attention_mgpu, layout="block_first", scale=0.1, window=512)
    _lowered(fn, S((4, q_len, heads, 128), jnp.bfloat16), pool, S((4, 8), jnp.int32), S((4,), jnp.int32), S((1,), jnp.int32))
    lf = S((2, 65, 2, 2, tpb, 128), jnp.float16)
    _lowered(functools.partial(paged_attention.paged_attention_mgpu, layout="layer_first", scale=0.1, window=7),
             S((2, q_len, heads, 128), jnp.float16), lf, S((2, 8), jnp.int32), S((2,), jnp.int32), S((1,), jnp.int32))


def test_mgpu_attention_rejects_unsupported_shapes():
    assert not paged_attention.mgpu_supported(jnp.float32, 128, 16)
    assert not paged_attention.mgpu_supported(jnp.bfloat16, 96, 16)
    assert not paged_attention.mgpu_supported(jnp.bfloat16, 128, 4)
    assert paged_attention.mgpu_supported(jnp.bfloat16, 128, 32)
    with pytest.raises(ValueError, match="16-bit"):
        paged_attention.paged_attention_mgpu(jnp.ones((1, 1, 2, 64)), jnp.ones((3, 1, 2, 2, 8, 64)), jnp.zeros((1, 2), jnp.int32),
                                             jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32), layout="block_first",
                                             scale=1.0, window=8)


def _fp8_pool(layout, rng, slots=7, layers=2, h=2, t=8, d=64):
    """uint8 bit patterns of random e4m3 values (how FP8 pools are stored) and their scales."""
    pool = small_pool(layout, jnp.float32, rng, slots, layers, 2, h, t, d)
    q = jax.lax.bitcast_convert_type(pool.astype(jnp.float8_e4m3fn), jnp.uint8)
    shape = pool.shape[:4]
    scales = jnp.asarray(2.0 ** rng.integers(-4, 4, shape), jnp.float32)
    null = (slice(None), -1) if layout == "layer_first" else (-1,)
    return q, scales.at[null].set(0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_gather_kernels_dequantise(layout):
    """FP8 pools: the portable kernel dequantises inside; the Mosaic GPU kernel moves the
    bytes (interpreter, race detection) and its XLA epilogue dequantises; both equal a plain
    jnp dequantisation of the gathered pages. The layer is a traced [1] array."""
    rng = np.random.default_rng(5)
    pool, scales = _fp8_pool(layout, rng)
    table = jnp.array([[0, 3, 6, 6], [5, 1, 2, 6]], jnp.int32)
    lens = jnp.array([11, 24], jnp.int32)
    layer = jnp.array([1], jnp.int32)
    port = jax.jit(functools.partial(gather_pages.gather_pages_portable, layout=layout, out_dtype=jnp.float32,
                                     value_dtype=jnp.float8_e4m3fn))(pool, table, lens, layer, scales)
    raw = jax.jit(functools.partial(gather_pages.gather_pages_mgpu, layout=layout, interpret=interp()))(pool, table, lens, layer)
    assert_no_races()
    mg = [gather_pages.dequantize_pages(p, scales, table, layer, f, layout=layout, out_dtype=jnp.float32,
                                        value_dtype=jnp.float8_e4m3fn) for f, p in enumerate(raw)]
    vals = jax.lax.bitcast_convert_type(pool, jnp.float8_e4m3fn).astype(jnp.float32)
    for f in range(2):
        idx = (table, 1, f) if layout == "block_first" else (1, table, f)
        pages = vals[idx] * scales[idx][..., None, None]  # [B, M, H, T, D]
        want = jnp.transpose(pages, (0, 1, 3, 2, 4)).reshape(2, 32, 2, 64)
        want = jnp.where(jnp.arange(32)[None, :, None, None] < lens[:, None, None, None], want, 0)
        np.testing.assert_array_equal(np.asarray(port[f]), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(mg[f]), np.asarray(want))


def test_fp8_attention_kernel_dequantises():
    rng = np.random.default_rng(6)
    pool, scales = _fp8_pool("block_first", rng, t=4, d=16)
    table = jnp.array([[0, 3, 6], [5, 1, 2]], jnp.int32)
    lens = jnp.array([9, 12], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 2, 4, 16)), jnp.float32)
    layer = jnp.array([0], jnp.int32)
    got = paged_attention.paged_attention_portable(q, pool, table, lens, layer, scales, layout="block_first", scale=0.25,
                                                   window=100, value_dtype=jnp.float8_e4m3fn)
    vals = jax.lax.bitcast_convert_type(pool, jnp.float8_e4m3fn).astype(jnp.float32) * scales[..., None, None]
    f32 = paged_attention.paged_attention_portable(q, vals, table, lens, layer, layout="block_first", scale=0.25, window=100)
    np.testing.assert_allclose(np.asarray(got), np.asarray(f32), atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mgpu_kernels_on_fp8_bytes_cross_lower_for_h200(layout):
    """FP8 pools (uint8 storage) through the Mosaic GPU byte movers, with a traced layer,
    and the gather's dequantising epilogue, lowered for CUDA."""
    ba = 0 if layout == "block_first" else 1
    shape = (257, 4, 2, 8, 16, 128) if ba == 0 else (4, 257, 2, 8, 16, 128)
    pool, i32 = S(shape, jnp.uint8), (lambda *s: S(s, jnp.int32))  # noqa: E731
    scales = S(shape[:4], jnp.float32)

    def gather_fp8(pool, table, lens, layer, scales):
        pages = gather_pages.gather_pages_mgpu(pool, table, lens, layer, layout=layout)
        return [gather_pages.dequantize_pages(p, scales, table, layer, f, layout=layout, out_dtype=jnp.bfloat16,
                                              value_dtype=jnp.float8_e4m3fn) for f, p in enumerate(pages)]

    _lowered(gather_fp8, pool, i32(8, 32), i32(8), i32(1), scales)
    _lowered(functools.partial(write_pages.write_pages_mgpu, layout=layout), pool, S((64, 2, 8, 128), jnp.uint8),
             i32(64), i32(64), i32(1), donate=(0,))
    _lowered(functools.partial(copy_pages.scatter_blocks_mgpu, block_axis=ba), pool,
             S((16, 4, 2, 8, 16, 128), jnp.uint8), i32(16), i32(16), donate=(0,))


def test_mgpu_attention_refuses_fp8():
    assert not paged_attention.mgpu_supported(jnp.float8_e4m3fn, 128, 16)
    with pytest.raises(ValueError, match="16-bit"):
        paged_attention.paged_attention_mgpu(jnp.ones((1, 1, 2, 64)), jnp.ones((3, 1, 2, 2, 8, 64), jnp.uint8),
                                             jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                                             jnp.zeros((1,), jnp.int32), layout="block_first", scale=1.0, window=8)


# ------------------------------------------------------------------ each kernel file's own jnp reference
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_kernels_match_their_reference(layout):
    rng = np.random.default_rng(7)
    pool = small_pool(layout, jnp.bfloat16, rng)
    table = jnp.array([[0, 3, 6, 6], [5, 1, 2, 6], [4, 4, 0, 1]], jnp.int32)
    lens = jnp.array([11, 24, 32], jnp.int32)
    layer = jnp.array([1], jnp.int32)
    want = gather_pages.gather_pages_reference(pool, table, lens, layer, layout=layout)
    chex.assert_shape(want, ((3, 32, 2, 64),) * 2)
    port = gather_pages.gather_pages_portable(pool, table, lens, layer, layout=layout)
    mgpu = jax.jit(functools.partial(gather_pages.gather_pages_mgpu, layout=layout, interpret=interp()))(pool, table, lens, layer)
    assert_no_races()
    chex.assert_trees_all_equal(tuple(port), tuple(want))
    chex.assert_trees_all_equal(tuple(mgpu), tuple(want))
    fp8, scales = _fp8_pool(layout, rng)
    args = dict(layout=layout, out_dtype=jnp.float32, value_dtype=jnp.float8_e4m3fn)
    chex.assert_trees_all_equal(tuple(gather_pages.gather_pages_portable(fp8, table, lens, layer, scales, **args)),
                                tuple(gather_pages.gather_pages_reference(fp8, table, lens, layer, scales, **args)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_kernels_match_their_reference(layout):
    rng = np.random.default_rng(8)
    pool = small_pool(layout, jnp.float32, rng)
    kv = jnp.asarray(rng.standard_normal((6, 2, 2, 64)), jnp.float32)
    slot = jnp.array([0, 3, -1, 5, 3, -7], jnp.int32)  # negatives are padding
    off = jnp.array([1, 7, 0, 2, 0, 3], jnp.int32)
    layer = jnp.array([1], jnp.int32)
    want = write_pages.write_pages_reference(pool, kv, slot, off, layer, layout=layout)
    chex.assert_trees_all_equal(write_pages.write_pages_portable(pool, kv, slot, off, layer, layout=layout), want)
    mgpu = jax.jit(functools.partial(write_pages.write_pages_mgpu, layout=layout, interpret=interp()))(pool, kv, slot, off, layer)
    assert_no_races()
    chex.assert_trees_all_equal(mgpu, want)
    assert not np.array_equal(np.asarray(want), np.asarray(pool))  # the reference did write


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_kernels_match_their_reference(layout):
    rng = np.random.default_rng(9)
    ba = 0 if layout == "block_first" else 1
    pool = small_pool(layout, jnp.bfloat16, rng)
    idx = jnp.array([3, 0, 6, 2], jnp.int32)
    staged = copy_pages.gather_blocks_reference(pool, idx, block_axis=ba)
    chex.assert_shape(staged, (4, 2, 2, 2, 8, 64))
    chex.assert_trees_all_equal(copy_pages.gather_blocks_portable(pool, idx, block_axis=ba), staged)
    staged = staged[::-1]
    dst = jnp.array([1, -1, 4, 5], jnp.int32)
    num = jnp.array([8, 8, 3, 0], jnp.int32)  # full, padding, partial, nothing
    want = copy_pages.scatter_blocks_reference(pool, staged, dst, num, block_axis=ba)
    chex.assert_trees_all_equal(copy_pages.scatter_blocks_portable(pool, staged, dst, num, block_axis=ba), want)
    mgpu = jax.jit(functools.partial(copy_pages.scatter_blocks_mgpu, block_axis=ba, interpret=interp()))(pool, staged, dst, num)
    assert_no_races()
    chex.assert_trees_all_equal(mgpu, want)


@pytest.mark.parametrize("window,q_len", [(100, 1), (100, 3), (5, 2)])
def test_attention_kernel_matches_its_reference(window, q_len):
    rng = np.random.default_rng(10)
    pool = small_pool("layer_first", jnp.float32, rng, t=4, d=16)
    table = jnp.array([[0, 3, 6, 6], [5, 1, 2, 4]], jnp.int32)
    lens = jnp.array([7, 16], jnp.int32)
    layer = jnp.array([1], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, q_len, 4, 16)), jnp.float32)
    kw = dict(layout="layer_first", scale=0.25, window=window)
    want = paged_attention.paged_attention_reference(q, pool, table, lens, layer, **kw)
    chex.assert_shape(want, q.shape)
    chex.assert_trees_all_close(paged_attention.paged_attention_portable(q, pool, table, lens, layer, **kw), want, atol=1e-5)
    fp8, scales = _fp8_pool("layer_first", rng, t=4, d=16)
    fkw = dict(kw, value_dtype=jnp.float8_e4m3fn)
    chex.assert_trees_all_close(paged_attention.paged_attention_portable(q, fp8, table, lens, layer, scales, **fkw),
                                paged_attention.paged_attention_reference(q, fp8, table, lens, layer, scales, **fkw), atol=1e-5)


def test_fp8_without_value_dtype_is_refused():
    rng = np.random.default_rng(11)
    pool, scales = _fp8_pool("block_first", rng)
    table, lens, layer = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="value_dtype"):
        gather_pages.gather_pages_reference(pool, table, lens, layer, scales, layout="block_first")


# ------------------------------------------------------------------ tuning configs
def test_tuning_configs_validate_and_are_static():
    with pytest.raises(ValueError, match="block_q"):
        AttentionTuning(block_q=48)
    with pytest.raises(ValueError, match="min_block_kv"):
        AttentionTuning(min_block_kv=12)
    with pytest.raises(ValueError, match="smem_chunk_bytes"):
        CopyTuning(smem_chunk_bytes=1 << 20)
    with pytest.raises(ValueError, match="smem_chunk_bytes"):
        CopyTuning(smem_chunk_bytes=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        AttentionTuning().block_q = 128  # type: ignore[misc]
    assert hash(AttentionTuning()) == hash(AttentionTuning(64, 64))
    # 32-token pages neither divide nor are a multiple of a 48-key step
    assert paged_attention.mgpu_supported(jnp.bfloat16, 128, 32)
    assert not paged_attention.mgpu_supported(jnp.bfloat16, 128, 32, AttentionTuning(min_block_kv=48))
    assert paged_attention.mgpu_supported(jnp.bfloat16, 128, 16, AttentionTuning(min_block_kv=128))


def test_non_default_tuning_cross_lowers():
    pool = S((65, 2, 2, 2, 16, 128), jnp.bfloat16)
    fn = functools.partial(paged_attention.paged_attention_mgpu, layout="block_first", scale=0.1, window=512,
                           tuning=AttentionTuning(block_q=128, min_block_kv=128))
    _lowered(fn, S((4, 2, 8, 128), jnp.bfloat16), pool, S((4, 8), jnp.int32), S((4,), jnp.int32), S((1,), jnp.int32))
    # a tiny chunk budget splits every block per head
    wide = S((33, 2, 2, 4, 16, 128), jnp.bfloat16)
    _lowered(functools.partial(copy_pages.scatter_blocks_mgpu, block_axis=0, tuning=CopyTuning(smem_chunk_bytes=4096)),
             wide, S((4, 2, 2, 4, 16, 128), jnp.bfloat16), S((4,), jnp.int32), S((4,), jnp.int32))
