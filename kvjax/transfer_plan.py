"""`TransferPlan`: the ordered data movements the ledger decided, as flat int32 arrays.

A neutral module: the ledger (`kvjax.ledger`, which writes plans) and the device side
(`kvjax.device`, which applies them) both import it, and importing it loads neither.

The ledger never touches KV bytes. Every offload, onboard and (partial) copy it decides is
recorded here, one entry per (movement, pool), in decision order, and handed to the device
side (`kvjax.device.apply_transfers`), which can consume the arrays without Python loops.

Semantics of entry i (slots are memory-pool indices, never block ids):
  OFFLOAD  primary[pool][src]   -> secondary[pool][dst]   (whole block, num_tokens == tokens_per_block)
  ONBOARD  secondary[pool][src] -> primary[pool][dst]     (first num_tokens tokens)
  COPY     primary[pool][src]   -> primary[pool][dst]     (first num_tokens tokens)
Applying a plan must equal applying its entries one by one, in order.

`seq` numbers the plans one ledger hands out (1, 2, ...; 0 for a plan built by hand), so the
ledger can be told which plan failed (`KVCacheManager.transfers_failed`) and can refuse a
report that comes late, twice or out of order.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np


class TransferKind(enum.IntEnum):
    OFFLOAD = 0  # primary -> secondary
    ONBOARD = 1  # secondary -> primary
    COPY = 2  # primary -> primary (partial reuse copies the first num_tokens tokens)


class TransferOp(NamedTuple):
    kind: TransferKind
    pool: int
    src: int
    dst: int
    num_tokens: int


PLAN_FIELDS = ("kind", "pool", "src", "dst", "num_tokens")
_EMPTY_COLUMN = np.zeros(0, np.int32)
_EMPTY_COLUMN.flags.writeable = False
_EMPTY_FIELDS = dict.fromkeys(PLAN_FIELDS, _EMPTY_COLUMN)


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _int32_column(name: str, value: object) -> np.ndarray:
    """`value` as a contiguous 1-D int32 array, refusing anything that would change in the
    conversion: floats (NaN included), bools, non-numbers, or integers outside int32. A slot
    index silently wrapped or truncated would move another request's KV."""
    if isinstance(value, np.ndarray):
        a = value
    else:
        if isinstance(value, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in value):
            raise TypeError(f"TransferPlan.{name} must hold integers, got a bool in {value!r}")
        try:
            a = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as e:
            raise TypeError(f"TransferPlan.{name} must be a 1-D sequence of integers: {e}") from None
    if a.ndim != 1:
        raise ValueError(f"TransferPlan.{name} must be 1-D, got shape {a.shape}")
    if a.dtype == np.int32:
        return np.ascontiguousarray(a)
    if a.size == 0:
        return np.zeros(0, np.int32)
    if a.dtype.kind not in "iu":  # bool, float (NaN), complex, object (ints beyond int64), str
        raise TypeError(f"TransferPlan.{name} must hold integers, got dtype {a.dtype}")
    lo, hi = int(a.min()), int(a.max())
    if lo < INT32_MIN or hi > INT32_MAX:
        raise ValueError(f"TransferPlan.{name} holds values outside int32: [{lo}, {hi}]")
    return a.astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class TransferPlan:
    """Equal-length int32 arrays, one entry per op, in the order the ops must take effect, and
    the plan's sequence number in its ledger (0: not from a ledger). Arrays of another integer
    dtype are converted when every value fits int32; floats, bools and out-of-range values
    raise (`TypeError` / `ValueError`) instead of being narrowed."""

    kind: np.ndarray
    pool: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    num_tokens: np.ndarray
    seq: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seq, (bool, np.bool_)) or not isinstance(self.seq, (int, np.integer)) or self.seq < 0:
            raise ValueError(f"TransferPlan.seq must be an int >= 0, got {self.seq!r}")
        object.__setattr__(self, "seq", int(self.seq))
        n = None
        for name in PLAN_FIELDS:
            a = _int32_column(name, getattr(self, name))
            if n is None:
                n = a.shape[0]
            elif a.shape[0] != n:
                raise ValueError(f"TransferPlan arrays differ in length: {name} has {a.shape[0]}, expected {n}")
            object.__setattr__(self, name, a)
        if n and not np.isin(self.kind, [int(k) for k in TransferKind]).all():
            raise ValueError(f"TransferPlan.kind holds values outside TransferKind: {np.unique(self.kind)}")

    @classmethod
    def empty(cls) -> TransferPlan:
        z = np.zeros(0, np.int32)
        return cls(z, z, z, z, z)

    @classmethod
    def empty_numbered(cls, seq: int) -> TransferPlan:
        """An empty plan numbered `seq` (>= 0), built without re-validating its arrays: the
        ledger hands one out on most steps, and they share one read-only empty column."""
        plan = object.__new__(cls)
        fields = plan.__dict__  # frozen: fill the instance dict directly
        fields.update(_EMPTY_FIELDS)
        fields["seq"] = seq
        return plan

    @classmethod
    def from_ops(cls, ops: list[TransferOp] | list[tuple[int, int, int, int, int]]) -> TransferPlan:
        if not ops:
            return cls.empty()
        if any(len(op) != 5 for op in ops):
            raise ValueError("TransferPlan.from_ops takes (kind, pool, src, dst, num_tokens) tuples")
        # lists: `__post_init__` checks them and makes them int32 arrays
        cols: list[Any] = [list(col) for col in zip(*ops, strict=True)]
        kind, pool, src, dst, num_tokens = cols
        return cls(kind, pool, src, dst, num_tokens)

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    def __iter__(self) -> Iterator[TransferOp]:
        for k, p, s, d, n in zip(*(getattr(self, f).tolist() for f in PLAN_FIELDS), strict=True):
            yield TransferOp(TransferKind(k), p, s, d, n)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferPlan):
            return NotImplemented
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in PLAN_FIELDS)

    def counts(self) -> dict[str, int]:
        """Number of entries of each kind (per pool entries, not per block)."""
        return {k.name.lower(): int((self.kind == k).sum()) for k in TransferKind}
