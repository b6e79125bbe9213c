"""Restores from tier 3 (vLLM's `delay_cache_blocks`): host blocks reserved for a request's
blocks after its local prefix match, cached only once the engine says their bytes arrived.

`reserve` claims up to `num_blocks` host blocks per attention window (the same count in every
window: fewer when the host pool is short; victims are evicted as an offload's spare is, the
evict guard asked) for the request's full prompt blocks `first .. first + n - 1`, where `first`
is the full blocks of the prefix admission would reuse now. They stay out of the tree, held by
one pin each. `commit(n_ok)` caches the first `n_ok` of them under the request's keys (a
position cached meanwhile keeps its block, ours is freed) and frees the rest: blocks after a
failed get never enter the tree. `abort` frees them all. A committed block is a cached host
block like an offloaded one: a later admission onboards it through the transfer plan.
If the prefix before `first` was evicted meanwhile, the restored blocks are cached but
unreachable until evicted in turn (as a true priority eviction leaves descendants).
Recurrent-state windows cannot be restored (no snapshot comes from the store): a cache with
one refuses restores.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvjax.config import DEFAULT_PRIORITY
from kvjax.errors import InvalidArgumentError, InvalidRequestError, OutOfBlocksError
from kvjax.ledger.admission import plan_sequence, prompt_path
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID, SECONDARY
from kvjax.ledger.scheduler_queries import query_sequence
from kvjax.ledger.tier3 import Restore, host_tier, hub_of, tier_of
from kvjax.validation import check_int

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.live_sequences import LiveSequences
    from kvjax.request import Request


def reserve(bm: BlockManager, live: LiveSequences, request: Request, num_blocks: int) -> Restore:
    num_blocks = check_int("num_blocks", num_blocks, 1, None)
    tiers = [host_tier(bm, wm) for wm in bm.windows]  # refuses recurrent windows, no host tier
    if not bm.reuse:
        raise InvalidRequestError("restores need block reuse (restored blocks are cached)")
    seq = query_sequence(bm, live, request)
    tpb = bm.tokens_per_block
    first = plan_sequence(bm, seq).prepopulated // tpb
    limit = (seq.prompt_len - 1) // tpb  # full blocks admission may match
    if first + num_blocks > limit:
        raise InvalidRequestError(
            f"request {seq.request_id!r}: blocks {first}..{first + num_blocks - 1} asked, the prompt has {limit} reusable"
        )
    n = min(num_blocks, *(wm.num_free_secondary for wm in bm.windows))
    if n == 0:
        raise OutOfBlocksError("no free host block to restore into")
    blocks: dict[int, list[int]] = {}
    for wm, t in zip(bm.windows, tiers, strict=True):
        got: list[int] = []
        while len(got) < n and wm.num_free_secondary:
            b, _ = wm.refs.claim_victim(SECONDARY)
            b = t.evict_spare(b)  # the guard may keep cached victims (host-pinned)
            if b < 0:
                break
            wm.queues.set_retention(b, DEFAULT_PRIORITY, None)
            got.append(b)
        blocks[wm.window] = got
        n = min(n, len(got))
    for wm in bm.windows:  # every window the same count: the guard may have kept some
        extra = blocks[wm.window][n:]
        del blocks[wm.window][n:]
        for b in extra:
            wm.refs.release(b)
    if n == 0:
        raise OutOfBlocksError("no free host block to restore into (the evict guard kept every one)")
    hub = hub_of(bm)
    for wm, t in zip(bm.windows, tiers, strict=True):
        for b in blocks[wm.window]:
            wm.refs.pin[b] += 1  # the claim's reference is the reservation's pin
            t.reserved.add(b)
    slots = {wm.window: [wm.columns.slot[b] for b in blocks[wm.window]] for wm in bm.windows}
    path = prompt_path(bm, seq, (first + n) * tpb)
    r = Restore(hub.next_id(), path, first, n, blocks, slots)
    hub.restores[r.ticket] = r
    return r


def _open(bm: BlockManager, ticket: object) -> Restore:
    if isinstance(ticket, Restore):
        ticket = ticket.ticket
    t = tier_of(bm.windows[0])
    if t is None or not isinstance(ticket, int) or isinstance(ticket, bool) or ticket not in t.hub.restores:
        raise InvalidArgumentError(f"no open restore {ticket!r}")
    return t.hub.restores[ticket]


def _unreserve(bm: BlockManager, r: Restore) -> None:
    for w, bs in r.blocks.items():
        wm = bm.windows[bm.window_index[w]]
        t = tier_of(wm)
        assert t is not None
        for b in bs:
            t.reserved.discard(b)
            wm.refs.pin[b] -= 1
    hub_of(bm).restores.pop(r.ticket)


def commit(bm: BlockManager, ticket: object, num_arrived: object = None) -> int:
    """Cache the first `num_arrived` (None: all) restored blocks, free the rest; returns how
    many blocks were newly cached (summed over windows)."""
    r = _open(bm, ticket)
    n = r.num_blocks if num_arrived is None else check_int("num_arrived", num_arrived, 0, r.num_blocks)
    _unreserve(bm, r)
    cached = 0
    for w, bs in r.blocks.items():
        wm = bm.windows[bm.window_index[w]]
        attached: set[int] = set()
        if n:
            row = [PLACEHOLDER_BLOCK_ID] * r.first + bs[:n]
            attached = set(wm.attach_restored(r.path, r.first + n, row))
            cached += len(attached)
        for b in bs:
            wm.refs.release(b)  # cached ones join the host queues; the others are free, uncached
    return cached


def abort(bm: BlockManager, ticket: object) -> None:
    r = _open(bm, ticket)
    _unreserve(bm, r)
    for w, bs in r.blocks.items():
        for b in bs:
            bm.windows[bm.window_index[w]].refs.release(b)
