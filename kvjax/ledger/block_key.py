"""`BlockKey`: what a cached block's tokens mean, and the id of a cache salt.

Keys are compared, not hashed: the radix tree looks children up by key equality (a C-level
compare of their encoded tokens), so a block hash is only computed when events need it
(`kvjax.ledger.block_hashing`).
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

_M64 = (1 << 64) - 1


class MmKey(NamedTuple):
    """A multimodal item overlapping a block: its 32-byte hash and the offset, inside the
    item's own run, of the first overlapping position."""

    hash: bytes
    start_offset: int


class BlockKey(NamedTuple):
    """Key of one block. `extra_ids` is None unless the request uses extra ids.

    Equality compares every field; only keys that agree on all constraint fields (extra-id
    usage, LoRA task, multimodal keys, cache salt) can share tokens.
    """

    tokens: tuple[int, ...]
    extra_ids: tuple[int, ...] | None = None
    lora_task_id: int | None = None
    cache_salt_id: int | None = None
    mm_keys: tuple[MmKey, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def cache_salt_id(salt: str | int | None) -> int | None:
    """Stable 64-bit id of a cache salt (a string is digested, so ids agree across processes)."""
    if salt is None:
        return None
    if isinstance(salt, int):
        return salt & _M64
    return int.from_bytes(hashlib.blake2b(salt.encode("utf-8"), digest_size=8).digest(), "little")
