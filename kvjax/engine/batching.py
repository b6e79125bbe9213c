"""Forward batches with bucketed static shapes, built from the ledger's block tables.

jit compiles one executable per input shape, so every dimension the serving loop varies is
rounded up to a power of two: rows (batch), tokens per row (chunk length; 1 for decode) and
block-table width (blocks). A steady state then reuses a handful of executables.

Row convention (the model's): a row holds the LAST `T` tokens of a sequence of `seq_len`
tokens, so a chunk shorter than `T` is left-padded; padded tokens write nowhere (slot -1).
Padding rows have `seq_len` 0 and null-slot tables.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from kvjax._math import ceil_div
from kvjax.device.buckets import bucket


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Smallest bucket per dimension (larger minimums: fewer shapes, more padding)."""

    min_batch: int = 1  # decode rows (prefill rows bucket from 1)
    min_chunk: int = 16
    min_blocks: int = 8
    prefill_rows: int = 4  # most prefill rows per forward (more rows: several forwards)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name} must be a positive int, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Row:
    """Tokens `tokens` of request `request_id` at positions `start .. start + len(tokens) - 1`."""

    request_id: Hashable
    tokens: Sequence[int]
    start: int

    @property
    def seq_len(self) -> int:
        return self.start + len(self.tokens)


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    tokens: np.ndarray  # int32 [B, T]
    positions: np.ndarray  # int32 [B, T]
    seq_lens: np.ndarray  # int32 [B]
    tables: dict[int, np.ndarray]  # window -> int32 [B, max_blocks] slots
    slots: dict[int, np.ndarray]  # window -> int32 [B * T] slot * tpb + offset, -1 = padding
    num_rows: int  # real rows (the first ones)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, T, max_blocks): what the compiled executable is specialised on."""
        b, t = self.tokens.shape
        return b, t, next(iter(self.tables.values())).shape[1]


def build_batch(ledger, rows: Sequence[Row], buckets: Buckets, *, chunk_bucket: int | None = None) -> ForwardBatch:
    """Bucketed forward inputs for `rows` (each request's blocks must already be allocated).

    `chunk_bucket` forces the token dimension (1 for decode: rows bucket from
    `buckets.min_batch`); by default it is the bucket of the longest row (prefill: rows
    bucket from 1).
    """
    if not rows:
        raise ValueError("build_batch needs at least one row")
    tpb = ledger.tokens_per_block
    n = len(rows)
    b = bucket(n, buckets.min_batch if chunk_bucket == 1 else 1)
    longest = max(len(r.tokens) for r in rows)
    t = bucket(longest, buckets.min_chunk) if chunk_bucket is None else chunk_bucket
    if t < longest:
        raise ValueError(f"chunk_bucket={t} is shorter than the longest row ({longest} tokens)")
    seq_lens = np.zeros((b,), np.int32)  # [B]
    seq_lens[:n] = [r.seq_len for r in rows]
    needed = ceil_div(int(seq_lens.max()), tpb)
    mb = bucket(needed, buckets.min_blocks)
    tokens = np.zeros((b, t), np.int32)  # [B, T]
    positions = seq_lens[:, None] - t + np.arange(t, dtype=np.int32)[None, :]  # [B, T]
    ids = [r.request_id for r in rows]
    tables: dict[int, np.ndarray] = {}
    slots: dict[int, np.ndarray] = {}
    for w in ledger.windows:
        null = ledger.config.primary_blocks_for(w)
        full = ledger.block_table(ids, w)  # [n, L] (every block the requests hold)
        table = np.full((b, mb), null, np.int32)  # [B, max_blocks]
        width = min(mb, full.shape[1])
        table[:n, :width] = full[:, :width]
        tables[w] = table
        sm = np.full((b, t), -1, np.int32)  # [B, T]
        for i, r in enumerate(rows):
            pos = np.arange(r.start, r.seq_len, dtype=np.int32)  # [len]
            index = np.minimum(pos // tpb, full.shape[1] - 1)  # [len]
            blocks = np.where(pos // tpb < full.shape[1], full[i, index], null)  # [len]
            if (blocks == null).any():  # the null slot must stay zero: new tokens need real blocks
                raise RuntimeError(f"request {r.request_id!r}: window {w} has no block for positions {pos.tolist()}")
            sm[i, t - len(pos):] = blocks * tpb + pos % tpb
        slots[w] = sm.reshape(-1)  # [B * T]
    for i, r in enumerate(rows):
        tokens[i, t - len(r.tokens):] = r.tokens
    return ForwardBatch(tokens, positions, seq_lens, tables, slots, n)


@dataclasses.dataclass(frozen=True)
class StepExtras:
    """What a forward computes besides the tokens, each a separate executable (a batch that
    asks for none of it runs the plain one).

    penalties: (output token counts int32 [rows, V], prompt tokens bool [rows, V], banned
      tokens bool [rows, V] (min_tokens), presence, frequency, repetition float32 [rows]):
      applied to the logits before sampling (`apply_penalties`).
    logprobs: the sampled tokens' raw logprobs -> results["logprobs"] = (logprob [rows],
      rank [rows], top ids [rows, 20], top logprobs [rows, 20]).
    prompt_targets: int32 [rows, T], the token after each position of the rows' chunks ->
      results["prompt_logprobs"] = the same four with [rows, T] in front.
    """

    penalties: tuple | None = None
    logprobs: bool = False
    prompt_targets: np.ndarray | None = None
