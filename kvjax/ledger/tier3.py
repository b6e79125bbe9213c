"""Tier-3 hooks of the ledger: host notices, host pins and restores (no I/O here).

A third tier (`kvjax.kv_store.StoreTier`) copies host (secondary) blocks to a disk / Redis /
memory store and back. It needs three things from the ledger, which this module holds:

- **Notices** (`HostNotice`), polled with `KVCacheManager.take_host_notices()`: a cached block
  offloaded into a host slot (`STORED`), a host block hit by an admission (`HIT`: onboarded, or
  the source of a partial copy) and a cached host block evicted (`EVICTING`). Polling, not
  callbacks: a callback running inside a ledger call could raise half-way through it (no
  atomicity) or call back in. The notices of a call come with the transfer plan it recorded:
  a `STORED` block's bytes are in its slot once that plan is applied, an `EVICTING` block's
  bytes stay in its slot until the plan's op that overwrites the slot is applied. The one
  synchronous hook is the optional **evict guard** (`enable_host_notices(evict_guard=...)`):
  asked before a cached host block is evicted, it returns True to keep it (a write-back policy
  whose put has not been issued yet); the ledger then host-pins the block and picks another
  spare (none left: the offloading victim is dropped, as with no host tier). The guard must
  not raise or call the ledger.
- **Host pins**, counted per host slot (`pin_host_slots` / `unpin_host_slots`): a pinned host
  block is referenced, so it is never a victim (never evicted, its slot never reused). An
  admission that matches it copies its bytes into a fresh primary block with an `ONBOARD` op
  whose source slot stays pinned: the pin follows the host slot (onboard swaps the block's
  slot with the fresh block, and the pins move to the block that owns the slot).
- **Restores** (`reserve_restore` / `commit_restore` / `abort_restore`): host blocks reserved
  for a request's blocks after its local prefix match, held (one pin each) out of the tree
  until the engine reports their bytes arrived; `commit_restore(n)` caches the first `n` of
  them (the blocks after a failed get never enter the tree), the rest are freed.

Everything here is off until first used: a window manager's `tier3` is None, and the hot
paths test only that.
"""
from __future__ import annotations

import array
import dataclasses
import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvjax.errors import InvalidArgumentError, InvalidRequestError, UnknownBlockError
from kvjax.ledger.block_columns import SECONDARY
from kvjax.ledger.free_queues import NOT_FREE
from kvjax.ledger.host_notices import HostNotice, HostNoticeKind
from kvjax.validation import is_int

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.window_manager import WindowBlockManager

#: the evict guard: (window, block hash, host slot) -> keep the block (host-pin it)?
EvictGuard = Callable[[int, Any, int], bool]


class Tier3Hub:
    """State shared by the windows: the notice queue, the guard and the open restores."""

    __slots__ = ("listening", "notices", "guard", "restores", "_ids")

    def __init__(self) -> None:
        self.listening = False
        self.notices: list[HostNotice] = []
        self.guard: EvictGuard | None = None
        self.restores: dict[int, Restore] = {}
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)


@dataclasses.dataclass(slots=True)
class Restore:
    """Host blocks reserved for a request's prompt blocks `first .. first + num_blocks - 1`:
    `blocks[w]` (window size -> block ids, one per position) and `host_slots[w]` (their host
    slots: what the store's gets fill)."""

    ticket: int
    path: Any  # the request's TokenPath from the root to the last restored block
    first: int
    num_blocks: int
    blocks: dict[int, list[int]]
    host_slots: dict[int, list[int]]


class HostTier:
    """One window's tier-3 state: host pins per host slot and restore reservations."""

    __slots__ = ("hub", "wm", "pins", "reserved")

    def __init__(self, hub: Tier3Hub, wm: WindowBlockManager) -> None:
        self.hub = hub
        self.wm = wm
        self.pins = array.array("i", [0]) * wm.num_secondary  # host slot -> host pins
        self.reserved: set[int] = set()  # block ids held by an open restore

    # ------------------------------------------------------------------ notices
    def notice(self, kind: HostNoticeKind, b: int, cached: bool = True) -> None:
        if self.hub.listening:
            wm = self.wm
            h = wm.block_hash(b) if cached and wm.block_node[b] >= 0 else None
            self.hub.notices.append(HostNotice(kind, wm.window, h, wm.columns.slot[b], b))

    def evict_spare(self, spare: int) -> int:
        """A claimed cached host victim is about to be evicted: ask the guard (a kept block is
        host-pinned and the next victim tried), notice the eviction, drop it from the tree.
        Returns the spare block (claimed, uncached) or -1 when every free host block was kept."""
        wm = self.wm
        guard = self.hub.guard
        while True:
            if wm.block_node[spare] < 0:
                return spare
            if guard is not None and guard(wm.window, wm.block_hash(spare), wm.columns.slot[spare]):
                # keep it: the claim's reference becomes a host pin (retention kept, expiry disarmed)
                wm.queues.set_retention(spare, None, wm.queues.duration.get(spare))
                wm.refs.pin[spare] += 1
                self.pins[wm.columns.slot[spare]] += 1
                if not wm.queues.num_free[SECONDARY]:
                    return -1
                spare, _ = wm.refs.claim_victim(SECONDARY)
                continue
            self.notice(HostNoticeKind.EVICTING, spare)
            wm.drop_cached(spare)
            return spare

    def onboarded(self, b: int, target: int) -> None:
        """`b` swapped memory with `target` (an onboard): host pins follow the host slot."""
        p = self.pins[self.wm.columns.slot[target]]
        if p:
            refs = self.wm.refs
            refs.ref[b] -= p
            refs.pin[b] -= p
            refs.ref[target] += p
            refs.pin[target] += p

    # ------------------------------------------------------------------ pins
    def owners(self) -> np.ndarray:
        """Host slot -> the block owning it, int64 `[S]` (a vectorised scan: pins are rare)."""
        wm = self.wm
        level = np.frombuffer(wm.columns.level, dtype=np.uint8)  # [P + S]
        slot = np.frombuffer(wm.columns.slot, dtype=np.int32)  # [P + S]
        sec = np.flatnonzero(level == SECONDARY)  # [S]
        out = np.empty(wm.num_secondary, dtype=np.int64)
        out[slot[sec]] = sec
        return out

    def pin(self, slots: list[int]) -> None:
        wm = self.wm
        owner = self.owners()
        for s in slots:  # checks first: no change on a refusal
            b = int(owner[s])
            if b in self.reserved:
                raise InvalidRequestError(f"host slot {s} of window {wm.window} is reserved by a restore")
        queues, refs = wm.queues, wm.refs
        for s in slots:
            b = int(owner[s])
            if queues.queue[b] != NOT_FREE:
                refs.claim(b)  # out of the free queue, priority and duration kept
            else:
                refs.ref[b] += 1
            refs.pin[b] += 1
            self.pins[s] += 1

    def unpin(self, slots: list[int]) -> None:
        wm = self.wm
        want: dict[int, int] = {}
        for s in slots:
            want[s] = want.get(s, 0) + 1
        for s, k in want.items():
            if self.pins[s] < k:
                raise InvalidRequestError(f"host slot {s} of window {wm.window} has {self.pins[s]} pins, {k} unpins asked")
        owner = self.owners()
        refs = wm.refs
        for s in slots:
            b = int(owner[s])
            self.pins[s] -= 1
            refs.pin[b] -= 1
            refs.release(b)

    def pinned(self) -> dict[int, int]:
        return {s: c for s, c in enumerate(self.pins) if c}


