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


class InvalidRequestError(KVCacheError, ValueError):
    """A request or argument that can never be served (empty prompt, too long, bad beam width...)."""


class IntegrityError(KVCacheError):
    """`verify_integrity()` found a broken ledger invariant (a bug, never user error)."""
