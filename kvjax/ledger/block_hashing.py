"""Chained block hashes, the one home of both formulas events publish (see docs/semantics.md,
"Events and block hashes").

SHA-256 (the default, collision-resistant) digests the parent hash and a canonical encoding of
the whole key; `plain_block_hashes` writes that same encoding straight from the radix tree's
int32 units for plain blocks (the usual case, with no `BlockKey` built). TensorRT-LLM's 64-bit
`BlockKeyHasher` (`trtllm64_block_hash`) is kept for routers that recompute it. A router hashes
a prompt as a ledger does with `prompt_block_hashes`.
"""
from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Callable
from typing import Any

from kvjax.ledger.block_key import BlockKey, cache_salt_id

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B9


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


def _token_mix(t: int) -> int:
    """The seed-independent half of hash32Mix: the token's 32-bit mix plus the constant."""
    a = t & _M32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
    a = (((a >> 16) ^ a) * 0x45D9F3B) & _M32
    return (((a >> 16) ^ a) + _GOLDEN) & _M32


def trtllm64_block_hash(key: BlockKey, parent_hash: int = 0, memo: dict[int, int] | None = None) -> int:
    """TensorRT-LLM's `BlockKeyHasher::hash(key, parentHash)`: h_i = H(key_i, h_{i-1}), root 0.

    64 bits and not collision-resistant (a 1-token block with extra id e and one with LoRA id e
    hash alike); kept for routers that recompute TensorRT-LLM's hashes. `memo` caches each
    token id's seed-independent mix (bounded by its owner, see `BlockHasher`)."""
    seed = (len(key.tokens) ^ ((parent_hash * 0xBF58476D1CE4E5B9) & _M64)) & _M64
    if parent_hash == 0 and key.cache_salt_id is not None:
        seed = _mix64(key.cache_salt_id, seed)
    if key.extra_ids is None and memo is not None:
        for t in key.tokens:
            v = memo.get(t)
            if v is None:
                v = _token_mix(t)
                if len(memo) < TOKEN_MEMO_MAX:
                    memo[t] = v
            seed ^= (v + ((seed << 6) & _M64) + (seed >> 2)) & _M64
    elif key.extra_ids is None:
        for t in key.tokens:
            seed ^= (_token_mix(t) + ((seed << 6) & _M64) + (seed >> 2)) & _M64
    else:
        for t, e in zip(key.tokens, key.extra_ids, strict=True):
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


# ---------------------------------------------------------------------------- SHA-256
# The canonical encoding of a key: its fields in a fixed order, each introduced by a tag byte,
# every variable-length part preceded by its length, so the encoding can be parsed back
# unambiguously and two different keys never encode alike (a LoRA id can never pass for an
# extra id, a token run never runs into the next field). Absent fields have their own tag.
SHA256_ROOT_HASH = hashlib.sha256(b"kvjax/block-hash/sha256/v1").digest()  # parent of depth-1 blocks
_U32 = struct.Struct("<I")
_U32_CODE = next(c for c in "IL" if array.array(c).itemsize == 4)
_SWAP = sys.byteorder != "little"
_PLAIN_TAIL = b"elsM" + _U32.pack(0)  # no extra ids, no LoRA, no salt, no multimodal items
_sha256 = hashlib.sha256


class _TokenHeads(dict[int, bytes]):
    """Token count -> the tag and length that introduce a run of that many int32 token ids
    (made on first use; counts go up to tokens per block), read with one dict lookup."""

    def __missing__(self, n: int) -> bytes:
        head = self[n] = b"T" + _U32.pack(n)
        return head


_token_head = _TokenHeads()


def _int_field(v: int) -> bytes:
    """Any int (negative or huge too): byte count, then two's complement little-endian."""
    n = (v.bit_length() + 8) // 8
    return _U32.pack(n) + v.to_bytes(n, "little", signed=True)


def canonical_key_bytes(key: BlockKey) -> bytes:
    """The encoding `sha256_block_hash` digests after the parent hash (see the note above)."""
    tokens = key.tokens
    try:  # token ids are ints in [0, 2**31) once validated: four bytes each, little-endian
        packed = array.array(_U32_CODE, tokens)
        if _SWAP:
            packed.byteswap()
        head = _token_head[len(tokens)] + packed.tobytes()
    except (OverflowError, TypeError):
        head = b"t" + _U32.pack(len(tokens)) + b"".join(_int_field(t) for t in tokens)
    if key.extra_ids is None and key.lora_task_id is None and key.cache_salt_id is None and not key.mm_keys:
        return head + _PLAIN_TAIL
    parts = [head]
    if key.extra_ids is None:
        parts.append(b"e")
    else:
        parts.append(b"E" + _U32.pack(len(key.extra_ids)))
        parts.extend(_int_field(e) for e in key.extra_ids)
    parts.append(b"l" if key.lora_task_id is None else b"L" + _int_field(key.lora_task_id))
    parts.append(b"s" if key.cache_salt_id is None else b"S" + _int_field(key.cache_salt_id))
    parts.append(b"M" + _U32.pack(len(key.mm_keys)))
    for mm in key.mm_keys:
        parts.append(_U32.pack(len(mm.hash)) + bytes(mm.hash) + _int_field(mm.start_offset))
    return b"".join(parts)