def tier_of(wm: WindowBlockManager) -> HostTier | None:
    """`wm`'s tier-3 state (None until first used)."""
    t = wm.tier3
    assert t is None or isinstance(t, HostTier)
    return t


def hub_of(bm: BlockManager) -> Tier3Hub:
    """The manager's hub, every window given its `HostTier` on first use."""
    first = tier_of(bm.windows[0])
    if first is not None:
        return first.hub
    hub = Tier3Hub()
    for wm in bm.windows:
        wm.tier3 = HostTier(hub, wm)
    return hub


def check_slots(wm: WindowBlockManager, slots: object) -> list[int]:
    """A list of host slots of `wm` (ints in `[0, S)`), else a typed error."""
    if isinstance(slots, (str, bytes)) or not isinstance(slots, Iterable):
        raise InvalidArgumentError(f"host slots must be a collection of ints, got {slots!r}")
    try:
        items = list(slots)
    except TypeError:  # a 0-d array
        raise InvalidArgumentError(f"host slots must be a collection of ints, got {slots!r}") from None
    n = wm.num_secondary
    for s in items:
        if not is_int(s):
            raise InvalidArgumentError(f"host slot must be an int, got {s!r} ({type(s).__name__})")
        if not 0 <= int(s) < n:
            raise UnknownBlockError(f"host slot {s} out of range [0, {n}) in window {wm.window}")
    return [int(s) for s in items]


def check_host_window(wm: WindowBlockManager) -> None:
    """Host pins and restores apply to attention windows with host blocks."""
    if not wm.grows_blocks:
        raise InvalidRequestError(f"host pins and restores apply to attention windows; window {wm.window} holds recurrent states")
    if wm.num_secondary == 0:
        raise InvalidRequestError(f"window {wm.window} has no host (secondary) blocks")


def host_tier(bm: BlockManager, wm: WindowBlockManager) -> HostTier:
    """`wm`'s tier-3 state for host pins and restores, refused for a window they do not apply to."""
    check_host_window(wm)
    hub_of(bm)
    t = tier_of(wm)
    assert t is not None
    return t


def verify_tier3(bm: BlockManager, fail: Callable[[str], Any]) -> None:
    """Host pins agree with pin counts: a secondary block's pins are its slot's host pins plus
    its restore reservation; a host-pinned slot's owner is a secondary block; reserved blocks
    are secondary, uncached and held by exactly one open restore."""
    first = tier_of(bm.windows[0])
    if first is None:
        return
    held: dict[tuple[int, int], int] = {}
    for r in first.hub.restores.values():
        for w, blocks in r.blocks.items():
            for b in blocks:
                held[(w, b)] = held.get((w, b), 0) + 1
    for wm in bm.windows:
        t = tier_of(wm)
        if t is None:
            fail(f"window {wm.window} has no tier-3 state while others do")
            return
        level, slot, pin = wm.columns.level, wm.columns.slot, wm.refs.pin
        for b in range(wm.num_blocks):
            if level[b] != SECONDARY:
                if b in t.reserved:
                    fail(f"window {wm.window}: reserved block {b} is not on host memory")
                continue
            want = t.pins[slot[b]] + (b in t.reserved)
            if pin[b] != want:
                fail(f"window {wm.window}: host block {b} has {pin[b]} pins, its slot {want} host pins + reservation")
        for b in t.reserved:
            if wm.block_node[b] >= 0:
                fail(f"window {wm.window}: reserved block {b} is in the tree")
            if held.get((wm.window, b)) != 1:
                fail(f"window {wm.window}: reserved block {b} is held by {held.get((wm.window, b), 0)} restores")
        if sum(1 for (w, _) in held if w == wm.window) != len(t.reserved):
            fail(f"window {wm.window}: open restores hold blocks not marked reserved")


def take_notices(bm: BlockManager) -> list[HostNotice]:
    hub = hub_of(bm)
    out, hub.notices = hub.notices, []
    return out

