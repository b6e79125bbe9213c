"""`add_tokens`: one decode step of many requests, each appending one token, in a few numpy calls.

Meaning: `add_token(request_ids[i], tokens[i])` for each i in order, but atomic. Every check
runs before the first change, in row order, so a failure raises what the first failing
`add_token` would have raised (capacity included: free blocks are counted down row by row,
and blocks that sliding-window detaches would free are counted back), and changes nothing.

Speed: the manager keeps the last batch (`DecodeBatch`: its sequences, their token lists and
how many more tokens each can append before it must allocate or detach a block), dropped by
every other change to a sequence's tokens or `slow_at` and by every removal (`add_tokens` keeps
the batch it runs current itself; an admission keeps it: a new sequence is in no cached batch).
A step whose requests start no block is then a vectorised check of the tokens plus one C-level
`list.append` per request. Requests that start a block (one in `tokens_per_block`) share one
claim of victims per window (`take_fresh`) and one slot-table write; the others that need more
(beams, cross caches, extra ids, a sliding-window detach) run `add_token`'s own slow path, in
row order. A small step (at most `SMALL_BATCH` rows) whose every row only appends skips the
batch: its rows are checked and appended one by one, which up to about 64 rows costs less
than the batch's numpy calls.

The batch also serves the step's `store_new_blocks` (same id list): `store_candidates` picks the
rows that may have completed a block from its token counts and the slot table's store hints,
so the others are never read.
"""
from __future__ import annotations

import struct
from collections.abc import Hashable, Iterable, Sequence
from itertools import compress
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

from kvjax.errors import DuplicateRequestError, InvalidArgumentError, OutOfBlocksError
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID
from kvjax.validation import INT32_MAX, check_id_list

if TYPE_CHECKING:
    from kvjax.ledger.kv_cache_manager import KVCacheManager
    from kvjax.ledger.sequence import TrackedSequence

_PLAIN, _GROW, _SLOW = 0, 1, 2  # how a row commits: list append, batched growth, add_token's slow path
# At most this many rows, a step whose every row only appends is checked and appended row by
# row: below it the cached batch's numpy bookkeeping (a few µs per array operation) costs more
# than the rows themselves
SMALL_BATCH = 64


class DecodeBatch:
    """The sequences of one `add_tokens` id list, and per row how many more tokens it can
    append without allocating or detaching (`left`; <= 0: the next one needs the slow path)."""

    __slots__ = ("ids", "seqs", "token_lists", "left", "num_tokens")

    def __init__(self, ids: list | tuple, seqs: list[TrackedSequence]) -> None:
        self.ids = ids
        self.seqs = seqs
        self.token_lists: list[list[int]] = [s.tokens for s in seqs]
        self.num_tokens = int_array([len(t) for t in self.token_lists])  # [n]
        self.left = int_array([s.slow_at for s in seqs]) - 1 - self.num_tokens  # [n]


_SIGNED_CODES = {4: "i", 8: "q"}  # struct codes of native signed ints by size


def int_array(values: Iterable[int], dtype: type = np.int64) -> np.ndarray:
    """A writable 1-D signed integer array (`dtype` of 4 or 8 bytes) of Python ints, made with
    one `struct.pack`: about twice as fast as `np.array` or `np.fromiter` on a list of ints, and
    the per-row passes over a batch of a thousand requests are what a decode step costs.
    `struct.error` for a value out of range."""
    vals = values if isinstance(values, list) else list(values)
    dt = np.dtype(dtype)
    return np.frombuffer(bytearray(struct.pack(f"{len(vals)}{_SIGNED_CODES[dt.itemsize]}", *vals)), dtype=dt)


def same_ids(cached: Sequence[Hashable], ids: Sequence[Hashable]) -> bool:
    """Is `ids` the id list of a cached batch (an id comparing like an array: no)?"""
    try:
        return bool(cached == ids)
    except (TypeError, ValueError):
        return False


