"""The ledger's thread contract: one writer thread, any number of reader threads.

Every mutating method runs under the manager's re-entrant lock (`writer`), and so does every
method documented as safe from other threads (`reader`), so a reader sees the ledger between
two whole operations, never in the middle of one. The one exception is `add_token`'s fast path
(a token that neither starts a block nor slides a window out, of a sequence whose tokens are a
list): it appends to the sequence's token list without the lock (a sequence's length is its
token list's length, so that is one list append), because a lock there would cost more than
the append. No block, slot, count or tree link changes on that path, so only token lists can
move under a reader; `snapshot()` switches the path off while it reads (see
`KVCacheManager.snapshot`). The token store (`kvjax.ledger.token_store`), where a batched step
moves a sequence's tokens, is written under the lock only; the batched `add_tokens` is an
ordinary writer: it holds the lock throughout.

`writer` also counts completed mutations (`_version`), which lets a scheduling dry run notice
that the ledger changed under it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable


def writer[F: Callable](fn: F) -> F:
    """Run a mutating method under the manager's lock; count it once it succeeded."""

    @functools.wraps(fn)
    def locked(self, *args, **kwargs):
        lock = self._lock
        lock.acquire()
        try:
            out = fn(self, *args, **kwargs)
            self._version += 1
            return out
        finally:
            lock.release()

    return locked  # type: ignore[return-value]  # same signature as fn (functools.wraps), which mypy cannot see


def reader[F: Callable](fn: F) -> F:
    """Run a read under the manager's lock, so other threads see whole operations only."""

    @functools.wraps(fn)
    def locked(self, *args, **kwargs):
        lock = self._lock
        lock.acquire()
        try:
            return fn(self, *args, **kwargs)
        finally:
            lock.release()

    return locked  # type: ignore[return-value]  # same signature as fn (functools.wraps), which mypy cannot see
