"""Step-input helpers: hand-checked conventions, equality with the engine's own batch
builder on real ledger tables (multi-window, sliding-window placeholders), bad inputs, and a
decode loop built with them that matches dense attention."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_helpers import make_config

from kvjax import CacheConfig, KVCacheManager, Request
from kvjax.device import allocate_pools, dense_attention, gather_kv, paged_attention, slots_for_positions, step_inputs, write_kv
from kvjax.engine import Buckets, Row, build_batch

TPB = 4


def test_conventions_by_hand():
    cfg = make_config(attention_windows=None, primary_blocks=8)  # null slot 8
    table = np.array([[5, 2, 7], [1, -1, 8]])  # row 1: a placeholder and the null slot
    s = step_inputs(cfg, table, seq_lens=[10, 3], chunk_lens=[3, 2], batch=4)
    assert s.shape == (4, 4, 4) and s.num_rows == 2
    np.testing.assert_array_equal(s.seq_lens, [10, 3, 0, 0])
    np.testing.assert_array_equal(s.positions[0], [6, 7, 8, 9])
    np.testing.assert_array_equal(s.positions[2], [-4, -3, -2, -1])  # padding rows: negative
    np.testing.assert_array_equal(s.block_table, [[5, 2, 7, 8], [1, 8, 8, 8], [8] * 4, [8] * 4])
    sm = s.slots.reshape(4, 4)
    np.testing.assert_array_equal(sm[0], [-1, 2 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1])  # positions 7, 8, 9
    np.testing.assert_array_equal(sm[1], [-1, -1, 1 * 4 + 1, 1 * 4 + 2])  # positions 1, 2
    assert (sm[2:] == -1).all()
    assert s.slots.dtype == s.block_table.dtype == s.positions.dtype == np.int32


def test_matches_the_engine_batch_builder():
    """On a real ledger (two windows, one sliding: placeholders appear) the helper builds
    exactly the engine's ForwardBatch arrays, for prefill chunks and decode steps."""
    cfg = CacheConfig(tokens_per_block=TPB, num_layers=2, num_kv_heads=1, head_dim=4, max_seq_len=64,
                      attention_windows=(8, 64), primary_blocks=32)
    led = KVCacheManager(cfg)
    led.add_sequence(Request("a", list(range(1, 22)), max_new_tokens=4))
    led.add_sequence(Request("b", list(range(50, 56)), max_new_tokens=4))
    for tok in range(3):
        led.add_token("a", 100 + tok)
    rows = [Row("a", [5, 6, 7], 21), Row("b", list(range(50, 56)), 0)]
    for chunk_bucket, buckets in ((None, Buckets(min_batch=1, min_chunk=4, min_blocks=2)),
                                  (None, Buckets(min_chunk=8, min_blocks=16))):
        want = build_batch(led, rows, buckets, chunk_bucket=chunk_bucket)
        b, t, m = want.shape
        tables = {w: led.block_table(["a", "b"], w) for w in led.windows}
        got = step_inputs(cfg, tables, [r.seq_len for r in rows], [len(r.tokens) for r in rows], batch=b, q_len=t,
                          max_blocks=m)
        np.testing.assert_array_equal(got.positions, want.positions)
        np.testing.assert_array_equal(got.seq_lens, want.seq_lens)
        for w in led.windows:
            np.testing.assert_array_equal(got.block_tables[w], want.tables[w])
            np.testing.assert_array_equal(got.slot_mapping[w], want.slots[w])
    decode = [Row("a", [7], 23), Row("b", [55], 5)]
    want = build_batch(led, decode, Buckets(min_batch=4, min_blocks=16), chunk_bucket=1)
    got = step_inputs(cfg, {w: led.block_table(["a", "b"], w) for w in led.windows}, [24, 6], [1, 1], batch=4, q_len=1,
                      max_blocks=16)
    for w in led.windows:
        np.testing.assert_array_equal(got.slot_mapping[w], want.slots[w])
        np.testing.assert_array_equal(got.block_tables[w], want.tables[w])