def batch_tokens(tokens: object, n: int) -> tuple[list, np.ndarray | None]:
    """The tokens as a list, and a bool mask `[n]` of rows whose token is not a plain int in
    [0, 2**31) (None when there are none): those rows take `add_token`'s checks one by one."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise InvalidArgumentError(f"tokens must be one-dimensional, got shape {tokens.shape}")
        vals = tokens.tolist()
        if tokens.dtype.kind in "iu":
            bad = (tokens < 0) | (tokens > INT32_MAX) if tokens.size and (tokens.min() < 0 or tokens.max() > INT32_MAX) else None
        else:  # floats, bools, objects: each row's token is checked as add_token would
            bad = np.ones(len(vals), dtype=bool)
    else:
        vals = check_id_list("tokens", tokens)
        if not vals or (set(map(type, vals)) == {int} and min(vals) >= 0 and max(vals) <= INT32_MAX):
            bad = None
        else:
            bad = np.array([not (type(t) is int and 0 <= t <= INT32_MAX) for t in vals], dtype=bool)
    if len(vals) != n:
        raise InvalidArgumentError(f"add_tokens got {n} request ids and {len(vals)} tokens")
    return vals, bad


def cached_batch(m: KVCacheManager, ids: list | tuple) -> DecodeBatch | None:
    """The batch of `ids` (the cached one while still valid); None when an id is unknown or
    repeated (the ordered check then reports it)."""
    b = m._batch
    if b is not None and same_ids(b.ids, ids):
        return b
    seqs = distinct_live(m, ids)
    if seqs is None:
        return None
    b = m._batch = DecodeBatch(list(ids) if type(ids) is list else ids, seqs)
    return b


def store_candidates(m: KVCacheManager, ids: list | tuple) -> list[TrackedSequence] | None:
    """`store_new_blocks`' pre-check without a walk through the batch's sequences: when `ids`
    is the cached batch's id list in a ledger of one full-attention window, and every row is a
    one-beam request, the sequences (in row order) that may hold a full block not yet stored;
    None otherwise (the caller checks every row).

    A row is left out when its token count minus one (the newest token's KV is never
    materialised, so this bounds what is) is below its row's store hint, which promises
    nothing to store until then (`WindowBlockManager.set_cursor`). The rows are the block
    table's (`_rows_of`, cached per id list); a request holding no row yet reads the empty
    row's hint, 0. The rest are checked in full by the caller, as any row would be."""
    b = m._batch
    bm = m._bm
    if b is None or m._has_swa or len(bm.windows) != 1 or not same_ids(b.ids, ids):
        return None
    wm = bm.windows[0]
    rows = m._rows_of(ids, wm)  # [n] one per request, unless some request has beams
    if len(rows) != len(ids):
        return None
    maybe = b.num_tokens - 1 >= wm.slot_table.store_due[rows]  # [n]
    return list(compress(b.seqs, maybe.tolist()))


def distinct_live(m: KVCacheManager, ids: list | tuple) -> list[TrackedSequence] | None:
    """The live sequences of `ids`, in order; None when an id is unknown, unhashable or repeated."""
    live = m._seqs
    try:
        seqs = [live[r] for r in ids]
    except (KeyError, TypeError):
        return None
    return seqs if len(set(ids)) == len(ids) else None


