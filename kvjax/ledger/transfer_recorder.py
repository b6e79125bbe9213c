"""`TransferRecorder`: the buffer every ledger decision writes its data movements into.

Append-only between two `take_transfers()` calls; `take()` drains it into a `TransferPlan`
and keeps the drained columns (`taken`) until the next take, for failure reports.
"""
from __future__ import annotations

import array

import numpy as np

from kvjax.transfer_plan import PLAN_FIELDS, TransferPlan


class TransferRecorder:
    __slots__ = ("_cols", "taken")

    def __init__(self) -> None:
        self._cols = tuple(array.array("i") for _ in PLAN_FIELDS)
        self.taken = tuple(array.array("i") for _ in PLAN_FIELDS)

    def record(self, kind: int, pools: tuple[int, ...], src: int, dst: int, num_tokens: int) -> None:
        """One op per pool of the deciding window (`pools`), in decision order."""
        k, p, s, d, n = self._cols
        for pool in pools:
            k.append(kind)
            p.append(pool)
            s.append(src)
            d.append(dst)
            n.append(num_tokens)

    def __len__(self) -> int:
        return len(self._cols[0])

    def pending(self) -> list[tuple[int, int, int, int, int]]:
        """The ops recorded since the last take, as (kind, pool, src, dst, num_tokens)."""
        return list(zip(*self._cols, strict=True))

    def take(self, seq: int = 0) -> TransferPlan:
        cols = self._cols
        if not cols[0]:  # the common case between transfers: no copies
            if self.taken[0]:  # the last plan had ops: forget them (no new arrays otherwise)
                self.taken = cols
                self._cols = tuple(array.array("i") for _ in PLAN_FIELDS)
            return TransferPlan.empty_numbered(seq)
        kind, pool, src, dst, num_tokens = (np.frombuffer(c, dtype=np.int32).copy() for c in cols)
        plan = TransferPlan(kind, pool, src, dst, num_tokens, seq=seq)
        self._cols = tuple(array.array("i") for _ in PLAN_FIELDS)
        self.taken = cols
        return plan
