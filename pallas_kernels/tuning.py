"""Tuning knobs of the Mosaic GPU kernels, as frozen, validated configs.

A config is hashable and passed as a static keyword, so two configs compile two programs and
a bad value fails when the config is built, not deep inside a kernel's lowering.
"""
from __future__ import annotations

import dataclasses

#: Largest dynamic shared memory one CTA may use on Hopper (H100 / H200), in bytes.
HOPPER_MAX_SMEM_BYTES = 227 * 1024


def _check_positive_multiple(name: str, value: object, multiple: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % multiple:
        raise ValueError(f"{name} must be a positive multiple of {multiple}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """Paged attention (Mosaic GPU).

    block_q       query rows per program (`q_len * G` rows, zero-padded): the wgmma M
                  dimension, so a multiple of 64.
    min_block_kv  keys per loop step; several pages are TMA'd side by side into one tile when
                  a page is smaller. A multiple of 8 (the wgmma K granule for 16-bit inputs).
    """

    block_q: int = 64
    min_block_kv: int = 64

    def __post_init__(self) -> None:
        _check_positive_multiple("block_q", self.block_q, 64)
        _check_positive_multiple("min_block_kv", self.min_block_kv, 8)


@dataclasses.dataclass(frozen=True)
class CopyTuning:
    """Whole-block copies (Mosaic GPU).

    smem_chunk_bytes  largest chunk one CTA stages through shared memory: a block's
                      `[H, T, D]` per (layer, field) when it fits, else `[T, D]` per head.
    """

    smem_chunk_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        _check_positive_multiple("smem_chunk_bytes", self.smem_chunk_bytes, 128)
        if self.smem_chunk_bytes > HOPPER_MAX_SMEM_BYTES:
            raise ValueError(f"smem_chunk_bytes must be <= {HOPPER_MAX_SMEM_BYTES} (Hopper's shared memory per CTA), "
                             f"got {self.smem_chunk_bytes}")


DEFAULT_ATTENTION_TUNING = AttentionTuning()
DEFAULT_COPY_TUNING = CopyTuning()
