"""Forward batches with bucketed static shapes, built from the ledger's block tables.

jit compiles one executable per input shape, so every dimension the serving loop varies is
rounded up to a power of two. A step's ONE forward (`build_step` -> `StepBatch`) holds two row
groups: the decode rows `[Bd, 1]` and the prefill chunks `[Bp, T]`; its shape is
`StepShape(Bd, Bp, T, M)` (a group that is absent has 0 rows). `M`, the block-table width
shared by both groups and every window, is ONE per engine: the most blocks a sequence can hold
(`table_width`: ceil(max_seq_len / tokens_per_block)), not a compile dimension. The attention
loops over the live columns only (the XLA path's column loop and the Pallas kernels' block
loop are bounded by the rows' lengths), so a short row in a wide table costs what it costs in
a narrow one (docs/serving.md, "Step shapes"). `forward_shapes` lists every shape a serving
run can compile:

    Bd in {0} + powers of two from bucket(min_batch) to bucket(max_batch_size)
    Bp in {0} + powers of two from 1 to bucket(min(prefill_rows, max_batch_size))
    T  in powers of two from bucket(min_chunk) to bucket(max_num_tokens) (0 when Bp = 0)
    with Bp * T <= bucket(max_num_tokens): the prefill group never pads past the step's token
    budget (`prefill_fits`: the scheduler holds back a chunk that would break it)

minus the combinations no step can fill (no rows at all; more rows than `max_batch_size`, or
more tokens than `max_num_tokens`, than the smallest real content of such a bucket needs).
A steady state reuses a handful of them.

Row convention (the model's): a row holds the LAST `T` tokens of a sequence of `seq_len`
tokens, so a chunk shorter than `T` is left-padded; padded tokens write nowhere (slot -1).
Padding rows have `seq_len` 0 and null-slot tables. `build_batch` is the one-group batch of
`Transformer.paged_forward` (tests and tools); its table width is bucketed (`min_blocks`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvjax._math import ceil_div
from kvjax.device.buckets import bucket
from kvjax.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Smallest bucket per dimension (larger minimums: fewer shapes, more padding)."""

    min_batch: int = 1  # decode rows (prefill rows bucket from 1)
    min_chunk: int = 16
    min_blocks: int = 8  # table width of `build_batch` (an engine step's is `table_width`)
    prefill_rows: int = 4  # most prefill chunks per step (more candidates wait for a later step)

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


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What a step's forward returns to the host, one entry per real row (decode rows first,
    then prefill rows, in the order given to `build_step`): sampled tokens int32, the chosen
    token's logit and the top-2 margin float32, and what `StepExtras` asked for."""

    tokens: np.ndarray  # int32 [rows]
    chosen: np.ndarray  # float32 [rows]
    margins: np.ndarray  # float32 [rows]
    results: dict = dataclasses.field(default_factory=dict)


class StepShape(NamedTuple):
    """What a step's compiled program is specialised on: decode rows `Bd`, prefill rows `Bp`,
    prefill chunk `T` (0 without prefill rows) and block-table width `M`."""

    decode_rows: int
    prefill_rows: int
    chunk: int
    blocks: int

    @property
    def rows(self) -> int:
        """Sampled rows: one per row of either group."""
        return self.decode_rows + self.prefill_rows

    @property
    def tokens(self) -> int:
        """Tokens of the flat batch: one per decode row, `T` per prefill row."""
        return self.decode_rows + self.prefill_rows * self.chunk


#: columns of `StepBatch.rows` before the block tables
ROW_SEQ_LEN, ROW_TOP_K, ROW_SEED, ROW_INDEX, ROW_TABLES = 0, 1, 2, 3, 4
#: columns of `StepBatch.tokens` before the per-window slots
TOK_ID, TOK_POSITION, TOK_SLOTS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """The host inputs of one step's forward, packed into two int32 arrays (few transfers).

    rows: int32 [Bd + Bp, 4 + W * M]: seq_len, top_k, seed, output index (the runner fills the
      three sampling columns), then each window's block table (`windows` order), M columns each.
      Decode rows come first (row i), prefill rows after them (row Bd + j).
    tokens: int32 [Bd + Bp * T, 2 + W]: token id, position, then each window's slot
      (`slot * tokens_per_block + offset`, -1: padding) of every token of the flat batch: the
      decode rows' tokens, then the prefill rows' `T` columns each, row-major.
    """

    shape: StepShape
    windows: tuple[int, ...]
    rows: np.ndarray
    tokens: np.ndarray
    num_decode: int  # real decode rows (rows 0 .. num_decode - 1)
    num_prefill: int  # real prefill rows (rows Bd .. Bd + num_prefill - 1)

    @property
    def num_rows(self) -> int:
        return self.num_decode + self.num_prefill

    @property
    def real_rows(self) -> np.ndarray:
        """int [num_rows]: where each real row sits among the batch's `Bd + Bp` rows."""
        bd = self.shape.decode_rows
        return np.concatenate([np.arange(self.num_decode), bd + np.arange(self.num_prefill)])


