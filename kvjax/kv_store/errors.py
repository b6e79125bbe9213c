"""Typed errors of the third KV tier's store layer.

Bad input (a malformed key, a buffer of the wrong kind, an unparsable URL) raises one of these
before any state changes; per-key I/O outcomes (a miss, a failed write) are `False` results, not
exceptions, so one bad block never hides the others of a batch.
"""
from __future__ import annotations

from kvjax.errors import KVCacheError


class KVStoreError(KVCacheError):
    """Base class of every error the `kvjax.kv_store` package raises on purpose."""


class StoreKeyError(KVStoreError, ValueError):
    """A key is not a string of the allowed characters and length, or a batch repeats one."""


class StoreBufferError(KVStoreError, ValueError):
    """A buffer is not a contiguous bytes-like object (or not writable where it must be), or
    `keys` and `buffers` differ in length."""


class StoreURLError(KVStoreError, ValueError):
    """`load_store` could not parse a store URL, import its class or accept its parameters."""


class StoreClosedError(KVStoreError, RuntimeError):
    """The store or worker was closed; no further calls are accepted."""


class StoreIOError(KVStoreError, OSError):
    """A whole batch failed below the store (connection lost, server error)."""


class WorkerFullError(KVStoreError, RuntimeError):
    """`StoreWorker` already holds `max_pending` unpolled jobs: poll before submitting more."""
