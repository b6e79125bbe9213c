"""The host ledger: block metadata, radix tree, eviction and sequence bookkeeping (no JAX)."""
from kvjax.ledger.transfer_plan import TransferKind, TransferOp, TransferPlan, TransferRecorder
from kvjax.ledger.block import PLACEHOLDER_BLOCK_ID, Block
from kvjax.ledger.block_key import (
    SHA256_ROOT_HASH,
    BlockHasher,
    BlockKey,
    MmKey,
    cache_salt_id,
    sha256_block_hash,
    trtllm64_block_hash,
)
from kvjax.ledger.eviction import LRUEvictionPolicy
from kvjax.ledger.events import (
    BlockHash,
    CreatedData,
    KVCacheEvent,
    RemovedData,
    StoredBlock,
    StoredData,
    UpdatedData,
)
from kvjax.ledger.kv_cache_manager import KVCacheManager, PrefixReuseSummary
from kvjax.ledger.radix_tree import RadixNode, UnifiedBlockTree
from kvjax.ledger.stats import IterationStats, KVCacheStats, RequestStats
from kvjax.ledger.transfer_failures import TransferFailure
from kvjax.ledger.window_manager import WindowBlockManager
from kvjax.ledger.block_manager import BlockManager