def sha256_block_hash(key: BlockKey, parent_hash: bytes | None = None) -> bytes:
    """SHA-256 over the parent hash (32 bytes; `SHA256_ROOT_HASH` at the root, also for None)
    and the canonical encoding of the whole key: collision-resistant like vLLM's block hashes
    after CVE-2025-25183."""
    parent = SHA256_ROOT_HASH if parent_hash is None else parent_hash
    if len(parent) != 32:
        raise ValueError(f"a SHA-256 parent hash has 32 bytes, got {len(parent)}")
    return hashlib.sha256(parent + canonical_key_bytes(key)).digest()


def plain_block_hash(parent: bytes, units: bytes) -> bytes:
    """`sha256_block_hash` of a plain block (no extra ids, LoRA task, cache salt or multimodal
    keys) chained from `parent`, given its token ids as little-endian int32 `units`: the
    canonical encoding written from those bytes directly (the radix tree stores tokens that
    way), with no `BlockKey` built."""
    return _sha256(b"".join((parent, _token_head[len(units) >> 2], units, _PLAIN_TAIL))).digest()


def plain_block_hashes(parent: bytes, units: bytes, block_bytes: int) -> list[bytes]:
    """`plain_block_hash` of each block of `units` (whole blocks of `block_bytes` bytes, then
    at most one partial block), chained from `parent`. The whole blocks are hashed in one loop
    that looks their common head up once and splits them in C."""
    size = len(units)
    full = size - size % block_bytes
    out: list[bytes] = []
    h = parent
    if full:
        split = _splitters.get(block_bytes)
        if split is None:
            split = _splitters[block_bytes] = struct.Struct(f"{block_bytes}s").iter_unpack
        append, join, head, tail = out.append, b"".join, _token_head[block_bytes >> 2], _PLAIN_TAIL
        for (blk,) in split(units if full == size else units[:full]):
            h = _sha256(join((h, head, blk, tail))).digest()  # plain_block_hash(h, blk)
            append(h)
    if full < size:
        out.append(plain_block_hash(h, units[full:]))
    return out


_splitters: dict[int, Callable] = {}  # block bytes -> iter_unpack of whole blocks (one per block size)


# ---------------------------------------------------------------------------- per-manager hasher
HASH_ALGORITHMS = ("sha256", "trtllm64")
TOKEN_MEMO_MAX = 1 << 15  # token ids memoised by one trtllm64 hasher (about 3 MB at most)


class BlockHasher:
    """The chained block hash of one manager (`CacheConfig.event_hash`): `root` is the parent
    hash of depth-1 blocks, `hash(key, parent)` the next link. SHA-256 hashes are 32 `bytes`,
    TensorRT-LLM ones `int`s in [0, 2**64). Owns the trtllm64 token memo, so the memo is bounded
    and dies with its manager."""

    __slots__ = ("algorithm", "root", "memo", "hash", "plain_units", "__weakref__")

    def __init__(self, algorithm: str = "sha256") -> None:
        if algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash algorithm must be one of {HASH_ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        # `plain_block_hash` may hash native int32 units: SHA-256 on a little-endian host
        self.plain_units = algorithm == "sha256" and not _SWAP
        self.memo: dict[int, int] = {}
        # (key, parent hash) -> hash; the parent is always a hash of the same algorithm (`root` or
        # an earlier result), which only the algorithm's name tells apart
        self.hash: Callable[[BlockKey, Any], bytes | int]
        if algorithm == "sha256":
            self.root: bytes | int = SHA256_ROOT_HASH
            self.hash = sha256_block_hash
        else:
            self.root = 0
            memo = self.memo
            self.hash = lambda key, parent: trtllm64_block_hash(key, parent, memo)


def prompt_block_hashes(
    tokens,
    tokens_per_block: int,
    *,
    lora_task_id: int | None = None,
    cache_salt: str | int | None = None,
    hash_kind: str = "sha256",
    for_reuse: bool = True,
) -> list[bytes] | list[int]:
    """Chained hashes of a plain prompt's full blocks, as a ledger with `event_hash=hash_kind`
    publishes them in its events.

    A router calls this to look a request up in an index fed by events: block `i` of the result
    equals the `block_hash` a ledger emits for that block (same tokens, LoRA task and cache salt;
    no extra ids or multimodal keys). With `for_reuse` (the default) only the blocks admission
    can match are hashed: the last prompt token is always recomputed, so those are the full
    blocks of the first `len(tokens) - 1` tokens.
    """
    if hash_kind not in HASH_ALGORITHMS:
        raise ValueError(f"hash_kind must be one of {HASH_ALGORITHMS}, got {hash_kind!r}")
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")
    hasher = BlockHasher(hash_kind)
    tokens = tuple(tokens)
    usable = max(len(tokens) - 1, 0) if for_reuse else len(tokens)
    salt = cache_salt_id(cache_salt)
    out: list[Any] = []  # all bytes (sha256) or all ints (trtllm64)
    parent = hasher.root
    for start in range(0, usable // tokens_per_block * tokens_per_block, tokens_per_block):
        key = BlockKey(tokens[start : start + tokens_per_block], None, lora_task_id, salt, ())
        parent = hasher.hash(key, parent)
        out.append(parent)
    return out
