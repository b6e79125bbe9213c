"""Typed errors of kvjax. Every failed ledger call leaves the ledger exactly as it was."""


class KVCacheError(Exception):
    """Base class of every error kvjax raises on purpose: the errors defined next to their
    code (checkpoints, config.json, the engine, the server, the event wire format) derive from
    it too, keeping their builtin base (`ValueError`, `RuntimeError`...) for existing callers."""


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


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type where Python convention asks for a `TypeError` (the
    manager's `config` and `clock`); every other bad argument is an `InvalidArgumentError`."""


class TransferSequenceError(KVCacheError, ValueError):
    """A transfer plan reported out of order: already acknowledged, never issued, reported twice,
    or (with `require_transfer_acks`) a new plan taken before the previous one was reported."""


class TransferError(KVCacheError):
    """Some operations of a transfer plan did not take effect (raised by whoever applies plans).

    `op_indices` lists the failed operations (None: the whole plan); `pools` holds the pools
    after the operations that did apply when the caller's pools were donated (None: the
    caller's pools are untouched). Report it with `KVCacheManager.transfers_failed`."""

    def __init__(self, message: str, *, op_indices=None, pools=None) -> None:
        super().__init__(message)
        self.op_indices = None if op_indices is None else tuple(int(i) for i in op_indices)
        self.pools = pools
