"""`TokenStore`: where the ledger keeps the token ids of the sequences a batched step grows, as
columns (the only module that writes them).

Each such sequence owns a *row*: an immutable prefix (its first tokens as native int32 bytes,
usually the very `bytes` admission's tree walk encoded its prompt into, so moving a sequence
here copies nothing), then pages of `PAGE` int32 ids for the tokens after it (rows of one
numpy matrix grown by doubling), and, as int64 columns indexed by row, its token count
(`count`), its prefix length (`base`), the flat offset of its last page (`tail`) and the count
at which its next token needs more than being stored (`limit`: a block to allocate, a window
to slide, checks only `add_token`'s slow path makes; the manager sets it). So a decode step of
many sequences (`add_tokens`) is one gather of the columns, one scatter of the tokens and one
column update, and no sequence object is read.

A sequence keeps its tokens as a Python list instead (`TrackedSequence.tokens`) until its
first batched step moves them here: single `add_token` calls append to the list without the
lock (CPython appends to a list several times faster than it writes through a memoryview), and
one that finds its sequence here moves the tokens back. A sequence's tokens are in exactly one
of the two.

No Python int is kept per stored token (4 bytes each instead of a list entry and an int
object), and a page that a rewind or a release empties goes back to the free pages, so memory
follows the live tokens, never time. Every write here happens under the manager's lock.
"""
from __future__ import annotations

import struct
from collections.abc import Hashable

import numpy as np

from kvjax._math import ceil_div
from kvjax.errors import IntegrityError
from kvjax.ledger.packing import packer

PAGE = 256  # tokens per page (a power of two: `(count - base) & MASK` is the offset in the last page)
MASK = PAGE - 1
RESERVE_PAGES = 4  # at most this many pages a new row reserves ahead of its tokens
_UNIT = 4  # bytes per token (native int32)
_COLUMNS = ("count", "base", "tail", "limit")


