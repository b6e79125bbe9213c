"""`LiveSequences`: the ledger's state per live request, in one object with one owner.

The live `TrackedSequence`s by id, where each keeps its tokens (a Python list, filed in
`listed`, or a row of the `TokenStore`), the last `add_tokens` batch's store rows
(`DecodeBatch`), the last block-table id list's slot rows per window, and what is still valid
after a failed transfer (`kv_valid`). The facade (`KVCacheManager`) builds it and hands it,
with the owners of blocks (`BlockManager`), to the modules that need it: admission, the batched
decode step, the scheduler queries, failed transfers, integrity checks. Nothing here decides
blocks: admission, growth and release are the block manager's.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from kvjax.errors import InvalidRequestError, UnknownRequestError
from kvjax.ledger.packing import int_array, same_ids
from kvjax.ledger.sequence import TrackedSequence
from kvjax.ledger.token_store import TokenStore
from kvjax.ledger.validation import check_table_ids

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.window_manager import WindowBlockManager


class DecodeBatch:
    """One `add_tokens` id list (distinct, live) and its rows of the token store."""

    __slots__ = ("ids", "rows")

    def __init__(self, ids: list | tuple, rows: np.ndarray) -> None:
        self.ids = ids
        self.rows = rows  # [n]
        rows.flags.writeable = False


class LiveSequences:
    """Every live sequence and where its tokens and table rows are (see the module docstring).

    `seqs` and `tok` are never rebound: the facade keeps them as its own names for the
    lock-free `add_token` path."""

    __slots__ = ("bm", "seqs", "listed", "tok", "new_in_store", "batch", "table_rows", "kv_valid", "pending")

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm  # for `fast_limit`, a function of the sequence's blocks
        self.seqs: dict[Hashable, TrackedSequence] = {}
        # the tokens of the sequences a batched step grew, as columns (`TokenStore`); the
        # others keep theirs as a list, and are filed in `listed` (the next batched step moves them)
        self.tok = TokenStore()
        self.listed: dict[Hashable, TrackedSequence] = {}
        # where admission puts a new sequence's tokens: in the store once a batched step ran
        # (the sequence would move there at its first step anyway), back in a list once a
        # single `add_token` found its sequence in the store
        self.new_in_store = False
        # the last `add_tokens` batch (see `DecodeBatch`), dropped whenever a sequence leaves
        self.batch: DecodeBatch | None = None
        self.table_rows: dict[int, tuple[Sequence[Hashable], int, np.ndarray]] = {}  # window index -> last ids, epoch, rows
        self.kv_valid: dict[Hashable, int] = {}  # request -> valid KV length after a failed transfer
        self.pending: dict[Hashable, int] = {}  # request -> position of its pending token (`pending_tokens`)

    # ------------------------------------------------------------------ lookups
    def get(self, request_id: Hashable) -> TrackedSequence:
        try:
            return self.seqs[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request id {request_id!r}") from None

    def of(self, request_ids: Sequence[Hashable]) -> list[TrackedSequence]:
        """The live sequences of `request_ids`, in order (`UnknownRequestError` for the first
        id that is not live)."""
        seqs = self.seqs
        try:
            return [seqs[r] for r in request_ids]
        except (KeyError, TypeError):
            return [self.get(r) for r in request_ids]

    def distinct(self, ids: list | tuple) -> list[TrackedSequence] | None:
        """The live sequences of `ids`, in order; None when an id is unknown, unhashable or repeated."""
        live = self.seqs
        try:
            seqs = [live[r] for r in ids]
        except (KeyError, TypeError):
            return None
        return seqs if len(set(ids)) == len(ids) else None

    # ------------------------------------------------------------------ joining and leaving
    def add(self, seq: TrackedSequence) -> None:
        """File a sequence admission just committed (tokens in a list or straight in the store)."""
        if self.new_in_store:  # straight into the token store, while its cache lines are warm
            seq.to_store()
        else:
            self.listed[seq.request_id] = seq
        self.set_limit(seq)
        self.seqs[seq.request_id] = seq

    def remove(self, seq: TrackedSequence) -> None:
        """A sequence whose blocks were released leaves: its table rows and token row go back."""
        rid = seq.request_id
        self.batch = None  # it may hold this sequence, whose token row goes back now
        for wm in self.bm.windows:
            wm.slot_table.release(seq.windows[wm.index])
        seq.release()
        self.listed.pop(rid, None)
        del self.seqs[rid]
        self.kv_valid.pop(rid, None)
        self.pending.pop(rid, None)

    # ------------------------------------------------------------------ where the tokens are
    def to_list(self, seq: TrackedSequence) -> None:
        """A single `add_token` found the sequence's tokens in the store: back to a list."""
        seq.to_list()
        self.listed[seq.request_id] = seq
        self.batch = None  # it holds the sequence's row
        self.new_in_store = False

    def move_to_store(self, ids: list | tuple) -> bool:
        """Move the token lists of `ids`' sequences into the token store
        (`TrackedSequence.to_store`): the batched paths read and write the store's columns only.
        False, with nothing moved, when an id is unknown, unhashable or repeated."""
        seqs = self.distinct(ids)
        if seqs is None:
            return False
        listed = self.listed
        for seq in seqs:
            if seq.tokens is not None:
                seq.to_store()
                del listed[seq.request_id]
        return True

    def set_limit(self, seq: TrackedSequence) -> None:
        """File the sequence's limit (`BlockManager.fast_limit`: `add_token` only appends
        below it) with its tokens, list or store row; called after every change to its
        blocks, windows or tokens on a locked path. A sequence whose newest token is pending
        gets 0: its next token takes the checked path, which refuses it (`pending_tokens`)."""
        limit = 0 if self.pending and seq.request_id in self.pending else self.bm.fast_limit(seq)
        if seq.tokens is not None:
            seq.limit = limit
        else:
            self.tok.set_limit(seq.row, limit)

    def truncated(self, seq: TrackedSequence) -> None:
        """A rewind kept the first `num_tokens` tokens: a pending token past them is gone."""
        at = self.pending.get(seq.request_id) if self.pending else None
        if at is not None and at >= seq.num_tokens:
            del self.pending[seq.request_id]

    def limit_of(self, seq: TrackedSequence) -> int:
        """The limit `set_limit` filed, wherever the sequence's tokens are."""
        return seq.limit if seq.tokens is not None else self.tok.limit_of[seq.row]

    def pause_fast_path(self) -> None:
        """Every listed sequence's next `add_token` takes the locked path (limit 0) until
        `resume_fast_path` (a thread-safe snapshot reads while they wait)."""
        for seq in self.listed.values():
            seq.limit = 0

    def resume_fast_path(self) -> None:
        for seq in self.seqs.values():
            self.set_limit(seq)  # a function of the sequence's blocks, which did not move

    # ------------------------------------------------------------------ materialised KV
    def materialised(self, seq: TrackedSequence) -> int:
        """Tokens whose KV exists: the context position during a chunked prefill, else all but
        the newest token (whose KV the next forward writes); after a failed transfer, no more
        than what is still valid."""
        if seq.context_position < seq.prompt_len:
            return seq.context_position
        if self.kv_valid:
            valid = self.kv_valid.get(seq.request_id)
            if valid is not None:
                return min(valid, seq.num_tokens - 1)
        return seq.num_tokens - 1

    def materialised_many(self, seqs: list[TrackedSequence]) -> list[int]:
        """`materialised` of each, in one pass when no failed transfer is pending."""
        if self.kv_valid:
            return [self.materialised(s) for s in seqs]
        return [s.context_position if s.context_position < s.prompt_len else s.num_tokens - 1 for s in seqs]

    def cut_back(self, seq: TrackedSequence, cut: int) -> None:
        """KV of `seq` is valid for its first `cut` tokens only (a failed transfer)."""
        seq.context_position = min(seq.context_position, cut)
        self.kv_valid[seq.request_id] = cut
        if seq.prepopulated > cut:
            seq.prepopulated = cut  # what `request_stats` reports as prepopulated tokens

    def set_context_position(self, seq: TrackedSequence, position: int) -> None:
        """Chunked prefill progress (`position`: a non-negative int); recomputing after a
        failed transfer ends once the position reaches the newest token. A position past the
        tokens, or one whose chunk would see blocks a sliding window released, raises
        `InvalidRequestError` with nothing changed."""
        if not position <= seq.num_tokens:
            raise InvalidRequestError(f"context position must be an int in [0, {seq.num_tokens}], got {position!r}")
        released = self.bm.released_blocks_visible(seq, position) if position < seq.prompt_len else None
        if released:
            raise InvalidRequestError(
                f"request {seq.request_id!r}: a chunk starting at {position} would see blocks window(s) {released} "
                "already released"
            )
        seq.context_position = position
        rid = seq.request_id
        if rid in self.kv_valid:
            if position >= seq.num_tokens - 1:
                del self.kv_valid[rid]
            else:
                self.kv_valid[rid] = position

    # ------------------------------------------------------------------ block-table rows
    def slot_rows(self, ids: Sequence[Hashable], wm: WindowBlockManager) -> np.ndarray:
        """Slot-table rows of `ids` (one per beam) in window `wm`: the last list's rows while
        no row was handed out or back since (a decode loop asks for the same batch each step);
        else, while every id is a one-beam sequence holding a row here, one lookup per id in
        the table's row directory (a batch that changes every step, as requests finish and
        join, never walks each sequence's objects: those cache misses were most of the call)."""
        table = wm.slot_table
        cached = self.table_rows.get(wm.index)
        if cached is not None and cached[1] == table.epoch and same_ids(cached[0], ids):
            return cached[2]
        ids = check_table_ids(ids)
        directory = table.row_of_id
        try:
            rows = int_array([directory[r] for r in ids], np.intp)  # [rows] one per request
        except (KeyError, TypeError):  # unknown ids, beams, no row yet: ask each sequence
            seqs = self.of(ids)
            w = wm.index
            held: list = [s.windows[w].rows for s in seqs]  # one row per beam, or None
            if None in held:  # a request holding no block here yet shows the empty row
                held = [table.table_rows(s.windows[w]) for s in seqs]
            rows = int_array(chain.from_iterable(held), np.intp)  # [rows] one per (request, beam)
        rows.flags.writeable = False
        self.table_rows[wm.index] = (list(ids) if type(ids) is list else ids, table.epoch, rows)
        return rows

    def block_offsets(self, request_ids: Sequence[Hashable], max_blocks: int | None) -> np.ndarray:
        """TensorRT-LLM `KVCacheIndex` offsets `[num_pools, rows, 2, max_blocks]` (int32) of
        checked ids, from every window's slot table (`max_blocks=None`: the longest row's width)."""
        from kvjax.offsets import kvcache_index_offsets

        self.of(request_ids)  # unknown ids raise here
        windows = self.bm.windows
        rows = {wm.window: self.slot_rows(request_ids, wm) for wm in windows}
        if max_blocks is None:
            lengths = (wm.slot_table.lengths[rows[wm.window]] for wm in windows)
            max_blocks = max((int(x.max()) for x in lengths if len(x)), default=0)
        tables = {wm.window: wm.slot_table.gather(rows[wm.window], max_blocks) for wm in windows}
        return kvcache_index_offsets(self.bm.config, tables)

    def items(self) -> Iterable[tuple[Hashable, TrackedSequence]]:
        return self.seqs.items()
