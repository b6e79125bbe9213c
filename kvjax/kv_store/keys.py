"""Store keys: a namespace digest of what makes KV bytes differ, plus the block's chained hash.

A block's chained hash (`kvjax.ledger.block_key`, the same identity kvjax's KV events and router
use) already folds in the block's tokens, every earlier block, its extra ids, its LoRA task id,
its cache salt and its multimodal keys: with the default `sha256` chain each enters the
canonical encoding of every block, with `trtllm64` the LoRA id enters every block and the salt
the first one (the chain carries it on). Those request isolation keys therefore need no place
in the namespace. What the hash does not see is what turns the same tokens into different
bytes: the model, the KV dtype, the block size, the pool layout, which layers and KV heads a
value holds (a tensor-parallel rank holds a head range, so ranks that hold the same heads share
keys, as in SGLang's unified key scheme), the hash formula itself and this key format's
version. `StoreNamespace` names those; `block_store_key` joins its digest with the hash.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from kvjax.config import CacheConfig, PoolSpec
from kvjax.kv_store.interface import KEY_PATTERN

KEY_VERSION = 1
KEY_PREFIX = "kvjax"
NAMESPACE_DIGEST_HEX = 32  # 128 bits of SHA-256: namespaces never collide by accident
_LAYOUTS = ("block_first", "layer_first")
_HASHES = ("sha256", "trtllm64")


def _int_range(name: str, value: object) -> tuple[int, int]:
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or not 0 <= value[0] < value[1]
    ):
        raise ValueError(f"{name} must be a (start, end) tuple of ints with 0 <= start < end, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class StoreNamespace:
    """Everything besides the chained block hash that decides a stored block's bytes.

    `model` names the weights (a Hugging Face repo id plus revision, or a digest of the
    checkpoint: two fine-tunes of one architecture must differ). `dtype` is the KV storage
    dtype ("bfloat16", "float8_e4m3fn" with its scales, ...). `layers` are the model's layer
    indices one value holds, in order; `kv_heads` the `[start, end)` KV-head range (one TP
    rank's shard). `layout` is the pool layout the bytes follow, `kv_factor` 2 for K and V,
    1 for K only. `extra` carries anything else a deployment knows changes the bytes (a
    quantisation recipe, a RoPE variant) as sorted (name, value) string pairs.
    """

    model: str
    dtype: str
    tokens_per_block: int
    layers: tuple[int, ...]
    kv_heads: tuple[int, int]
    head_dim: int
    layout: str = "block_first"
    kv_factor: int = 2
    hash_algorithm: str = "sha256"
    extra: tuple[tuple[str, str], ...] = ()
    key_version: int = KEY_VERSION

    def __post_init__(self) -> None:
        for name in ("model", "dtype"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a non-empty str, got {v!r}")
        for name in ("tokens_per_block", "head_dim", "key_version"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if (
            not isinstance(self.layers, tuple)
            or not self.layers
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.layers)
            or list(self.layers) != sorted(set(self.layers))
        ):
            raise ValueError(f"layers must be a non-empty tuple of distinct non-negative ints in order, got {self.layers!r}")
        _int_range("kv_heads", self.kv_heads)
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {self.layout!r}")
        if self.kv_factor not in (1, 2) or isinstance(self.kv_factor, bool):
            raise ValueError(f"kv_factor must be 1 or 2, got {self.kv_factor!r}")
        if self.hash_algorithm not in _HASHES:
            raise ValueError(f"hash_algorithm must be one of {_HASHES}, got {self.hash_algorithm!r}")
        if not isinstance(self.extra, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in self.extra
        ):
            raise ValueError(f"extra must be a tuple of (str, str) pairs, got {self.extra!r}")
        if list(self.extra) != sorted(set(self.extra)) or len({k for k, _ in self.extra}) != len(self.extra):
            raise ValueError(f"extra must be sorted by name with each name once, got {self.extra!r}")

    def canonical(self) -> bytes:
        """The bytes the digest covers: every field by name, as sorted-key JSON."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")

    def digest(self) -> str:
        """`NAMESPACE_DIGEST_HEX` hex digits of SHA-256 over `canonical()`."""
        return hashlib.sha256(b"kvjax/kv-store-namespace\0" + self.canonical()).hexdigest()[:NAMESPACE_DIGEST_HEX]

    def prefix(self) -> str:
        """The part every key of this namespace starts with (what a store can list or drop)."""
        return f"{KEY_PREFIX}{self.key_version}-{self.digest()}-"


