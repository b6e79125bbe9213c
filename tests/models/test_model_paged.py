"""The paged forward (write_kv + paged_attention per layer) gives the dense oracle's logits.

A tiny hand-written slot allocator plays the ledger: each window hands out shuffled slots as
sequences grow, and (like the ledger's placeholders) points sliding-window blocks that fell
fully out of the window to the null slot, after scribbling over their old slot.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.device import allocate_pools
from kvjax.models import Transformer, dense_greedy, jit_dense_forward, jit_paged_forward

TPB = 8
MAX_SEQ_LEN = 256  # cache geometry: 32 blocks per table
ATOL = 1e-4


@pytest.fixture(autouse=True)
def strict_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield


class SlotLayout:
    """Per window: a shuffled free list of slots and each sequence's block list."""

    def __init__(self, config, batch: int, seed: int):
        self.config = config
        rng = np.random.default_rng(seed)
        self.free = {w: list(rng.permutation(config.primary_blocks_for(w))) for w in config.windows}
        self.blocks = {w: [[] for _ in range(batch)] for w in config.windows}
        self.null = {w: config.primary_blocks_for(w) for w in config.windows}
        self.max_blocks = config.max_blocks_per_seq

    def slot_of(self, window: int, row: int, pos: int) -> int:
        blocks = self.blocks[window][row]
        while len(blocks) <= pos // TPB:
            blocks.append(int(self.free[window].pop()))
        return blocks[pos // TPB] * TPB + pos % TPB

    def table(self, window: int, row: int, first_query_pos: int) -> list[int]:
        """Block table row; blocks whose every token is out of the window of the first query are null."""
        table = []
        for i, slot in enumerate(self.blocks[window][row]):
            out_of_window = (i + 1) * TPB - 1 <= first_query_pos - window
            table.append(self.null[window] if out_of_window else slot)
        return table + [self.null[window]] * (self.max_blocks - len(table))


def run_schedule(model, config, sequences, schedule, seed=0, fwd=None, greedy_from=None):
    """Feed `sequences` through the paged forward; `schedule` is a list of (q_len, new tokens per row).

    Returns {(row, position): logits} of every real query. With `greedy_from` (prompt length per
    row), tokens past the prompt are not read from `sequences` but appended greedily (argmax).
    """
    fwd = fwd or jit_paged_forward(model)
    pools = allocate_pools(config)
    batch = len(sequences)
    layout = SlotLayout(config, batch, seed)
    done = [0] * batch
    out = {}
    for q_len, counts in schedule:
        seq_lens = np.array([done[b] + counts[b] for b in range(batch)], np.int32)
        tokens = np.zeros((batch, q_len), np.int32)
        positions = seq_lens[:, None] - q_len + np.arange(q_len, dtype=np.int32)[None, :]  # [B, T]
        slots = {w: np.full((batch, q_len), -1, np.int32) for w in config.windows}
        for b in range(batch):
            for i in range(q_len - counts[b], q_len):
                pos = int(positions[b, i])
                tokens[b, i] = sequences[b][pos]
                for w in config.windows:
                    slots[w][b, i] = layout.slot_of(w, b, pos)
        tables = {
            w: np.array([layout.table(w, b, int(seq_lens[b]) - q_len) for b in range(batch)], np.int32)
            for w in config.windows
        }
        logits, pools = fwd(
            jnp.asarray(tokens),
            jnp.asarray(positions),
            pools,
            {w: jnp.asarray(t) for w, t in tables.items()},
            jnp.asarray(seq_lens),
            {w: jnp.asarray(s.reshape(-1)) for w, s in slots.items()},
        )
        # null slots that replaced out-of-window blocks must never be read: poison the freed slots
        pools = _poison_out_of_window(pools, layout, tables)
        logits = np.asarray(logits)
        for b in range(batch):
            for i in range(q_len - counts[b], q_len):
                pos = int(positions[b, i])
                out[(b, pos)] = logits[b, i]
                if greedy_from is not None and pos + 1 >= greedy_from[b] and len(sequences[b]) == pos + 1:
                    sequences[b].append(int(np.argmax(logits[b, i])))
        done = [int(x) for x in seq_lens]
    return out


def _poison_out_of_window(pools, layout, tables):
    config = pools.config
    primary = list(pools.primary)
    for w, table in tables.items():
        stale = {s for row in layout.blocks[w] for s in row} - {int(s) for s in table.reshape(-1)}
        if not stale:
            continue
        for index in config.window_pools[w]:
            primary[index] = primary[index].at[np.array(sorted(stale))].set(1e4)
    return pools.replace(primary=tuple(primary))


def check_against_dense(model, sequences, got):
    fwd = jit_dense_forward(model)
    length = max(len(s) for s in sequences)
    tokens = np.zeros((len(sequences), length), np.int32)
    for b, s in enumerate(sequences):
        tokens[b, : len(s)] = s  # right padding cannot change earlier positions (causal)
    dense = np.asarray(fwd(jnp.asarray(tokens)))
    assert len(got) == sum(len(s) for s in sequences)
    worst = max(float(np.abs(v - dense[b, p]).max()) for (b, p), v in got.items())
    assert worst < ATOL, f"paged vs dense max |diff| = {worst}"
    for (b, p), v in got.items():
        assert np.argmax(v) == np.argmax(dense[b, p])


# prompt lengths 37, 20, 90; three prefill chunks of 32 (row 1 left-padded past position 0,
# rows idle in later chunks), then 4 decode steps: 41 + 24 + 94 queries in all
SCHEDULE = [
    (32, [32, 20, 32]),
    (32, [5, 0, 32]),
    (32, [0, 0, 26]),
] + [(1, [1, 1, 1])] * 4


def _sequences(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in (41, 24, 94)]


@pytest.mark.parametrize("name", ["tiny", "tiny-swa"])
def test_chunked_prefill_then_decode_matches_dense(name):
    model = Transformer.from_spec(name, seed=0)
    config = model.spec.cache_config(primary_blocks=48, tokens_per_block=TPB, max_seq_len=MAX_SEQ_LEN)
    if name == "tiny-swa":
        assert config.windows == (64, 256)  # two pools, two block tables, SWA placeholders exercised
    sequences = _sequences(model.spec.vocab_size, seed=1)
    got = run_schedule(model, config, sequences, SCHEDULE, seed=2)
    check_against_dense(model, sequences, got)


@pytest.fixture(scope="module")
def swa():
    model = Transformer.from_spec("tiny-swa", seed=3)
    config = model.spec.cache_config(primary_blocks=40, tokens_per_block=TPB, max_seq_len=MAX_SEQ_LEN)
    return model, config, jit_paged_forward(model)


# a 4-row bucket with an empty row (seq_len 0), prefill in one chunk of 128, then 3 decode steps
ONE_SHOT = [(128, [67, 30, 0, 1])] + [(1, [1, 1, 0, 1])] * 3


def test_one_shot_prefill_and_padding_rows(swa):
    model, config, fwd = swa
    rng = np.random.default_rng(4)
    sequences = [rng.integers(0, 4096, n).tolist() for n in (70, 33, 0, 4)]
    got = run_schedule(model, config, sequences, ONE_SHOT, seed=5, fwd=fwd)
    check_against_dense(model, sequences, got)


def test_paged_greedy_decode_matches_dense_greedy(swa):
    model, config, fwd = swa
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 4096, n).tolist() for n in (67, 30, 0, 1)]
    sequences = [list(p) for p in prompts]
    run_schedule(model, config, sequences, ONE_SHOT, seed=7, fwd=fwd, greedy_from=[len(p) for p in prompts])
    generated = [s[len(p):] for s, p in zip(sequences, prompts, strict=True)]
    assert [len(g) for g in generated] == [4, 4, 0, 4]
    expected = dense_greedy(model, [prompts[0], prompts[1], prompts[3]], 4)
    assert [generated[0], generated[1], generated[3]] == expected


def test_paged_forward_rejects_a_foreign_cache():
    model = Transformer.from_spec("tiny", seed=0)
    other = dataclasses.replace(model.spec, num_kv_heads=4)
    pools = allocate_pools(other.cache_config(primary_blocks=4, tokens_per_block=TPB, max_seq_len=128))
    z = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="kv heads"):
        model.paged_forward(z, z, pools, jnp.zeros((1, 16), jnp.int32), jnp.ones((1,), jnp.int32),
                            jnp.zeros((1,), jnp.int32))
    swa_pools = allocate_pools(
        Transformer.from_spec("tiny-swa").spec.cache_config(primary_blocks=4, tokens_per_block=TPB, max_seq_len=128)
    )
    with pytest.raises(ValueError, match="layer windows"):
        model.paged_forward(z, z, swa_pools, jnp.zeros((1, 16), jnp.int32), jnp.ones((1,), jnp.int32),
                            jnp.zeros((1,), jnp.int32))
