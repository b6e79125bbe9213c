"""Boundary validation shared by the op wrappers: clear `ValueError`s before anything is
traced or donated, so a rejected call leaves the caller's pools usable."""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.device.pools import KVPools

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def check_pools(pools) -> None:
    if not isinstance(pools, KVPools):
        raise ValueError(f"pools must be a KVPools (from allocate_pools), got {type(pools)=}")


def shape_dtype(name: str, x, ndim: int, dtype_kind: str | None = None):
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"{name} must be an array, got {type(x)=}")
    if len(shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {name}.shape={tuple(shape)}")
    if dtype_kind == "int" and (not jnp.issubdtype(dtype, jnp.integer) or jnp.dtype(dtype) == jnp.bool_):
        raise ValueError(f"{name} must be an integer array, got {name}.dtype={dtype}")
    if dtype_kind == "float" and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got {name}.dtype={dtype}")
    return tuple(shape), jnp.dtype(dtype)


def concrete(x) -> np.ndarray | None:
    """Host values of `x` when they are known without a device sync (numpy inputs)."""
    if isinstance(x, (np.ndarray, np.generic, list, tuple)):
        return np.asarray(x)
    return None


def int_array(name: str, x, ndim: int) -> tuple[tuple[int, ...], np.ndarray | None]:
    """Shape and (for numpy inputs) host values of an integer array whose values fit int32:
    a wider array is never narrowed silently."""
    shape, _ = shape_dtype(name, x, ndim, "int")
    host = concrete(x)
    if host is not None and host.size:
        lo, hi = int(host.min()), int(host.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            raise ValueError(f"{name} holds values outside int32 (min {lo}, max {hi}): they would be truncated")
    return shape, host


def as_int32(x) -> jax.Array:
    """`x` as an int32 device array (call after `int_array` checked its range)."""
    return jnp.asarray(x, jnp.int32)


def finite_scale(scale) -> float:
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a real number, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return scale


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def any_tracer(*xs) -> bool:
    return any(is_tracer(leaf) for leaf in jax.tree_util.tree_leaves(xs))
