"""The host ledger: block metadata, radix tree, eviction and sequence bookkeeping (no JAX)."""
from kvjax.ledger.transfer_plan import TransferKind, TransferOp, TransferPlan, TransferRecorder
