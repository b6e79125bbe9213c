"""Compatibility path: `TransferPlan` and its op types live in `kvjax.transfer_plan` (a module
that loads neither the ledger nor the device side); this module only re-exports them."""
from kvjax.transfer_plan import TransferKind, TransferOp, TransferPlan

__all__ = ["TransferKind", "TransferOp", "TransferPlan"]