def block_hash_hex(block_hash: bytes | int, hash_algorithm: str) -> str:
    """A chained block hash as fixed-width lowercase hex: 64 digits for a 32-byte SHA-256
    hash, 16 for a TensorRT-LLM 64-bit one. Refuses a hash of the other formula."""
    if hash_algorithm == "sha256":
        if not isinstance(block_hash, (bytes, bytearray)) or len(block_hash) != 32:
            raise ValueError(f"a sha256 block hash is 32 bytes, got {block_hash!r}")
        return bytes(block_hash).hex()
    if hash_algorithm == "trtllm64":
        if isinstance(block_hash, bool) or not isinstance(block_hash, int) or not 0 <= block_hash < 1 << 64:
            raise ValueError(f"a trtllm64 block hash is an int in [0, 2**64), got {block_hash!r}")
        return f"{block_hash:016x}"
    raise ValueError(f"hash_algorithm must be one of {_HASHES}, got {hash_algorithm!r}")


def block_store_key(namespace: StoreNamespace, block_hash: bytes | int) -> str:
    """The store key of one block: `kvjax<version>-<namespace digest>-<block hash hex>`."""
    key = namespace.prefix() + block_hash_hex(block_hash, namespace.hash_algorithm)
    assert KEY_PATTERN.fullmatch(key), key
    return key


def block_store_keys(namespace: StoreNamespace, block_hashes: list[bytes] | list[int]) -> list[str]:
    """`block_store_key` for a request's chain of hashes (one digest for all of them)."""
    prefix = namespace.prefix()
    return [prefix + block_hash_hex(h, namespace.hash_algorithm) for h in block_hashes]


def namespace_for_pool(
    config: CacheConfig,
    pool: PoolSpec,
    *,
    model: str,
    kv_heads: tuple[int, int] | None = None,
    extra: tuple[tuple[str, str], ...] = (),
) -> StoreNamespace:
    """The namespace of one pool of a kvjax cache: dtype, block size, layout, K/V factor and
    hash formula from `config`, layers and head dim from `pool`. `kv_heads` is this rank's
    `[start, end)` KV-head range under tensor parallelism (default: all of the pool's heads).
    A non-default cache type or sink length changes what a block holds, so it joins `extra`."""
    if not isinstance(pool, PoolSpec) or pool not in config.pools:
        raise ValueError(f"pool must be one of config.pools, got {pool!r}")
    heads = (0, pool.num_kv_heads) if kv_heads is None else kv_heads
    if _int_range("kv_heads", heads)[1] > pool.num_kv_heads:
        raise ValueError(f"kv_heads {heads} exceeds the pool's {pool.num_kv_heads} KV heads")
    more = dict(extra)
    if len(more) != len(extra):
        raise ValueError(f"extra names must be unique, got {extra!r}")
    if config.cache_type != "self":
        more.setdefault("cache_type", config.cache_type)
    if config.sink_token_length:
        more.setdefault("sink_token_length", str(config.sink_token_length))
    return StoreNamespace(
        model=model, dtype=config.dtype, tokens_per_block=config.tokens_per_block, layers=tuple(pool.layers),
        kv_heads=heads, head_dim=pool.head_dim, layout=config.layout, kv_factor=config.kv_factor,
        hash_algorithm=config.event_hash, extra=tuple(sorted(more.items())),
    )
