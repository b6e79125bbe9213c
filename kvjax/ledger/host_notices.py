"""Host notices (`kvjax.ledger.tier3` collects them) and the hooks a window manager calls.

Kept apart from `tier3` so the window manager names the hooks without importing what
implements them.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Protocol


class HostNoticeKind(enum.IntEnum):
    STORED = 0  # a cached block was offloaded into `host_slot` (bytes there once the plan is applied)
    HIT = 1  # an admission read the host block in `host_slot` (onboard or partial copy)
    EVICTING = 2  # the cached host block in `host_slot` left the tree (bytes valid until the plan runs)


@dataclasses.dataclass(frozen=True, slots=True)
class HostNotice:
    """One thing that happened to a host slot. `block_hash` is the block's event hash (None for
    a hit on a block an in-place partial reuse had already taken out of the tree)."""

    kind: HostNoticeKind
    window: int
    block_hash: Any
    host_slot: int
    block_id: int


class HostHooks(Protocol):
    """What a window manager calls when tier-3 hooks are on (`kvjax.ledger.tier3.HostTier`)."""

    def notice(self, kind: HostNoticeKind, b: int, cached: bool = True) -> None: ...

    def evict_spare(self, spare: int) -> int: ...

    def onboarded(self, b: int, target: int) -> None: ...