class TokenStore:
    __slots__ = (
        "pages", "flat", "flat_of", "raw", "count", "count_of", "base", "base_of", "tail", "tail_of", "limit", "limit_of",
        "prefix", "row_pages", "row_of_id", "free_pages", "free_rows", "next_row", "next_page", "reserved",
        "row_reserve",
    )  # fmt: skip

    def __init__(self, rows: int = 64, pages: int = 64) -> None:
        self.pages = np.zeros((pages, PAGE), dtype=np.int32)  # [pages, PAGE]
        self.count = np.zeros(rows, dtype=np.int64)  # [rows] tokens held
        self.base = np.zeros(rows, dtype=np.int64)  # [rows] tokens in the prefix
        self.tail = np.zeros(rows, dtype=np.int64)  # [rows] flat offset of the last page
        self.limit = np.zeros(rows, dtype=np.int64)  # [rows] a token only needs storing below this count
        self.prefix: list[bytes] = [b""] * rows  # [rows] the first `base` tokens, encoded
        self.row_pages: list[list[int] | None] = [None] * rows  # None: a free row
        self.row_of_id: dict[Hashable, int] = {}  # the row of each sequence held here, by request id
        self.free_pages: list[int] = []
        self.free_rows: list[int] = []
        self.next_row = 0
        self.next_page = 0
        # pages the rows are expected to need (their requests' max_new_tokens, at most
        # `RESERVE_PAGES` each): the page matrix grows to this when a row is added, so decode
        # steps rarely copy it, and a request that may generate long reserves no more
        self.reserved = 0
        self.row_reserve: dict[int, int] = {}
        self._page_views()
        self._row_views()

    def _page_views(self) -> None:
        self.flat = self.pages.reshape(-1)  # [pages * PAGE] (a view)
        self.flat_of = memoryview(self.flat)  # one-entry writes
        self.raw = memoryview(self.pages).cast("B")  # byte copies in and out

    def _row_views(self) -> None:
        """Memoryviews for one-entry reads and writes (a numpy scalar access costs several
        times more); renewed whenever the columns are replaced."""
        self.count_of = memoryview(self.count)
        self.base_of = memoryview(self.base)
        self.tail_of = memoryview(self.tail)
        self.limit_of = memoryview(self.limit)

    # ------------------------------------------------------------------ rows and pages
    def _new_row(self) -> int:
        if self.free_rows:
            return self.free_rows.pop()
        r = self.next_row
        if r == len(self.count):
            for name in _COLUMNS:
                col = np.zeros(2 * r, dtype=np.int64)
                col[:r] = getattr(self, name)
                setattr(self, name, col)
            self.prefix += [b""] * r
            self.row_pages += [None] * r
            self._row_views()
        self.next_row = r + 1
        return r

    def _new_pages(self, k: int) -> list[int]:
        free = self.free_pages
        if len(free) >= k:
            out = free[len(free) - k :]
            del free[len(free) - k :]
            return out
        out = free[:]
        free.clear()
        need = k - len(out)
        start = self.next_page
        self._fit(start + need)
        self.next_page = start + need
        return out + list(range(start, start + need))

    def _fit(self, num_pages: int) -> None:
        """Make the page matrix at least `num_pages` pages (doubling)."""
        size = len(self.pages)
        if num_pages > size:
            while size < num_pages:
                size *= 2
            pages = np.zeros((size, PAGE), dtype=np.int32)
            pages[: len(self.pages)] = self.pages
            self.pages = pages
            self._page_views()

    def _grow_pages(self, r: int, n: int) -> None:
        """Give row `r` the pages `n` tokens need."""
        pages = self.row_pages[r]
        assert pages is not None  # a live row
        more = ceil_div(n - self.base_of[r], PAGE) - len(pages)
        if more > 0:
            pages += self._new_pages(more)
            self.tail_of[r] = pages[-1] * PAGE

    def admit(self, request_id: Hashable, prefix: bytes, expected: int) -> int:
        """A new row for `request_id` whose tokens are `prefix` (native int32 bytes, kept as
        they are), expected to reach `expected` tokens; its limit is 0 (the manager sets it)."""
        r = self._new_row()
        n = len(prefix) // _UNIT
        share = min(ceil_div(max(expected - n, 0), PAGE), RESERVE_PAGES)
        self.row_reserve[r] = share
        self.reserved += share
        self._fit(self.reserved)
        self.prefix[r] = prefix
        self.row_pages[r] = []
        self.count_of[r] = self.base_of[r] = n
        self.tail_of[r] = self.limit_of[r] = 0
        self.row_of_id[request_id] = r
        return r

    def release(self, request_id: Hashable, r: int) -> None:
        """Hand row `r` (of `request_id`) and its pages back."""
        pages = self.row_pages[r]
        assert pages is not None  # a live row
        self.free_pages += pages
        self.row_pages[r] = None
        self.prefix[r] = b""
        self.reserved -= self.row_reserve.pop(r)
        self.count_of[r] = self.base_of[r] = self.tail_of[r] = self.limit_of[r] = 0
        del self.row_of_id[request_id]
        self.free_rows.append(r)

    # ------------------------------------------------------------------ writers (under the lock)
    def set_limit(self, r: int, limit: int) -> None:
        self.limit_of[r] = limit

    def set_limits(self, rows: np.ndarray, limits: np.ndarray) -> None:
        self.limit[rows] = limits

    def append(self, r: int, token: int) -> None:
        """One token at the end of row `r` (a page is added at a page boundary)."""
        n = self.count_of[r]
        at = (n - self.base_of[r]) & MASK
        if not at:
            self._grow_pages(r, n + 1)
        self.flat_of[self.tail_of[r] + at] = token
        self.count_of[r] = n + 1

    def overwrite(self, r: int, pos: int, token: int) -> None:
        """Token `pos` of row `r` becomes `token` (a pending token's id, or its mark)."""
        base = self.base_of[r]
        pages = self.row_pages[r]
        assert pages is not None and 0 <= pos < self.count_of[r]
        if pos < base:  # inside the immutable prefix: a new bytes object
            old = self.prefix[r]
            self.prefix[r] = old[: pos * _UNIT] + struct.pack("i", token) + old[(pos + 1) * _UNIT :]
            return
        at = pos - base
        self.flat_of[pages[at // PAGE] * PAGE + (at & MASK)] = token

    def extend(self, r: int, tokens: list[int]) -> None:
        """Tokens at the end of row `r` (checked ints in [0, 2**31)): one copy per page."""
        if len(tokens) == 1:  # the usual move into the store: the prompt's last token
            self.append(r, tokens[0])
            return
        n, base = self.count_of[r], self.base_of[r]
        self._grow_pages(r, n + len(tokens))
        src = memoryview(packer(len(tokens))(*tokens))
        raw, done = self.raw, 0
        for a, b in self._spans(r, n - base, n - base + len(tokens)):
            raw[a:b] = src[done : done + b - a]
            done += b - a
        self.count_of[r] = n + len(tokens)

    def append_rows(self, rows: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """`append(rows[i], tokens[i])` for each i: distinct rows whose counts are `counts`."""
        at = (counts - self.base[rows]) & MASK  # [n] offset of each new token in its page
        opens = rows[at == 0]  # [k] rows whose new token opens a page
        if len(opens):
            new = self._new_pages(len(opens))
            row_pages = self.row_pages
            for r, p in zip(opens.tolist(), new, strict=True):
                pages = row_pages[r]
                assert pages is not None  # a live row
                pages.append(p)
            self.tail[opens] = np.array(new, dtype=np.int64) * PAGE
        self.flat[self.tail[rows] + at] = tokens
        self.count[rows] = counts + 1

    def truncate(self, r: int, n: int) -> None:
        """Keep the first `n` tokens of row `r` (`n` at most its count); emptied pages go back."""
        pages = self.row_pages[r]
        assert pages is not None and 0 <= n <= self.count_of[r]
        base = self.base_of[r]
        if n < base:
            self.prefix[r] = self.prefix[r][: n * _UNIT]
            self.base_of[r] = base = n
        keep = ceil_div(n - base, PAGE)
        if keep < len(pages):
            self.free_pages += pages[keep:]
            del pages[keep:]
            self.tail_of[r] = pages[-1] * PAGE if pages else 0
        self.count_of[r] = n

    # ------------------------------------------------------------------ readers
    def units(self, r: int, start: int, end: int) -> bytes:
        """Tokens `[start, end)` of row `r` as native int32 bytes."""
        pages = self.row_pages[r]
        assert pages is not None and 0 <= start <= end <= self.count_of[r]
        base = self.base_of[r]
        if end <= base:  # within the prefix (a prompt block)
            return self.prefix[r][start * _UNIT : end * _UNIT]
        lo = start - base
        if lo >= 0 and lo // PAGE == (end - base - 1) // PAGE:  # within one page (a decode block)
            o = (pages[lo // PAGE] * PAGE + (lo & MASK)) * _UNIT
            return self.raw[o : o + (end - start) * _UNIT].tobytes()
        parts: list[bytes | memoryview] = [self.prefix[r][start * _UNIT :]] if start < base else []
        raw = self.raw
        parts += [raw[a:b] for a, b in self._spans(r, max(start, base) - base, end - base)]
        only = parts[0]
        if len(parts) == 1 and isinstance(only, memoryview):
            return only.tobytes()
        return b"".join(parts)

    def _spans(self, r: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Byte ranges of `raw` holding row `r`'s page-relative tokens `[lo, hi)` (past its
        prefix), one per page, in order (the pages exist)."""
        pages = self.row_pages[r]
        assert pages is not None  # a live row
        out = []
        for i in range(lo // PAGE, (hi - 1) // PAGE + 1) if hi > lo else ():
            o = pages[i] * PAGE
            out.append(((o + max(lo, i * PAGE) - i * PAGE) * _UNIT, (o + min(hi, (i + 1) * PAGE) - i * PAGE) * _UNIT))
        return out

    def tokens(self, r: int, start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of row `r`, as Python ints."""
        return list(struct.unpack(f"{end - start}i", self.units(r, start, end)))

    # ------------------------------------------------------------------ integrity
    def verify(self, rows: dict[Hashable, int]) -> None:
        """Raise `IntegrityError` unless `rows` (the row of each sequence held here) are
        exactly the rows in use and filed under their ids, each holding a prefix of `base`
        tokens and `ceil((count - base) / PAGE)` pages whose last one `tail` names, and every
        page is held by one row or free, never both or twice."""
        live = [r for r, pages in enumerate(self.row_pages) if pages is not None]
        if sorted(rows.values()) != live or rows != self.row_of_id:
            raise IntegrityError("token store: the rows in use are not the sequences' rows, or filed under other ids")
        free_rows = set(self.free_rows)
        if len(free_rows) != len(self.free_rows) or free_rows & set(live) or len(live) + len(free_rows) != self.next_row:
            raise IntegrityError("token store: a free row is in use, listed twice, or lost")
        seen: set[int] = set()
        for r in live:
            pages = self.row_pages[r]
            assert pages is not None
            n, base = int(self.count[r]), int(self.base[r])
            if not 0 <= base <= n or len(self.prefix[r]) != base * _UNIT:
                raise IntegrityError(f"token store: row {r} has a prefix of {len(self.prefix[r])} bytes for {base} tokens")
            if len(pages) != ceil_div(n - base, PAGE) or self.tail[r] != (pages[-1] * PAGE if pages else 0):
                raise IntegrityError(f"token store: row {r} holds {len(pages)} pages for {n - base} tokens, or a stale tail")
            if seen & set(pages) or len(set(pages)) != len(pages):
                raise IntegrityError(f"token store: a page of row {r} is held twice")
            seen.update(pages)
        free = set(self.free_pages)
        if len(free) != len(self.free_pages) or free & seen or len(free) + len(seen) != self.next_page:
            raise IntegrityError("token store: a free page is in use, listed twice, or lost")
        if self.row_reserve.keys() != set(live) or self.reserved != sum(self.row_reserve.values()):
            raise IntegrityError("token store: the page reservations are not the live rows'")
        unused = np.ones(len(self.count), dtype=bool)  # [rows]
        unused[live] = False
        if any(getattr(self, c)[unused].any() for c in _COLUMNS) or (self.limit < 0).any():
            raise IntegrityError("token store: a free row has a count, a prefix, a tail or a limit, or a limit is negative")