def add_tokens(m: KVCacheManager, request_ids: Sequence[Hashable], tokens: object) -> bool:
    """Run `add_tokens` (under the manager's lock). Returns whether anything but token appends
    changed (blocks, slots, windows: the caller counts a mutation)."""
    ids = check_id_list("request_ids", request_ids)
    if len(ids) <= SMALL_BATCH and append_small(m, ids, tokens):
        return False
    vals, bad = batch_tokens(tokens, len(ids))
    batch = cached_batch(m, ids)
    if batch is None:  # an unknown or repeated id: find the first failing row, as add_token would
        plan_rows(m, ids, None, vals, range(len(ids)))
        raise AssertionError("plan_rows accepted a batch with an unknown or repeated id")
    left = batch.left
    event = left <= 0  # [n] rows that allocate, detach or need add_token's slow checks
    if bad is not None:
        event |= bad
    if not event.any():  # the common step: every row appends
        list(map(list.append, batch.token_lists, vals))
        left -= 1
        batch.num_tokens += 1
        return False
    if bad is None and not m._has_swa and grow_batched(m, batch, vals, np.flatnonzero(event)):
        return True
    rows = np.flatnonzero(event).tolist()
    plans = plan_rows(m, ids, batch.seqs, vals, rows)  # raises before any change
    plain = ~event  # [n]
    list(map(list.append, compress(batch.token_lists, plain.tolist()), compress(vals, plain.tolist())))
    left[plain] -= 1
    batch.num_tokens[plain] += 1
    changed = False
    i = 0
    while i < len(plans):
        kind = plans[i][1]
        if kind == _GROW:
            j = i + 1
            while j < len(plans) and plans[j][1] == _GROW:
                j += 1
            grow_rows(m, [(batch.seqs[r], tok) for r, _, tok in plans[i:j]])
            changed = True
            i = j
            continue
        r, _, tok = plans[i]
        seq = batch.seqs[r]
        if kind == _PLAIN:
            seq.tokens.append(tok)
        else:
            m._add_token_slow(seq, tok, len(seq.tokens) + 1)
            changed = True
        i += 1
    num_tokens = batch.num_tokens
    for r in rows:
        seq = batch.seqs[r]
        num_tokens[r] = n = len(seq.tokens)
        left[r] = seq.slow_at - 1 - n
    m._batch = batch  # the slow paths dropped it; it is current again
    return changed


def append_small(m: KVCacheManager, ids: list | tuple, tokens: object) -> bool:
    """A small step whose every row is `add_token`'s fast path (a plain int token in range,
    below the sequence's `slow_at`, ids known and distinct): checked in full, then appended.
    False, with nothing changed, for anything else (the general path then decides, and raises
    what it must)."""
    if type(tokens) is list or type(tokens) is tuple:
        vals = tokens
    elif isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype.kind in "iu":
        vals = tokens.tolist()
    else:
        return False
    seqs = distinct_live(m, ids) if len(vals) == len(ids) else None
    if seqs is None:
        return False
    for seq, t in zip(seqs, vals, strict=True):
        if type(t) is not int or not 0 <= t <= INT32_MAX or len(seq.tokens) + 1 >= seq.slow_at:
            return False
    for seq, t in zip(seqs, vals, strict=True):
        seq.tokens.append(t)
    m._batch = None  # it counted these sequences' tokens
    return True


def grow_batched(m: KVCacheManager, batch: DecodeBatch, vals: list, event: np.ndarray) -> bool:
    """The usual step of one full-attention window: the `event` rows (ascending) all start a
    block, one beam each, within `max_seq_len` and the free blocks. Appends every row's token
    and grows those rows in one pass; False (nothing done) when a row needs more than that."""
    tpb = m._tpb
    if len(m._bm.windows) != 1:
        return False
    seqs = itemgetter_list(batch.seqs, event.tolist())
    if not all([s.batchable for s in seqs]):
        return False
    n = batch.num_tokens[event] + 1  # [k] each row's token count once its token is in
    wm = m._bm.windows[0]
    k = len(event)
    if k > wm.num_free_primary or ((n - 1) % tpb).any() or n.max() > m._max_seq_len:
        return False
    windows = [s.windows[0] for s in seqs]
    held = [sw.rows for sw in windows]
    if None in held:  # a first block hands a slot-table row out: the general path does that
        return False
    list(map(list.append, batch.token_lists, vals))
    blocks = wm.take_fresh(k, None)  # [k] claimed in row order, referenced once
    for sw, b in zip(windows, blocks, strict=True):
        sw.blocks[0].append(b)
    rows = int_array([r[0] for r in held], np.intp)  # [k]
    wm.slot_table.append_rows(rows, np.frombuffer(wm.columns.slot, dtype=np.int32)[blocks])
    wm.counters.gen_alloc += k
    # `_update_slow_at` of one full-attention window: the block after the new one starts at n + tpb
    slow_at = np.minimum(n + tpb, m._max_seq_len + 1)  # [k]
    for s, at in zip(seqs, slow_at.tolist(), strict=True):
        s.slow_at = at
    batch.num_tokens += 1
    batch.left -= 1
    batch.left[event] = slow_at - 1 - n
    return True