@dataclasses.dataclass(frozen=True)
class TokenFeed:
    """Decode rows whose input token an earlier dispatch is still sampling: decode row i takes
    `tokens[index[i]]` (`tokens`: that dispatch's `PendingStep.tokens`, int32 [R'] on the
    device; `index` int32 [rows of the decode group], positions in it); -1 keeps the batch's
    own token."""

    tokens: Any
    index: np.ndarray

    def device_index(self, batch: StepBatch) -> np.ndarray:
        """int32 [Bd]: `index` padded to the batch's decode group (padding rows keep theirs)."""
        bd = batch.shape.decode_rows
        if self.index.ndim != 1 or len(self.index) > batch.num_decode:
            raise InvalidArgumentError(f"a feed of shape {self.index.shape} for {batch.num_decode} decode rows")
        out = np.full(bd, -1, np.int32)  # [Bd]
        out[: len(self.index)] = self.index
        return out


def _powers(lo: int, hi: int) -> list[int]:
    """Powers of two from bucket(lo) to bucket(max(lo, hi))."""
    out, b = [], bucket(lo)
    while b <= bucket(max(lo, hi)):
        out.append(b)
        b *= 2
    return out


def table_width(cache_config) -> int:
    """The block-table width `M` of every step of an engine on `cache_config`: the most blocks a
    sequence can hold, so one program serves every context length."""
    return ceil_div(cache_config.max_seq_len, cache_config.tokens_per_block)


def prefill_fits(rows: int, longest: int, buckets: Buckets, max_num_tokens: int) -> bool:
    """Whether `rows` prefill chunks, the longest `longest` tokens, make a prefill group the step
    may run: at most `buckets.prefill_rows` rows, and `[Bp, T]` (both bucketed) no more tokens
    than the bucketed token budget (a lone chunk always fits)."""
    if rows < 1 or longest < 1:
        raise ValueError(f"a prefill group has at least one row of at least one token, got {rows=}, {longest=}")
    cap = bucket(max_num_tokens, buckets.min_chunk)
    return rows <= buckets.prefill_rows and bucket(rows) * bucket(longest, buckets.min_chunk) <= cap


def forward_shapes(engine_config, cache_config) -> list[StepShape]:
    """Every `StepShape` a serving run with these settings can compile (see the module
    docstring), smallest first. Its length is the number of forward programs (per `StepExtras`
    variant) a full warmup compiles; `padding_step` builds a batch of any of them."""
    b, s = engine_config.buckets, engine_config.scheduler
    max_rows, max_tokens = s.max_batch_size, s.max_num_tokens

    def fewest(size: int, smallest: int) -> int:  # the fewest real items that round up to `size`
        return 1 if size <= smallest else size // 2 + 1

    decode = [0] + _powers(b.min_batch, max_rows)
    prefill = [(0, 0)] + [(r, t) for r in _powers(1, min(b.prefill_rows, max_rows))
                          for t in _powers(b.min_chunk, max_tokens)
                          if prefill_fits(fewest(r, 1), fewest(t, bucket(b.min_chunk)), b, max_tokens)]
    m = table_width(cache_config)
    out: list[StepShape] = []
    for bd in decode:
        nd = fewest(bd, bucket(b.min_batch)) if bd else 0
        for bp, t in prefill:
            if bd == 0 and bp == 0:
                continue
            np_ = fewest(bp, 1) if bp else 0
            longest = fewest(t, bucket(b.min_chunk)) if bp else 0  # one row that long, the others 1 token
            if nd + np_ > max_rows or nd + longest + max(np_ - 1, 0) > max_tokens:
                continue
            out.append(StepShape(bd, bp, t, m))
    return sorted(out)


def padding_step(shape: StepShape, cache_config) -> StepBatch:
    """An all-padding batch of `shape` (no real row: nothing is written, every output is
    ignored) for `cache_config`'s windows: it compiles and runs the same program as a real step
    of that shape (a warmup)."""
    windows = tuple(cache_config.windows)
    bd, bp, t, m = shape
    if min(shape) < 0 or bd + bp < 1 or (bp > 0) != (t > 0) or m < 1:
        raise ValueError(f"not a step shape: {shape}")
    rows = np.zeros((shape.rows, ROW_TABLES + len(windows) * m), np.int32)  # [R, 4 + W * M]
    for i, w in enumerate(windows):
        rows[:, ROW_TABLES + i * m : ROW_TABLES + (i + 1) * m] = cache_config.primary_blocks_for(w)
    tokens = np.full((shape.tokens, TOK_SLOTS + len(windows)), -1, np.int32)  # [N, 2 + W]
    tokens[:, TOK_ID] = 0
    tokens[:, TOK_POSITION] = _group_positions(np.zeros(shape.rows, np.int32), shape)
    return StepBatch(shape, windows, rows, tokens, 0, 0)


