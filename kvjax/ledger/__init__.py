"""The host ledger: block metadata, radix tree, eviction and sequence bookkeeping (no JAX).

`KVCacheManager` is the API (docs/semantics.md); the rest of `__all__` are the types its
calls take and return, and the block-key and block-hash helpers routers share with it.
"""
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID
from kvjax.ledger.block_hashing import (
    SHA256_ROOT_HASH,
    BlockHasher,
    prompt_block_hashes,
    sha256_block_hash,
    trtllm64_block_hash,
)
from kvjax.ledger.block_key import BlockKey, MmKey, cache_salt_id
from kvjax.ledger.events import (
    BlockHash,
    CreatedData,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredColumns,
    StoredData,
    UpdatedData,
)
from kvjax.ledger.host_notices import HostNotice, HostNoticeKind
from kvjax.ledger.inspection import BlockInfo, LedgerInspector, TreeSize
from kvjax.ledger.kv_cache_manager import KVCacheManager
from kvjax.ledger.pending_tokens import PENDING_TOKEN
from kvjax.ledger.recurrent import RecurrentStep
from kvjax.ledger.scheduler_queries import PrefixReuseSummary
from kvjax.ledger.stats import IterationStats, KVCacheStats, RequestStats
from kvjax.ledger.tier3 import Restore
from kvjax.ledger.transfer_failures import TransferFailure
from kvjax.transfer_plan import TransferKind, TransferOp, TransferPlan

__all__ = [
    "PENDING_TOKEN",
    "PLACEHOLDER_BLOCK_ID",
    "SHA256_ROOT_HASH",
    "BlockHash",
    "BlockHasher",
    "BlockInfo",
    "BlockKey",
    "CreatedData",
    "HostNotice",
    "HostNoticeKind",
    "IterationStats",
    "KVCacheEvent",
    "KVCacheManager",
    "KVCacheStats",
    "LedgerInspector",
    "MmKey",
    "PrefixReuseSummary",
    "RecurrentStep",
    "RemovedData",
    "RequestStats",
    "Restore",
    "StoredBlock",
    "StoredColumns",
    "StoredData",
    "TransferFailure",
    "TransferKind",
    "TransferOp",
    "TransferPlan",
    "TreeSize",
    "UpdatedData",
    "cache_salt_id",
    "prompt_block_hashes",
    "sha256_block_hash",
    "trtllm64_block_hash",
]
