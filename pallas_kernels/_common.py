"""Helpers shared by the kernels: backend choice and pool-chunk views."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def page_ref(pool_ref: Any, layout: str, slot: Any, layer: Any, field: int | None = None) -> Any:
    """View of one slot of one layer (and field) of a 6-D pool ref: `[F, H, T, D]` or `[H, T, D]`."""
    idx = (slot, layer) if layout == "block_first" else (layer, slot)
    return pool_ref.at[idx if field is None else (*idx, field)]



def fp8_values(x: Any, value_dtype: DTypeLike | None) -> Any:
    """FP8 pool bytes (uint8 bit patterns) viewed as `value_dtype` and widened to float32."""
    if value_dtype is None:
        raise ValueError("FP8 pools (scales given) need value_dtype, the fp8 dtype their bytes hold")
    return jax.lax.bitcast_convert_type(x, value_dtype).astype(jnp.float32)