def itemgetter_list(items: list, index: list[int]) -> list:
    """`[items[i] for i in index]` in one C call."""
    if len(index) == 1:
        return [items[index[0]]]
    return list(itemgetter(*index)(items)) if index else []


def plan_rows(
    m: KVCacheManager, ids: Sequence[Hashable], seqs: list[TrackedSequence] | None, vals: list, rows
) -> list[tuple[int, int, int]]:
    """Check `rows` (ascending) as `add_token` would, one after the other: the first failure
    raises. Without `seqs`, ids are looked up here (unknown and repeated ids raise). Free
    blocks are counted down per window as rows allocate, and up as sliding-window detaches
    release a block's last reference. Returns (row, how it commits, checked token) per row."""
    bm = m._bm
    windows = bm.windows
    tpb = m._tpb
    free: list[int] | None = None
    pending: list[dict[int, int]] = [{} for _ in windows]  # window -> block -> references dropped
    seen: set = set()
    out = []
    for r in rows:
        rid, token = ids[r], vals[r]
        if seqs is None:
            seq = m._seq(rid)
            if rid in seen:
                raise DuplicateRequestError(f"request id {rid!r} appears twice in request_ids")
            seen.add(rid)
        else:
            seq = seqs[r]
        n = seq.num_tokens + 1
        if n < seq.slow_at and type(token) is int and 0 <= token <= INT32_MAX:
            out.append((r, _PLAIN, token))
            continue
        token = m._checked_token(seq, token, n)
        if free is None:
            free = [wm.num_free_primary for wm in windows]
        grows = (n - 1) % tpb == 0
        if grows:
            need = seq.beam_width
            for wm in windows:
                if free[wm.index] < need:
                    raise OutOfBlocksError(f"window {wm.window}: no free block for request {seq.request_id!r}")
            for wm in windows:
                free[wm.index] -= need
        detaches = False
        if m._has_swa:  # as `BlockManager.detach_out_of_window` will, once the token is in
            oldest = seq.context_position if seq.context_position < seq.prompt_len else n - 1 - seq.num_draft_tokens
            for wm in windows:
                if not wm.is_swa:
                    continue
                sw = seq.windows[wm.index]
                ref, dropped = wm.refs.ref, pending[wm.index]
                pos = sw.num_front_removed
                while (pos + 1) * tpb <= oldest + 1 - wm.window:
                    detaches = True
                    held: set[int] = set()
                    for beam in sw.blocks:
                        b = beam[pos]
                        if b != PLACEHOLDER_BLOCK_ID and b not in held:
                            held.add(b)
                            k = dropped[b] = dropped.get(b, 0) + 1
                            if ref[b] == k:
                                free[wm.index] += 1
                    pos += 1
        simple = seq.beam_width == 1 and seq.extra_ids is None and not seq.is_cross and not detaches
        out.append((r, _GROW if grows and simple else _SLOW, token))
    return out


def grow_rows(m: KVCacheManager, run: list[tuple[TrackedSequence, int]]) -> None:
    """Append each (sequence, token) of `run`, every one starting a block (beam width 1, no
    detach): per window one claim of victims, in row order, and one slot-table write."""
    tpb = m._tpb
    k = len(run)
    retention = None
    if any(seq.retention is not None for seq, _ in run):
        retention = [seq.block_priority(len(seq.tokens) // tpb, tpb) for seq, _ in run]
    for wm in m._bm.windows:
        widx = wm.index
        blocks = wm.take_fresh(k, retention)  # capacity checked by plan_rows
        slot, table = wm.columns.slot, wm.slot_table
        rows = []
        for (seq, _), b in zip(run, blocks, strict=True):
            sw = seq.windows[widx]
            sw.blocks[0].append(b)
            rows.append(table.rows_of(sw)[0])
        table.append_rows(np.array(rows, dtype=np.intp), np.array([slot[b] for b in blocks], dtype=np.int32))
        wm.counters.gen_alloc += k
    for seq, token in run:
        seq.tokens.append(token)
        m._update_slow_at(seq)