def test_bad_inputs():
    cfg = make_config(attention_windows=None, primary_blocks=8)
    table = np.array([[5, 2, 8]])
    with pytest.raises(ValueError, match="no block for new position 8"):
        step_inputs(cfg, table, [9], [2])  # position 8 sits in the null slot
    with pytest.raises(ValueError, match="no block for new position 12"):
        step_inputs(cfg, table, [13], [1])  # past the table
    with pytest.raises(ValueError, match="chunk_lens"):
        step_inputs(cfg, table, [3], [4])
    with pytest.raises(ValueError, match="entries > the null slot"):
        step_inputs(cfg, np.array([[9]]), [1], [1])
    with pytest.raises(ValueError, match="q_len"):
        step_inputs(cfg, table, [5], [5], q_len=4)
    with pytest.raises(ValueError, match="max_blocks=1"):
        step_inputs(cfg, np.array([[1, 2, 3]]), [5], [1], max_blocks=1)
    # blocks held past what the step reaches (positions >= seq_len) are simply not in the table
    np.testing.assert_array_equal(step_inputs(cfg, np.array([[1, 2, 3]]), [2], [1]).block_table, [[1]])
    with pytest.raises(ValueError, match="integer"):
        step_inputs(cfg, table, [1.5], [1])
    with pytest.raises(ValueError, match="windows"):
        step_inputs(make_config(primary_blocks=8), table, [3], [1])  # two windows need a dict


def test_decode_loop_built_with_the_helpers_matches_dense_attention():
    """Prefill chunk then decode steps for 3 ragged requests through write_kv and
    paged_attention, inputs from step_inputs; every real query equals dense attention over
    the request's K/V written so far."""
    cfg = make_config(num_layers=1, attention_windows=None, primary_blocks=16, num_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(0)
    table = rng.permutation(16)[:12].reshape(3, 4)
    prompt = np.array([5, 9, 2])
    k_all = rng.standard_normal((3, 16, 2, 8)).astype(np.float32)
    pools = allocate_pools(cfg)
    seq, chunk = prompt.copy(), prompt.copy()
    for _step in range(4):
        s = step_inputs(cfg, table, seq, chunk)
        b, t, _ = s.shape
        k = np.zeros((b, t, 2, 8), np.float32)
        for r in range(3):
            k[r, t - chunk[r]:] = k_all[r, seq[r] - chunk[r]: seq[r]]
        pools = write_kv(pools, 0, k.reshape(-1, 2, 8), -k.reshape(-1, 2, 8), s.slots)
        q = jnp.asarray(rng.standard_normal((b, t, 4, 8)), jnp.float32)
        out = paged_attention(q, pools, 0, s.block_table, s.seq_lens)
        kk = jnp.asarray(np.pad(k_all, ((0, b - 3), (0, 0), (0, 0), (0, 0))))
        want = dense_attention(q, kk, -kk, jnp.asarray(s.seq_lens), scale=8 ** -0.5, window=cfg.max_seq_len)
        for r in range(3):
            chex.assert_trees_all_close(out[r, t - chunk[r]:], want[r, t - chunk[r]:], atol=1e-5)
        assert not np.asarray(out[3:]).any()  # padding rows attend to nothing
        seq, chunk = seq + 1, np.ones(3, int)
    g, _ = gather_kv(pools, 0, table, seq - 1)
    np.testing.assert_array_equal(np.asarray(g[0, : seq[0] - 1]), k_all[0, : seq[0] - 1])


def test_device_slots_match_the_host_helper():
    cfg = make_config(attention_windows=None, primary_blocks=8)
    table = np.array([[5, 2, 7], [1, 3, 8]])
    s = step_inputs(cfg, table, [10, 6], [3, 2], batch=2)
    write = s.slots.reshape(s.positions.shape) >= 0
    got = jax.jit(slots_for_positions, static_argnames=("tokens_per_block", "num_slots"))(
        jnp.asarray(s.block_table), jnp.asarray(s.positions), jnp.asarray(write), tokens_per_block=TPB, num_slots=9)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), s.slots)
