"""Typed errors of kvjax. Every failed ledger call leaves the ledger exactly as it was."""


class KVCacheError(Exception):
    """Base class of every error kvjax raises on purpose."""


class OutOfBlocksError(KVCacheError):
    """Not enough free blocks to satisfy an allocation; nothing was allocated."""


class UnknownRequestError(KVCacheError, KeyError):
    """The request id is not tracked by the ledger."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(KVCacheError, ValueError):
    """A request with this id is already tracked by the ledger."""


class InvalidArgumentError(KVCacheError, ValueError):
    """An argument the ledger cannot act on (unknown window, block not pinned, table too narrow...)."""


class InvalidRequestError(InvalidArgumentError):
    """A request or token that can never be served (empty prompt, too long, bad beam width...)."""


class UnknownBlockError(KVCacheError, KeyError):
    """The block id does not exist in that window manager."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SchedulingStateError(KVCacheError, RuntimeError):
    """A scheduling dry-run call came before `start_scheduling()`."""


class IntegrityError(KVCacheError):
    """`verify_integrity()` found a broken ledger invariant (a bug, never user error)."""
