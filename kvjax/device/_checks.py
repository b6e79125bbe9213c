"""Boundary validation shared by the op wrappers: clear `ValueError`s before tracing."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from kvjax.device.pools import KVPools


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
    if dtype_kind == "int" and not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got {name}.dtype={dtype}")
    if dtype_kind == "float" and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got {name}.dtype={dtype}")
    return tuple(shape), jnp.dtype(dtype)


def concrete(x) -> np.ndarray | None:
    """Host values of `x` when they are known without a device sync (numpy inputs)."""
    if isinstance(x, (np.ndarray, list, tuple)):
        return np.asarray(x)
    return None


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)
