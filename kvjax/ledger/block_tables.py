"""Block tables for attention kernels: each sequence's primary slots, padded with the null slot.

`SlotTable` is the one owner of the slots a window's block tables show: an int32 matrix with
one row per live (sequence, beam), kept in step with the sequence's block ids by every writer
(admission, growth, sliding-window detach, rewind, release), so a batch's table is one
fancy-index gather. Entries past a row's length hold the null slot, and a row handed back is
reset in full before it can be handed out again: a table never shows a slot the request does
not own.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from kvjax.errors import IntegrityError, InvalidArgumentError

if TYPE_CHECKING:
    from kvjax.ledger.sequence import SequenceWindow

EMPTY_ROW = 0  # always empty: the row of a sequence that holds no block in this window yet


class SlotTable:
    """One window's slot rows: `table` int32 `[rows, width]`, `lengths` int32 `[rows]`.

    A sequence window gets its rows (one per beam) with its first block and gives them back
    on release; rows and width grow by doubling, so memory follows the live batch (bounded by
    the pool), never time. Beside each row, `store_due` int64 `[rows]` holds its sequence's
    store hint (`set_store_due`), so a decode step's store pre-check is a column comparison.
    """

    __slots__ = (
        "null_slot", "table", "lengths", "cells", "length_of", "free_rows", "next_row", "epoch", "longest", "row_of_id",
        "store_due", "due_of",
    )  # fmt: skip

    def __init__(self, null_slot: int, rows: int = 64, width: int = 16) -> None:
        self.null_slot = null_slot
        self.table = np.full((rows, width), null_slot, dtype=np.int32)  # [rows, width]
        self.lengths = np.zeros(rows, dtype=np.int32)  # [rows]
        # per row, the store hint of its one-beam sequence: 0, or the materialised token count
        # from which it may hold a full block not yet stored (`set_store_due`)
        self.store_due = np.zeros(rows, dtype=np.int64)  # [rows]
        self._views()
        self.free_rows: list[int] = []
        self.next_row = EMPTY_ROW + 1
        # bumped whenever a row is handed out or back: row lists cached by callers go stale
        self.epoch = 0
        self.longest = 0  # an upper bound of every row's length (never lowered)
        # the row of each one-beam sequence holding one, by request id (filed when handed out,
        # dropped when handed back): a batch's rows without a walk through its sequences
        self.row_of_id: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ rows
    def rows_of(self, sw: SequenceWindow) -> list[int]:
        """The rows of `sw` (one per beam), handed out on first use."""
        rows = sw.rows
        if rows is None:
            # a row's store hint is 0 whenever it is free (`release`, `_resize`): it says
            # nothing of its new owner's cursor
            rows = sw.rows = [self._new_row() for _ in range(len(sw.blocks))]
            if len(rows) == 1:
                self.row_of_id[sw.request_id] = rows[0]
            self.epoch += 1
        return rows

    def table_rows(self, sw: SequenceWindow) -> list[int]:
        """Rows to gather for `sw` (the empty row per beam while it holds nothing here)."""
        rows = sw.rows
        return [EMPTY_ROW] * len(sw.blocks) if rows is None else rows

    def _new_row(self) -> int:
        if self.free_rows:
            return self.free_rows.pop()
        r = self.next_row
        if r == self.table.shape[0]:
            self._resize(2 * r, self.table.shape[1])
        self.next_row = r + 1
        return r

    def _resize(self, rows: int, width: int) -> None:
        old = self.table
        table = np.full((rows, width), self.null_slot, dtype=np.int32)  # [rows, width]
        table[: old.shape[0], : old.shape[1]] = old
        self.table = table
        if rows != self.lengths.shape[0]:
            lengths = np.zeros(rows, dtype=np.int32)  # [rows]
            lengths[: self.lengths.shape[0]] = self.lengths
            self.lengths = lengths
            due = np.zeros(rows, dtype=np.int64)  # [rows]
            due[: self.store_due.shape[0]] = self.store_due
            self.store_due = due
        self._views()

    def _views(self) -> None:
        """Memoryviews of `table` and `lengths` for one-entry reads and writes (a numpy scalar
        access costs several times more); renewed whenever the arrays are replaced."""
        self.cells = memoryview(self.table)
        self.length_of = memoryview(self.lengths)
        self.due_of = memoryview(self.store_due)

    def _fit(self, length: int) -> None:
        """Make room for a row of `length` slots."""
        if length > self.longest:
            self.longest = length
            width = self.table.shape[1]
            if length > width:
                while width < length:
                    width *= 2
                self._resize(self.table.shape[0], width)

    def release(self, sw: SequenceWindow) -> None:
        """Hand `sw`'s rows back, reset to the null slot (the sequence left)."""
        rows = sw.rows
        self.epoch += 1
        if rows is None:
            return
        sw.rows = None
        if len(rows) == 1:
            del self.row_of_id[sw.request_id]
        table, length_of, null = self.table, self.length_of, self.null_slot
        for r in rows:
            self.due_of[r] = 0
            n = length_of[r]
            if n:
                table[r, :n] = null
                length_of[r] = 0
        self.free_rows.extend(rows)

    def set_store_due(self, sw: SequenceWindow, due: int) -> None:
        """File the store hint of a one-beam sequence's row (nothing for a sequence with no
        row yet, or several: their rows keep 0). A nonzero hint promises that while the
        sequence materialises fewer than `due` tokens, it holds no full block to store
        (`store_new_blocks` skips the row on that alone); 0 promises nothing. The window
        manager's `set_cursor` is the only caller."""
        rows = sw.rows
        if rows is not None and len(rows) == 1:
            self.due_of[rows[0]] = due

    def clear_store_hints(self) -> None:
        """Every row back to "check" (a store moved a block some cursor may name)."""
        self.store_due.fill(0)

    # ------------------------------------------------------------------ writers
    def extend(self, sw: SequenceWindow, beam: int, slots: list[int] | np.ndarray) -> None:
        r = self.rows_of(sw)[beam]
        n = self.length_of[r]
        k = len(slots)
        self._fit(n + k)
        if k <= 8:  # a few entries: one memoryview store each beats a numpy slice assignment
            cells = self.cells
            for j, s in enumerate(slots, n):
                cells[r, j] = s
        else:
            self.table[r, n : n + k] = slots
        self.length_of[r] = n + k

    def append(self, sw: SequenceWindow, beam: int, slot: int) -> None:
        rows = sw.rows
        r = (self.rows_of(sw) if rows is None else rows)[beam]
        n = self.length_of[r]
        if n >= self.longest:
            self._fit(n + 1)
        self.cells[r, n] = slot
        self.length_of[r] = n + 1

    def append_rows(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Append `slots[i]` to row `rows[i]` (distinct rows, handed out already)."""
        lengths = self.lengths
        at = lengths[rows]  # [n]
        if len(at):
            self._fit(int(at.max()) + 1)
        self.table[rows, at] = slots
        lengths[rows] = at + 1

    def set(self, sw: SequenceWindow, beam: int, pos: int, slot: int) -> None:
        """Overwrite an existing entry (a detached block's null slot, a rewind's copy)."""
        r = self.rows_of(sw)[beam]
        if not 0 <= pos < self.lengths[r]:
            raise IndexError(f"slot position {pos} outside a row of {int(self.lengths[r])}")
        self.table[r, pos] = slot

    def truncate(self, sw: SequenceWindow, beam: int, length: int) -> None:
        """Keep the first `length` entries of a beam's row; the rest return to the null slot."""
        r = self.rows_of(sw)[beam]
        n = int(self.lengths[r])
        if length < n:
            self.table[r, length:n] = self.null_slot
            self.lengths[r] = length

    # ------------------------------------------------------------------ readers
    def row(self, sw: SequenceWindow, beam: int) -> np.ndarray:
        """A beam's slots (a copy)."""
        if sw.rows is None:
            return np.zeros(0, dtype=np.int32)
        r = sw.rows[beam]
        return self.table[r, : self.lengths[r]].copy()

    def slots(self, sw: SequenceWindow) -> list[list[int]]:
        """Every beam's slots, as lists."""
        return [self.row(sw, b).tolist() for b in range(len(sw.blocks))]

    def gather(self, rows: np.ndarray, max_blocks: int | None) -> np.ndarray:
        """int32 `[len(rows), width]`: each row's slots, then the null slot; `width` is
        `max_blocks` or the longest row's length."""
        if max_blocks is None or max_blocks < self.longest:
            longest = int(self.lengths[rows].max()) if len(rows) else 0
            if max_blocks is None:
                max_blocks = longest
            elif max_blocks < longest:
                raise InvalidArgumentError(f"max_blocks={max_blocks} is smaller than the longest block list ({longest})")
        table = self.table
        width = table.shape[1]
        if max_blocks == width:
            return table.take(rows, axis=0)  # [n, width] (a copy; `take` beats fancy indexing here)
        if max_blocks < width:
            return table[rows, :max_blocks]  # [n, max_blocks] (a copy)
        out = np.full((len(rows), max_blocks), self.null_slot, dtype=np.int32)  # [n, max_blocks]
        out[:, :width] = table.take(rows, axis=0)
        return out

    def verify(self, owned: Iterable[tuple[object, list[int]]]) -> None:
        """Raise `IntegrityError` unless each row belongs to at most one owner (`owned`: request
        id and rows), the row directory files exactly the one-row owners under their ids,
        entries past a row's length hold the null slot, and rows nobody owns are empty."""
        table, lengths, null = self.table, self.lengths, self.null_slot
        if table.shape[0] != lengths.shape[0] or self.next_row > table.shape[0]:
            raise IntegrityError("slot table: row count and lengths disagree")
        owner: dict[int, object] = {}
        directory: dict[object, int] = {}
        for who, rows in owned:
            for r in rows:
                if not EMPTY_ROW < r < self.next_row or r in owner:
                    raise IntegrityError(f"slot table: row {r} of {who!r} is out of range or also held by {owner.get(r)!r}")
                owner[r] = who
            if len(rows) == 1:
                directory[who] = rows[0]
        if directory != self.row_of_id:
            wrong = sorted((repr(k) for k in directory.keys() ^ self.row_of_id.keys()), key=str) or sorted(
                repr(k) for k in directory if directory[k] != self.row_of_id[k]
            )
            raise IntegrityError(f"slot table: the row directory is stale for request(s) {', '.join(wrong[:4])}")
        free = set(self.free_rows)
        if free & set(owner) or len(free) != len(self.free_rows) or not all(EMPTY_ROW < r < self.next_row for r in free):
            raise IntegrityError("slot table: a free row is held, out of range, or listed twice")
        if len(owner) + len(self.free_rows) != self.next_row - 1:
            handed = self.next_row - 1
            raise IntegrityError(f"slot table: {handed} rows handed out, {len(owner)} held + {len(self.free_rows)} free")
        if int(lengths.max(initial=0)) > self.longest or int(lengths.min(initial=0)) < 0:
            raise IntegrityError("slot table: a row length is out of bounds")
        held = np.zeros(table.shape[0], dtype=bool)  # [rows]
        held[list(owner)] = True
        if lengths[~held].any():
            raise IntegrityError("slot table: a row nobody holds is not empty")
        if self.store_due.shape[0] != table.shape[0] or self.store_due[~held].any() or (self.store_due < 0).any():
            raise IntegrityError("slot table: a row nobody holds has a store hint, or a hint is negative")
        past = np.arange(table.shape[1])[None, :] >= lengths[:, None]  # [rows, width]
        if (table[past] != null).any():
            raise IntegrityError("slot table: an entry past a row's end is not the null slot")
