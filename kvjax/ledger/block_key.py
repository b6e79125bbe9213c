"""`BlockKey`: what a cached block's tokens mean, and the chained 64-bit block hash.

Keys are compared, not hashed with a cryptographic digest: the radix tree looks children up by
key equality (a C-level tuple compare), so the 64-bit TensorRT-LLM-compatible block hash is
only computed when events or a router need it.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B9


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
    def uses_extra_ids(self) -> bool:
        return self.extra_ids is not None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def supports_partial_matching(self) -> bool:
        return not self.mm_keys

    def constraints(self) -> tuple:
        return (self.extra_ids is not None, self.lora_task_id, self.cache_salt_id, self.mm_keys)

    def num_matching_tokens(self, other: BlockKey) -> int:
        """Length of the common leading run of unique tokens (token and extra id); 0 unless
        every constraint field agrees."""
        if (
            self.lora_task_id != other.lora_task_id
            or self.cache_salt_id != other.cache_salt_id
            or self.mm_keys != other.mm_keys
            or (self.extra_ids is None) != (other.extra_ids is None)
        ):
            return 0
        return common_prefix_length(self, other)

    def shorten(self, n: int) -> BlockKey:
        """The key of the first `n` tokens; multimodal keys cannot be shortened."""
        if self.mm_keys:
            raise ValueError("a block key with multimodal extra keys cannot be partially matched")
        return self._replace(
            tokens=self.tokens[:n], extra_ids=None if self.extra_ids is None else self.extra_ids[:n]
        )


def common_prefix_length(a: BlockKey, b: BlockKey) -> int:
    """Common leading tokens (and extra ids when used) of two keys with equal constraints."""
    ta, tb = a.tokens, b.tokens
    n = min(len(ta), len(tb))
    if ta[:n] == tb[:n]:
        k = n
    else:
        k = 0
        while ta[k] == tb[k]:
            k += 1
    ea, eb = a.extra_ids, b.extra_ids
    if ea is not None and eb is not None and ea[:k] != eb[:k]:
        j = 0
        while ea[j] == eb[j]:
            j += 1
        k = j
    return k


def partial_index_key(key: BlockKey) -> tuple | None:
    """Bucket under which a child can partially match: its first unique token and constraints.
    Keys with multimodal extra keys never partially match (None)."""
    if key.mm_keys or not key.tokens:
        return None
    first_extra = None if key.extra_ids is None else key.extra_ids[0]
    return (key.tokens[0], first_extra, key.extra_ids is not None, key.lora_task_id, key.cache_salt_id)


def cache_salt_id(salt: str | int | None) -> int | None:
    """Stable 64-bit id of a cache salt (a string is digested, so ids agree across processes)."""
    if salt is None:
        return None
    if isinstance(salt, int):
        return salt & _M64
    return int.from_bytes(hashlib.blake2b(salt.encode("utf-8"), digest_size=8).digest(), "little")


def _mix32(a: int, seed: int) -> int:
    a &= _M32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
    a = (a >> 16) ^ a
    v = (a + _GOLDEN) & _M32  # TensorRT-LLM adds the constant in 32 bits before widening
    return seed ^ ((v + ((seed << 6) & _M64) + (seed >> 2)) & _M64)


def _mix64(c: int, seed: int) -> int:
    c &= _M64
    c = ((c ^ (c >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    c = ((c ^ (c >> 27)) * 0x94D049BB133111EB) & _M64
    c ^= c >> 31
    return seed ^ ((c + _GOLDEN + ((seed << 6) & _M64) + (seed >> 2)) & _M64)


_TOKEN_MIX: dict[int, int] = {}  # token id -> its 32-bit mixed value + constant (seed-independent)
_TOKEN_MIX_MAX = 1 << 20


def _token_mix(t: int) -> int:
    a = t & _M32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
    v = (((a >> 16) ^ a) + _GOLDEN) & _M32
    if len(_TOKEN_MIX) < _TOKEN_MIX_MAX:
        _TOKEN_MIX[t] = v
    return v


def block_hash(key: BlockKey, parent_hash: int) -> int:
    """TensorRT-LLM's `BlockKeyHasher::hash(key, parentHash)`: h_i = H(key_i, h_{i-1}), root 0."""
    seed = (len(key.tokens) ^ ((parent_hash * 0xBF58476D1CE4E5B9) & _M64)) & _M64
    if parent_hash == 0 and key.cache_salt_id is not None:
        seed = _mix64(key.cache_salt_id, seed)
    if key.extra_ids is None:
        table = _TOKEN_MIX  # the token half of hash32Mix depends on the token alone: memoised
        for t in key.tokens:
            v = table.get(t)
            if v is None:
                v = _token_mix(t)
            seed ^= (v + ((seed << 6) & _M64) + (seed >> 2)) & _M64
    else:
        for t, e in zip(key.tokens, key.extra_ids):
            seed = _mix32(t, seed)
            seed = _mix64(e, seed)
    if key.lora_task_id is not None:
        seed = _mix64(key.lora_task_id, seed)
    for mm in key.mm_keys:
        h = mm.hash.ljust(32, b"\0")
        for i in range(0, 32, 4):
            seed = _mix32(int.from_bytes(h[i : i + 4], "little"), seed)
        seed = _mix64(mm.start_offset, seed)
    return seed


HASH_KINDS = ("trtllm",)  # the block hashes events carry: TensorRT-LLM's 64-bit chained hash


def prompt_block_hashes(
    tokens,
    tokens_per_block: int,
    *,
    lora_task_id: int | None = None,
    cache_salt: str | int | None = None,
    hash_kind: str = "trtllm",
    for_reuse: bool = True,
) -> list[int]:
    """Chained hashes of a plain prompt's full blocks, as the ledger's events publish them.

    A router calls this to look a request up in an index fed by events: block `i` of the result
    equals the `block_hash` a ledger emits for that block (same tokens, LoRA task and cache salt;
    no extra ids or multimodal keys). With `for_reuse` (the default) only the blocks admission
    can match are hashed: the last prompt token is always recomputed, so those are the full
    blocks of the first `len(tokens) - 1` tokens.
    """
    if hash_kind not in HASH_KINDS:
        raise ValueError(f"hash_kind must be one of {HASH_KINDS}, got {hash_kind!r}")
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")
    tokens = tuple(tokens)
    usable = max(len(tokens) - 1, 0) if for_reuse else len(tokens)
    salt = cache_salt_id(cache_salt)
    out: list[int] = []
    parent = 0
    for start in range(0, usable // tokens_per_block * tokens_per_block, tokens_per_block):
        key = BlockKey(tokens[start : start + tokens_per_block], None, lora_task_id, salt, ())
        parent = block_hash(key, parent)
        out.append(parent)
    return out
