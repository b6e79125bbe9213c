"""Helpers shared by the kernels: backend choice and pool-chunk views."""
from __future__ import annotations

import jax

#: Largest chunk (bytes) one CTA stages through shared memory in the copy kernels.
SMEM_CHUNK_BYTES = 64 * 1024


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def page_ref(pool_ref, layout: str, slot, layer, field=None):
    """View of one slot of one layer (and field) of a 6-D pool ref: `[F, H, T, D]` or `[H, T, D]`."""
    idx = (slot, layer) if layout == "block_first" else (layer, slot)
    return pool_ref.at[idx if field is None else (*idx, field)]


def block_ref(pool_ref, block_axis: int, slot):
    """All layers of one slot: `[L, F, H, T, D]` (block_first) or `[L, F, H, T, D]` via .at[:, slot]."""
    return pool_ref.at[slot] if block_axis == 0 else pool_ref.at[:, slot]
