"""`TokenPath`: a sequence's tokens as the radix tree compares them (compact bytes, one encoding
per admission or store), and the conversions between that encoding and `BlockKey`.

Tokens are encoded in *units*: a plain token is its int32 (4 bytes, native order); with extra
ids a unit is the token's int32 followed by the extra id's uint64 (12 bytes). Two blocks are
equal when their bytes are (one C-level compare) and share `n` leading tokens when their first
`n` units are. The constraint fields every block of a sequence shares (extra-id usage, LoRA
task, cache salt) form its *signature*; multimodal keys belong to single blocks. A tree node
is filed under its parent by `child_key`.
"""
from __future__ import annotations

import array
import struct
import sys

from kvjax._math import ceil_div
from kvjax.ledger.block_key import BlockKey, MmKey
from kvjax.ledger.packing import packer

PLAIN_UNIT = 4
EXTRA_UNIT = 12
PLAIN_SIGNATURE = (False, None, None)  # (uses extra ids, LoRA task id, cache salt id)
NATIVE_LITTLE = sys.byteorder == "little"
_EXTRA_PAIR = struct.Struct("<iQ")


def encode_tokens(tokens) -> bytes:
    """int32 units of token ids (a list or tuple of ints); `struct.error` for an id outside
    int32. (`struct.pack` converts a list about five times faster than `array`.)"""
    return packer(len(tokens))(*tokens)


def encode_with_extra(tokens, extra_ids) -> bytes:
    """12-byte units: each token's int32 then its extra id's uint64 (little-endian)."""
    pack = _EXTRA_PAIR.pack
    return b"".join([pack(t, e) for t, e in zip(tokens, extra_ids, strict=True)])


def decode_units(content: bytes, uses_extra: bool) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(tokens, extra ids or None) of encoded units."""
    if not uses_extra:
        return tuple(array.array("i", content)), None
    pairs = list(_EXTRA_PAIR.iter_unpack(content))
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def common_units(a: bytes, b: bytes, unit: int) -> int:
    """Number of leading units two encodings share (one XOR of their common length)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // unit
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return (n - (x.bit_length() + 7) // 8) // unit


def child_key(sid: int, first: bytes, mm: tuple) -> bytes | tuple:
    """Key of a radix-tree node under its parent: its first block's encoded tokens (plain
    signature, no multimodal keys), else the interned signature id, those bytes and the
    block's multimodal keys. Every filing and lookup of a child goes through here."""
    return first if sid == 0 and not mm else (sid, first, mm)


def block_key(content: bytes, signature: tuple, mm_keys: tuple = ()) -> BlockKey:
    """The `BlockKey` of one block's encoded tokens under `signature`."""
    uses_extra, lora, salt = signature
    tokens, extra = decode_units(content, uses_extra)
    return BlockKey(tokens, extra, lora, salt, mm_keys)


class TokenPath:
    """Encoded tokens `[base_block * tokens_per_block, num_tokens)` of one sequence, its
    signature and, for multimodal requests, each block's multimodal keys."""

    __slots__ = ("content", "base", "signature", "unit", "block_bytes", "num_tokens", "tokens_per_block", "mm")

    def __init__(
        self, content: bytes, base: int, signature: tuple, tokens_per_block: int, num_tokens: int, mm: dict | None
    ) -> None:
        self.content = content
        self.base = base  # first block the content covers
        self.signature = signature
        self.unit = EXTRA_UNIT if signature[0] else PLAIN_UNIT
        self.block_bytes = self.unit * tokens_per_block
        self.num_tokens = num_tokens
        self.tokens_per_block = tokens_per_block
        self.mm = mm  # block index -> multimodal keys (only blocks overlapping an item); None if none

    def block(self, d: int) -> bytes:
        """Encoded tokens of block `d` (shorter than a full block at the end of the path)."""
        bb = self.block_bytes
        o = (d - self.base) * bb
        return self.content[o : o + bb]

    def prefix(self, d: int, num_tokens: int) -> bytes:
        """The first `num_tokens` tokens of block `d`."""
        o = (d - self.base) * self.block_bytes
        return self.content[o : o + num_tokens * self.unit]

    def mm_keys(self, d: int) -> tuple:
        mm = self.mm
        return () if mm is None else mm.get(d, ())


def mm_keys_by_block(mm_items, tokens_per_block: int, first_block: int, end_token: int) -> dict | None:
    """Block index -> the multimodal keys of that block (each item's hash and the offset, in
    the item, of the block's first overlapping position), for blocks from `first_block` that
    start before `end_token`."""
    if not mm_items:
        return None
    out: dict[int, list] = {}
    tpb = tokens_per_block
    for item in mm_items:  # request order, as `BlockKey.mm_keys` has it
        if item.start >= end_token:
            continue
        lo = max(item.start // tpb, first_block)
        hi = min(ceil_div(item.start + item.length, tpb), ceil_div(end_token, tpb))
        for d in range(lo, hi):
            start = d * tpb
            out.setdefault(d, []).append(MmKey(item.hash, max(start, item.start) - item.start))
    return {d: tuple(keys) for d, keys in out.items()} or None
