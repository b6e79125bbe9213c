"""Argument checks shared by the public constructors and the ledger's entry points.

One rule for every integer argument: a Python `int` or a numpy integer scalar (engines pass
both; numpy ones are converted to `int`), never a `bool`, a float (even an integral one), an
array, or a value outside the argument's range. Positions and counts must fit int32, because
that is what block tables, slot mappings and transfer plans carry. Durations and timeouts are
finite non-negative reals. Flags are `bool` (or `numpy.bool_`). Every check raises a
`KVCacheError` subclass (see `kvjax.errors`) before the caller changes anything.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TypeGuard

import numpy as np

from kvjax.errors import InvalidArgumentError, InvalidRequestError

INT32_MAX = 2**31 - 1  # largest position, count or token id a device array can carry
UINT64_END = 2**64  # LoRA task ids, extra ids and integer cache salts are unsigned 64-bit
_INTS = (int, np.integer)
_BOOLS = (bool, np.bool_)
_REALS = (int, float, np.integer, np.floating)


def is_int(x: object) -> TypeGuard[int | np.integer]:
    """A Python or numpy integer scalar, not a bool."""
    return isinstance(x, _INTS) and not isinstance(x, _BOOLS)


def check_int(
    name: str, x: object, lo: int | None = 0, hi: int | None = INT32_MAX, *, error: type[Exception] = InvalidArgumentError
) -> int:
    """`x` as an `int` in `[lo, hi]` (None: unbounded on that side)."""
    if type(x) is int:
        v = x
    elif is_int(x):
        v = int(x)
    else:
        raise error(f"{name} must be an int, got {x!r} ({type(x).__name__})")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise error(f"{name} must be an int in [{lo_s}, {hi_s}], got {v!r}")
    return v


def check_opt_int(
    name: str, x: object, lo: int | None = 0, hi: int | None = INT32_MAX, *, error=InvalidArgumentError
) -> int | None:
    return None if x is None else check_int(name, x, lo, hi, error=error)


def check_bool(name: str, x: object, *, error: type[Exception] = InvalidArgumentError) -> bool:
    if x is True or x is False:
        return x
    if not isinstance(x, _BOOLS):
        raise error(f"{name} must be a bool, got {x!r} ({type(x).__name__})")
    return bool(x)


def check_real(name: str, x: object, lo: float = 0.0, hi: float = math.inf, *, error=InvalidArgumentError) -> float:
    """A finite real number in `[lo, hi]` (ints and numpy scalars accepted; bools, NaN, inf not)."""
    if not isinstance(x, _REALS) or isinstance(x, _BOOLS):
        raise error(f"{name} must be a number, got {x!r} ({type(x).__name__})")
    v = float(x)
    if not math.isfinite(v) or not lo <= v <= hi:
        raise error(f"{name} must be a finite number in [{lo}, {hi}], got {x!r}")
    return v


def check_duration(name: str, x: object, *, error=InvalidArgumentError) -> float | None:
    """A retention duration in seconds: None (no expiry) or a finite number >= 0. A NaN or an
    infinite duration would poison the expiry heap's ordering, so both are refused."""
    return None if x is None else check_real(name, x, 0.0, error=error)


def check_hashable_id(name: str, x: object, *, error=InvalidRequestError) -> None:
    """A request id: hashable and equal to itself (a NaN id could never be looked up again)."""
    try:
        hash(x)
        same = x == x
    except Exception:  # unhashable, or an __eq__ that raises
        raise error(f"{name} must be hashable and equal to itself, got {x!r}") from None
    if same is not True:
        raise error(f"{name} must be hashable and equal to itself, got {x!r}")


def check_id_list(name: str, ids: object, *, error=InvalidArgumentError) -> list | tuple:
    """A collection (a list, tuple, range, set, 1-D array or generator; not a str) as a list
    (a list or tuple is returned as it is)."""
    if type(ids) is list or type(ids) is tuple:
        return ids
    if isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Iterable):
        raise error(f"{name} must be a collection, got {ids!r}")
    try:
        return list(ids)
    except TypeError:  # e.g. a 0-d array
        raise error(f"{name} must be a collection, got {ids!r}") from None


def check_sequence(name: str, values: object, *, error=InvalidArgumentError) -> tuple:
    """A list, tuple or 1-D array (not a str, dict or scalar) as a tuple."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise error(f"{name} must be one-dimensional, got shape {values.shape}")
        return tuple(values.tolist())
    if not isinstance(values, (list, tuple)):
        raise error(f"{name} must be a list or tuple, got {values!r} ({type(values).__name__})")
    return tuple(values)


def check_int_list(name: str, values: object, lo: int = 0, hi: int = INT32_MAX, *, error=InvalidArgumentError) -> list[int]:
    """A list/tuple/1-D integer array of ints in `[lo, hi]`, returned as a list of `int`."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise error(f"{name} must be one-dimensional, got shape {values.shape}")
        values = values.tolist()
    if not isinstance(values, (list, tuple, range)):
        raise error(f"{name} must be a list of ints, got {type(values).__name__}")
    return [check_int(f"{name}[{i}]", v, lo, hi, error=error) for i, v in enumerate(values)]
