"""`Transformer.paged_hidden`: a decode group and a prefill group in one pass over the weights
give the dense oracle's logits at every row's last position, and `paged_forward` (one group)
is the same computation."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.device import allocate_pools
from kvjax.models import RowGroup, Transformer, jit_dense_forward

TPB = 8
MAX_SEQ_LEN = 64  # 8 blocks per table
ATOL = 1e-4


@pytest.fixture(scope="module", params=["micro", "micro-swa"])
def setup(request):
    model = Transformer.from_spec(request.param, seed=5)
    config = model.spec.cache_config(primary_blocks=40, tokens_per_block=TPB, max_seq_len=MAX_SEQ_LEN)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, model.spec.vocab_size, n).tolist() for n in (14, 9, 20)]
    return model, config, sequences, jit_dense_forward(model)


def _group_inputs(config, sequences, rows, q_len, starts, ends):
    """Flat tokens / positions / slots and per-window tables of one group: row i holds positions
    starts[i] .. ends[i] - 1 of sequence rows[i], right-aligned in q_len columns (row r's blocks
    are 8r .. 8r + 7: contiguous)."""
    n = len(rows)
    tokens = np.zeros((n, q_len), np.int32)  # [rows, T]
    seq_lens = np.array(ends, np.int32)  # [rows]
    positions = seq_lens[:, None] - q_len + np.arange(q_len, dtype=np.int32)[None, :]  # [rows, T]
    slots = np.full((n, q_len), -1, np.int32)  # [rows, T]
    for i, (r, s, e) in enumerate(zip(rows, starts, ends, strict=True)):
        tokens[i, q_len - (e - s):] = sequences[r][s:e]
        slots[i, q_len - (e - s):] = 8 * r * TPB + np.arange(s, e)
    table = np.array([[8 * r + j for j in range(MAX_SEQ_LEN // TPB)] for r in rows], np.int32)  # [rows, 8]
    windows = config.windows
    return (tokens.reshape(-1), positions.reshape(-1), {w: slots.reshape(-1) for w in windows},
            RowGroup(n, q_len, {w: jnp.asarray(table) for w in windows}, jnp.asarray(seq_lens)))


def _concat(*parts):
    toks = np.concatenate([p[0] for p in parts])
    pos = np.concatenate([p[1] for p in parts])
    slots = {w: np.concatenate([p[2][w] for p in parts]) for w in parts[0][2]}
    return toks, pos, slots, tuple(p[3] for p in parts)


@functools.partial(jax.jit, static_argnames=("graphdef", "shapes"))
@chex.assert_max_traces(n=4)  # two group layouts for each of the two models
def _hidden(state, pools, toks, pos, tables, lens, slots, *, graphdef, shapes):
    groups = [RowGroup(r, q, tb, ln) for (r, q), tb, ln in zip(shapes, tables, lens, strict=True)]
    return nnx.merge(graphdef, state).paged_hidden(toks, pos, pools, groups, slots)


@pytest.mark.parametrize("jitted", [True, False])
def test_decode_and_prefill_groups_in_one_pass_match_dense(setup, jitted):
    model, config, sequences, dense = setup

    if jitted:
        graphdef, state = nnx.split(model)

        def fn(pools, toks, pos, groups, slots):
            shapes = tuple((g.rows, g.q_len) for g in groups)
            return _hidden(state, pools, toks, pos, [g.block_tables for g in groups], [g.seq_lens for g in groups],
                           slots, graphdef=graphdef, shapes=shapes)
    else:
        def fn(pools, toks, pos, groups, slots):
            return model.paged_hidden(toks, pos, pools, groups, slots)

    pools = allocate_pools(config)
    # step 1: one prefill group: sequence 0's first 13 tokens, sequence 2's first 12
    toks, pos, slots, groups = _concat(_group_inputs(config, sequences, [0, 2], 16, [0, 0], [13, 12]))
    hidden, pools = fn(pools, toks, pos, groups, slots)
    chex.assert_shape(hidden, (32, model.spec.hidden_size))
    # step 2: decode group [2, 1] (sequence 0's 14th token, one padding row) + prefill group
    # [2, 16] (sequence 1's whole prompt, sequence 2's tokens 12..19 after its cached ones)
    decode = _group_inputs(config, sequences, [0], 1, [13], [14])
    pad = (np.zeros(1, np.int32), np.full(1, -1, np.int32), {w: np.full(1, -1, np.int32) for w in config.windows},
           None)
    d_toks, d_pos, d_slots = (np.concatenate([decode[0], pad[0]]), np.concatenate([decode[1], pad[1]]),
                              {w: np.concatenate([decode[2][w], pad[2][w]]) for w in config.windows})
    null = config.primary_blocks_for(config.windows[0])
    d_group = RowGroup(2, 1, {w: jnp.concatenate([decode[3].block_tables[w], jnp.full((1, 8), null, jnp.int32)])
                              for w in config.windows}, jnp.asarray([14, 0], jnp.int32))
    prefill = _group_inputs(config, sequences, [1, 2], 16, [0, 12], [9, 20])
    toks, pos, slots, groups = _concat((d_toks, d_pos, d_slots, d_group), prefill)
    hidden, pools = fn(pools, toks, pos, groups, slots)
    chex.assert_shape(hidden, (2 + 32, model.spec.hidden_size))
    last = jnp.asarray([0, 2 + 15, 2 + 31])  # sequence 0's decode row, the prefill rows' last columns
    got = model.logits(hidden[last])  # [3, V]
    chex.assert_shape(got, (3, model.spec.vocab_size))
    # the oracle: one dense call over the sequences right-padded to 20 (causal: padding after a
    # position does not change its logits), each read at its last real position
    padded = jnp.asarray([q + [0] * (20 - len(q)) for q in sequences], jnp.int32)  # [3, 20]
    want = dense(padded)[jnp.arange(3), jnp.asarray([len(q) - 1 for q in sequences])]  # [3, V]
    chex.assert_trees_all_close(got, want, atol=ATOL)
    chex.assert_tree_all_finite(hidden[1])  # the padding decode row attends to nothing: zeros, not NaN


def test_paged_forward_is_one_group(setup):
    """`paged_forward` = `paged_hidden` with one group + the LM head on every position."""
    model, config, sequences, _ = setup
    toks, pos, slots, groups = _concat(_group_inputs(config, sequences, [0, 1], 16, [0, 0], [14, 9]))
    logits, _ = model.paged_forward(toks.reshape(2, 16), pos.reshape(2, 16), allocate_pools(config),
                                    groups[0].block_tables, groups[0].seq_lens, slots)
    hidden, _ = model.paged_hidden(toks, pos, allocate_pools(config), groups, slots)
    chex.assert_shape(logits, (2, 16, model.spec.vocab_size))
    chex.assert_trees_all_close(logits.reshape(32, -1), model.logits(hidden), atol=1e-6)


def test_groups_must_cover_the_tokens(setup):
    model, config, sequences, _ = setup
    toks, pos, slots, groups = _concat(_group_inputs(config, sequences, [0], 16, [0], [14]))
    with pytest.raises(ValueError, match="do not cover"):
        model.paged_hidden(toks[:8], pos[:8], allocate_pools(config), groups, {w: s[:8] for w, s in slots.items()})
