"""A third KV-cache tier under the host tier: stores (memory, files, Redis, user classes), the
keys blocks are stored under, a non-blocking job layer and SGLang-style write/prefetch policies.

Pure Python + numpy, no JAX: the engine hands host blocks over as numpy views. See
docs/kv_store.md for the contracts and for what is wired into the engine so far.
"""
from kvjax.kv_store.errors import (
    KVStoreError,
    StoreBufferError,
    StoreClosedError,
    StoreIOError,
    StoreKeyError,
    StoreURLError,
    WorkerFullError,
)
from kvjax.kv_store.faulty import FaultyStore
from kvjax.kv_store.file import FileStore
from kvjax.kv_store.interface import KEY_PATTERN, KVStore, check_keys
from kvjax.kv_store.keys import KEY_VERSION, StoreNamespace, block_store_key, block_store_keys, namespace_for_pool
from kvjax.kv_store.memory import MemoryStore
from kvjax.kv_store.policies import PREFETCH_POLICIES, WRITE_POLICIES, PrefetchDecision, PrefetchPolicy, WritePolicy
from kvjax.kv_store.stats import StoreStats
from kvjax.kv_store.tier import PrefetchState, StoreTier, TierStep
from kvjax.kv_store.url import load_store
from kvjax.kv_store.worker import JobHandle, JobKind, JobResult, StoreWorker

__all__ = [
    "FaultyStore", "FileStore", "JobHandle", "JobKind", "JobResult", "KEY_PATTERN", "KEY_VERSION", "KVStore",
    "KVStoreError", "MemoryStore", "PREFETCH_POLICIES", "PrefetchDecision", "PrefetchPolicy", "PrefetchState",
    "StoreBufferError", "StoreClosedError", "StoreIOError", "StoreKeyError", "StoreNamespace", "StoreStats",
    "StoreTier", "StoreURLError", "StoreWorker", "TierStep", "WRITE_POLICIES", "WorkerFullError",
    "WritePolicy", "block_store_key", "block_store_keys", "check_keys", "load_store", "namespace_for_pool",
]


def __getattr__(name: str):
    """`RedisStore` is imported on first use, so the package imports without redis-py."""
    if name == "RedisStore":
        from kvjax.kv_store.redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