def _group_positions(seq_lens: np.ndarray, shape: StepShape) -> np.ndarray:
    """int32 [N]: every token's position, padding included (rows hold their last positions)."""
    bd, bp, t, _ = shape
    decode = seq_lens[:bd] - 1  # [Bd]
    prefill = seq_lens[bd:, None] - t + np.arange(t, dtype=np.int32)[None, :]  # [Bp, T]
    return np.concatenate([decode, prefill.reshape(-1)]).astype(np.int32)


def build_step(ledger, decode: Sequence[Row], prefill: Sequence[Row], buckets: Buckets,
               windows: Sequence[int] | None = None) -> StepBatch:
    """The one forward of a step: `decode` rows (one token each) and `prefill` chunks (at
    most `buckets.prefill_rows`), bucketed (see the module docstring). Every request's blocks
    must already be allocated. Raises ValueError for rows the step cannot hold and
    RuntimeError when a new token has no block. `windows` (default: the ledger's): the
    attention windows to lay out (a hybrid model's recurrent window has no tables or slots)."""
    nd, npf = len(decode), len(prefill)
    if nd + npf == 0:
        raise ValueError("build_step needs at least one row")
    if any(len(r.tokens) != 1 for r in decode):
        raise ValueError(f"decode rows hold one token each, got {[len(r.tokens) for r in decode]}")
    if any(len(r.tokens) < 1 for r in prefill):
        raise ValueError("prefill rows hold at least one token")
    if npf > buckets.prefill_rows:
        raise ValueError(f"{npf} prefill rows exceed prefill_rows={buckets.prefill_rows}")
    tpb = ledger.tokens_per_block
    rows = [*decode, *prefill]
    lens = np.array([len(r.tokens) for r in rows], np.int64)  # [n]
    seq = np.array([r.seq_len for r in rows], np.int32)  # [n]
    bd = bucket(nd, buckets.min_batch) if nd else 0
    bp = bucket(npf) if npf else 0
    t = bucket(int(lens[nd:].max()), buckets.min_chunk) if npf else 0
    m = table_width(ledger.config)  # one width per engine (module docstring)
    shape = StepShape(bd, bp, t, m)
    windows = tuple(ledger.windows if windows is None else windows)
    place = np.concatenate([np.arange(nd), bd + np.arange(npf)])  # [n] each real row's row
    seq_lens = np.zeros(shape.rows, np.int32)  # [R]
    seq_lens[place] = seq
    # the real tokens: their place in the flat batch, their row (0 .. n-1) and position
    row_of = np.repeat(np.arange(len(rows)), lens)  # [real tokens]
    ends = np.cumsum(lens)
    within = np.arange(int(ends[-1])) - np.repeat(ends - lens, lens)  # index inside its row's chunk
    pos = (np.repeat(seq.astype(np.int64) - lens, lens) + within).astype(np.int32)  # [real tokens]
    flat = np.where(row_of < nd, row_of, bd + (row_of - nd) * t + (t - np.repeat(lens, lens)) + within)
    out_rows = np.zeros((shape.rows, ROW_TABLES + len(windows) * m), np.int32)  # [R, 4 + W * M]
    out_rows[:, ROW_SEQ_LEN] = seq_lens
    tokens = np.full((shape.tokens, TOK_SLOTS + len(windows)), -1, np.int32)  # [N, 2 + W]
    tokens[:, TOK_ID] = 0
    tokens[flat, TOK_ID] = [x for r in rows for x in r.tokens]
    tokens[:, TOK_POSITION] = _group_positions(seq_lens, shape)
    ids = [r.request_id for r in rows]
    for i, w in enumerate(windows):
        null = ledger.config.primary_blocks_for(w)
        full = ledger.block_table(ids, w)  # [n, L]: every block the requests hold
        cols = slice(ROW_TABLES + i * m, ROW_TABLES + (i + 1) * m)
        out_rows[:, cols] = null
        width = min(m, full.shape[1])
        out_rows[place, cols.start : cols.start + width] = full[:, :width]
        index = pos // tpb  # [real tokens]
        have = index < full.shape[1]
        blocks = np.where(have, full[row_of, np.minimum(index, full.shape[1] - 1)], null)  # [real tokens]
        bad = (blocks == null) | (blocks < 0)
        if bad.any():  # the null slot must stay zero: new tokens need real blocks
            k = int(np.argmax(bad))
            raise RuntimeError(f"request {ids[row_of[k]]!r}: window {w} has no block for position {int(pos[k])}")
        tokens[flat, TOK_SLOTS + i] = blocks * tpb + pos % tpb
    return StepBatch(shape, windows, out_rows, tokens, nd, npf)
