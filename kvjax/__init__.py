"""kvjax: a paged KV-cache manager for LLM inference in JAX.

The host ledger (`kvjax.ledger`, pure Python) decides which block holds which tokens; the
device side (`kvjax.device`, JAX) keeps the KV pools and moves bytes as the ledger says.
`kvjax.LLM` (offline generation), `kvjax.LLMEngine` (the step-wise engine), `kvjax.Tokenizer`
and `kvjax.SamplingParams` serve text; `kvjax serve` is the OpenAI-compatible server.
Importing `kvjax` does not import JAX: the device and serving names below load on first use.
"""
from kvjax.config import CacheConfig, PoolSpec
from kvjax.errors import (
    ArgumentTypeError,
    DuplicateRequestError,
    IntegrityError,
    InvalidArgumentError,
    InvalidRequestError,
    KVCacheError,
    OutOfBlocksError,
    SchedulingStateError,
    TransferError,
    TransferSequenceError,
    UnknownBlockError,
    UnknownRequestError,
)
from kvjax.request import MultimodalItem, Request, RetentionConfig, TokenRangeRetention
from kvjax.transfer_plan import TransferKind, TransferOp, TransferPlan

_LEDGER_NAMES = {
    "KVCacheManager",
    "PrefixReuseSummary",
    "KVCacheEvent",
    "CreatedData",
    "StoredData",
    "StoredBlock",
    "RemovedData",
    "UpdatedData",
    "KVCacheStats",
    "RequestStats",
    "IterationStats",
    "TransferFailure",
}
_DEVICE_NAMES = {"KVPools", "allocate_pools", "apply_transfers", "write_kv", "gather_kv", "paged_attention"}
_SERVING_NAMES = {
    "LLM": "kvjax.llm",
    "Tokenizer": "kvjax.tokenizer",
    "SamplingParams": "kvjax.engine.sampling",
    "LLMEngine": "kvjax.engine.llm_engine",
    "RequestOutput": "kvjax.engine.outputs",
    "CompletionOutput": "kvjax.engine.outputs",
}


def __getattr__(name: str):
    if name in _LEDGER_NAMES:
        from kvjax import ledger

        return getattr(ledger, name)
    if name in _DEVICE_NAMES:
        from kvjax import device

        return getattr(device, name)
    if name in _SERVING_NAMES:
        import importlib

        return getattr(importlib.import_module(_SERVING_NAMES[name]), name)
    raise AttributeError(f"module 'kvjax' has no attribute {name!r}")


# the eager names as a literal list (so linters see them re-exported), then the lazy ones
__all__ = [
    "ArgumentTypeError",
    "CacheConfig",
    "DuplicateRequestError",
    "IntegrityError",
    "InvalidArgumentError",
    "InvalidRequestError",
    "KVCacheError",
    "MultimodalItem",
    "OutOfBlocksError",
    "PoolSpec",
    "Request",
    "RetentionConfig",
    "SchedulingStateError",
    "TokenRangeRetention",
    "TransferError",
    "TransferKind",
    "TransferOp",
    "TransferPlan",
    "TransferSequenceError",
    "UnknownBlockError",
    "UnknownRequestError",
]
__all__ += sorted(_LEDGER_NAMES | _DEVICE_NAMES | set(_SERVING_NAMES))
