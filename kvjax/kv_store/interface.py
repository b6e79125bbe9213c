"""The store interface users implement: bytes in and out under string keys, in batches.

The shape is the common ground of SGLang's `HiCacheStorage` (`batch_exists` = longest present
prefix, `batch_get_v1`/`batch_set_v1` into host pages), LMCache's storage backends and Mooncake's
`batch_put_from`/`batch_get_into`: the engine hands over views of host blocks, a store copies
bytes, never arrays. Anything that has these five methods is a store (`KVStore` is a
`typing.Protocol`); `BaseKVStore` adds the argument checks every built-in store shares.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvjax.kv_store.errors import StoreBufferError, StoreKeyError

# Keys are used as file names and Redis keys unchanged, so they are kept to a portable alphabet
# and a length that leaves room for a temp suffix under the usual 255-byte file-name limit.
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
MAX_KEY_LENGTH = 200


@runtime_checkable
class KVStore(Protocol):
    """A third-tier KV store. Contract every implementation keeps:

    * **Keys** are strings matching `KEY_PATTERN` (`check_keys`); values are opaque bytes.
    * **Atomicity**: a key is either absent or holds the complete bytes of one `batch_put`;
      no reader ever sees a partially written value (a crashed or failed put leaves the key
      absent, or holding its previous complete value).
    * **Sizes**: `batch_get_into` succeeds for a key only when its stored size equals the
      target buffer's size; anything else is `False` for that key.
    * **Results** are per key: `False` means "not done" (missing, failed, size mismatch) and
      the caller must not use that buffer's content. Whole-batch failures below the store may
      raise `StoreIOError`. Malformed arguments raise `StoreKeyError`/`StoreBufferError`
      before anything is read or written.
    * **Threads**: every method may be called concurrently from several threads
      (`StoreWorker` runs a pool); implementations lock what they share.
    * **Eviction**: a store may drop any key at any time (bounded stores evict LRU), so a
      positive `batch_exists` is a hint, and `batch_get_into` is the authority.
    """

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` whose keys are all present."""
        ...

    def batch_put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Store `bytes(buffers[i])` under `keys[i]`; True where the value is now complete and
        readable. Buffers are read during the call only (the caller keeps them alive until it
        returns); keys must not repeat within one call."""
        ...

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[bool]:
        """Copy each key's value into the caller's writable contiguous buffer (a numpy array,
        bytearray or memoryview of a host block); True where the buffer now holds exactly the
        stored bytes. A False buffer's content is undefined."""
        ...

    def remove(self, keys: Sequence[str]) -> int:
        """Delete the keys that exist; returns how many were removed."""
        ...

    def close(self) -> None:
        """Release connections and handles; later calls raise `StoreClosedError`."""
        ...


def check_keys(keys: Sequence[str], *, unique: bool = False) -> list[str]:
    """The keys as a list, after checking each against `KEY_PATTERN` (and, for puts, that none
    repeats: two values for one key in one batch have no defined winner)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise StoreKeyError(f"keys must be a sequence of str, got {type(keys).__name__}")
    out = list(keys)
    for k in out:
        if not isinstance(k, str) or KEY_PATTERN.fullmatch(k) is None:
            raise StoreKeyError(
                f"invalid store key {k!r}: keys are 1-{MAX_KEY_LENGTH} characters of [A-Za-z0-9._:-] starting alphanumeric"
            )
    if unique and len(set(out)) != len(out):
        seen: set[str] = set()
        for k in out:
            if k in seen:
                raise StoreKeyError(f"key {k!r} appears twice in one batch_put")
            seen.add(k)
    return out


def byte_view(buf: Any, *, writable: bool, what: str = "buffer") -> memoryview:
    """A flat unsigned-byte view of `buf` without copying. Refuses non-contiguous buffers (a
    copy would make `batch_get_into` fill the copy, not the caller's block) and, when
    `writable`, read-only ones."""
    if isinstance(buf, np.ndarray):  # also ml_dtypes arrays (bfloat16, fp8), which memoryview refuses
        if buf.dtype.hasobject:
            raise StoreBufferError(f"{what} holds Python objects, not bytes")
        if not buf.flags.c_contiguous:
            raise StoreBufferError(f"{what} must be C-contiguous (a host block view, not a strided slice)")
        if writable and not buf.flags.writeable:
            raise StoreBufferError(f"{what} must be writable for batch_get_into")
        return memoryview(buf.reshape(-1).view(np.uint8))
    try:
        mv = memoryview(buf)
    except TypeError:
        raise StoreBufferError(f"{what} must support the buffer protocol, got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise StoreBufferError(f"{what} must be C-contiguous (a host block view, not a strided slice)")
    if writable and mv.readonly:
        raise StoreBufferError(f"{what} must be writable for batch_get_into")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def check_batch(keys: Sequence[str], buffers: Sequence[Any], *, writable: bool) -> tuple[list[str], list[memoryview]]:
    """Checked keys and flat byte views of their buffers, in one step shared by all stores."""
    ks = check_keys(keys, unique=not writable)
    if isinstance(buffers, (bytes, bytearray, memoryview)) or not isinstance(buffers, Sequence):
        raise StoreBufferError(f"buffers must be a sequence of buffers, got {type(buffers).__name__}")
    if len(buffers) != len(ks):
        raise StoreBufferError(f"{len(ks)} keys but {len(buffers)} buffers")
    views = [byte_view(b, writable=writable, what=f"buffers[{i}]") for i, b in enumerate(buffers)]
    return ks, views


def longest_present_prefix(present: Sequence[bool]) -> int:
    """Number of leading True entries: SGLang's `batch_exists` answer from per-key answers."""
    n = 0
    for p in present:
        if not p:
            break
        n += 1
    return n
