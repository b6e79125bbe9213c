"""`add_tokens`: one decode step of many requests, each appending one token, in a few numpy calls.

Meaning: `add_token(request_ids[i], tokens[i])` for each i in order, but atomic. Every check
runs before the first change, in row order, so a failure raises what the first failing
`add_token` would have raised (capacity included: free blocks are counted down row by row,
and blocks that sliding-window detaches would free are counted back), and changes nothing.

Speed: tokens, token counts and each sequence's limit (the count from which its next token
needs more than being stored) are columns of the live sequences' `TokenStore` (`LiveSequences.tok`), indexed by the
sequence's row, and the rows of an id list come from the store's directory (a dict lookup per
id; `LiveSequences` keeps the last list's rows, `DecodeBatch`, until a sequence leaves, since a row
handed back may be handed out again). A step whose requests start no block is then a
vectorised check of the tokens and the limits plus one scatter of the tokens: no sequence
object is read. Sequences still holding their tokens as a list (every sequence until its
first batched step) move into the store first. Requests that start a block (one
in `tokens_per_block`) share one claim of victims per window (`take_fresh`) and one slot-table
write; the others that need more (beams, cross caches, extra ids, a sliding-window detach) run
`add_token`'s own slow path, in row order. A small step (at most `SMALL_BATCH` rows) whose
every row only appends skips the batch: its rows are checked and appended one by one, which up
to about 64 rows costs less than the batch's numpy calls.

The batch also serves the step's `store_new_blocks` (same id list): `store_candidates` picks the
rows that may have completed a block from their token counts and the slot table's store
hints, so the others are never read.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import compress
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

from kvjax.errors import DuplicateRequestError, InvalidArgumentError, InvalidRequestError, OutOfBlocksError
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID
from kvjax.ledger.growth import add_token_slow, checked_token
from kvjax.ledger.live_sequences import DecodeBatch, LiveSequences
from kvjax.ledger.packing import int_array, same_ids
from kvjax.validation import INT32_MAX, check_id_list

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.sequence import TrackedSequence

_PLAIN, _GROW, _SLOW = 0, 1, 2  # how a row commits: store the token, batched growth, add_token's slow path
# At most this many rows, a step whose every row only appends is checked and appended row by
# row: below it the batch's numpy bookkeeping (a few µs per array operation) costs more than
# the rows themselves
SMALL_BATCH = 64


def batch_tokens(tokens: object, n: int) -> tuple[np.ndarray, list | None, np.ndarray | None]:
    """The step's tokens as an integer array `[n]` (0 where a row's token is not a plain int in
    [0, 2**31)); the tokens as given, as a list, when some row's is not (else None: they are
    the array's); and a bool mask `[n]` of those rows (None when there are none): they take
    `add_token`'s checks one by one."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise InvalidArgumentError(f"tokens must be one-dimensional, got shape {tokens.shape}")
        if len(tokens) != n:
            raise InvalidArgumentError(f"add_tokens got {n} request ids and {len(tokens)} tokens")
        if tokens.dtype.kind in "iu":
            narrow = tokens.dtype.itemsize < 4 or (tokens.dtype.itemsize == 4 and tokens.dtype.kind == "i")
            if not tokens.size or (tokens.min() >= 0 and (narrow or tokens.max() <= INT32_MAX)):
                return tokens, None, None
            bad = (tokens < 0) | (tokens > INT32_MAX)  # [n]
            return np.where(bad, 0, tokens), tokens.tolist(), bad
        # floats, bools, objects: each row's token is checked as add_token would
        return np.zeros(n, dtype=np.int64), tokens.tolist(), np.ones(n, dtype=bool)
    vals = check_id_list("tokens", tokens)
    if len(vals) != n:
        raise InvalidArgumentError(f"add_tokens got {n} request ids and {len(vals)} tokens")
    if not vals or (set(map(type, vals)) == {int} and min(vals) >= 0 and max(vals) <= INT32_MAX):
        return int_array(vals), None, None
    bad = np.array([not (type(t) is int and 0 <= t <= INT32_MAX) for t in vals], dtype=bool)  # [n]
    return int_array([0 if b else t for t, b in zip(vals, bad.tolist(), strict=True)]), list(vals), bad


def cached_batch(live: LiveSequences, ids: list | tuple) -> DecodeBatch | None:
    """The batch of `ids` (the cached one while still valid); None when an id is unknown,
    unhashable or repeated (the ordered check then reports it)."""
    b = live.batch
    if b is not None and same_ids(b.ids, ids):
        return b
    directory = live.tok.row_of_id
    try:
        rows = _rows(directory, ids)
    except (KeyError, TypeError):  # an id unknown, or a sequence still keeping a token list
        if not live.move_to_store(ids):
            return None
        rows = _rows(directory, ids)
    if len(set(ids)) != len(ids):
        return None
    live.new_in_store = True  # the next admissions go straight to the store
    b = live.batch = DecodeBatch(list(ids) if type(ids) is list else ids, int_array(rows, np.intp))
    return b


def _rows(directory: dict, ids: list | tuple) -> tuple:
    return itemgetter(*ids)(directory) if len(ids) > 1 else tuple(directory[r] for r in ids)


def store_candidates(bm: BlockManager, live: LiveSequences, ids: list | tuple) -> list[TrackedSequence] | None:
    """`store_new_blocks`' pre-check without a walk through the batch's sequences: when `ids`
    is the cached batch's id list in a ledger of one full-attention window, and every row is a
    one-beam request, the sequences (in row order) that may hold a full block not yet stored;
    None otherwise (the caller checks every row). The batch's rows hold all their tokens in
    the store: `add_tokens` moved them there, and a single `add_token` that moves one of them
    back to a list drops the batch.

    A row is left out when its token count minus one (the newest token's KV is never
    materialised, so this bounds what is) is below its row's store hint, which promises
    nothing to store until then (`WindowBlockManager.set_cursor`). The rows are the block
    table's (`LiveSequences.slot_rows`, cached per id list); a request holding no row yet reads the empty
    row's hint, 0. The rest are checked in full by the caller, as any row would be."""
    b = live.batch
    if b is None or bm.detaching or len(bm.windows) != 1 or not same_ids(b.ids, ids):
        return None
    wm = bm.windows[0]
    rows = live.slot_rows(ids, wm)  # [n] one per request, unless some request has beams
    if len(rows) != len(ids):
        return None
    maybe = live.tok.count[b.rows] - 1 >= wm.slot_table.store_due[rows]  # [n]
    by_id = live.seqs
    return [by_id[r] for r in compress(b.ids, maybe.tolist())]


def add_tokens(bm: BlockManager, live: LiveSequences, request_ids: Sequence[Hashable], tokens: object) -> bool:
    """Run `add_tokens` (under the manager's lock). Returns whether anything but token appends
    changed (blocks, slots, windows: the caller counts a mutation)."""
    ids = check_id_list("request_ids", request_ids)
    if len(ids) <= SMALL_BATCH and append_small(live, ids, tokens):
        return False
    arr, given, bad = batch_tokens(tokens, len(ids))
    batch = cached_batch(live, ids)
    if batch is None:  # an unknown or repeated id: find the first failing row, as add_token would
        plan_rows(bm, live, ids, arr.tolist() if given is None else given, range(len(ids)), checked=False)
        raise AssertionError("plan_rows accepted a batch with an unknown or repeated id")
    tok = live.tok
    rows = batch.rows
    counts = tok.count[rows]  # [n]
    event = counts >= tok.limit[rows]  # [n] rows that allocate, detach or need add_token's slow checks
    if bad is not None:
        event |= bad
    if not event.any():  # the common step: every row only stores its token
        tok.append_rows(rows, counts, arr)
        return False
    at = np.flatnonzero(event)  # [k]
    if bad is None and not bm.detaching and not live.pending and grow_batched(bm, live, batch, counts, arr, at):
        return True
    vals = arr.tolist() if given is None else given
    plans = plan_rows(bm, live, ids, vals, at.tolist(), checked=True)  # raises before any change
    plain = ~event  # [n]
    tok.append_rows(rows[plain], counts[plain], arr[plain])
    by_id = live.seqs
    changed = False
    i = 0
    while i < len(plans):
        kind = plans[i][1]
        if kind == _GROW:
            j = i + 1
            while j < len(plans) and plans[j][1] == _GROW:
                j += 1
            grow_rows(bm, live, [(by_id[ids[r]], t) for r, _, t in plans[i:j]])
            changed = True
            i = j
            continue
        r, _, t = plans[i]
        seq = by_id[ids[r]]
        if kind == _PLAIN:
            tok.append(seq.row, t)
        else:
            add_token_slow(bm, live, seq, t, seq.num_tokens + 1)
            changed = True
        i += 1
    return changed


def append_small(live: LiveSequences, ids: list | tuple, tokens: object) -> bool:
    """A small step whose every row is `add_token`'s fast path (a plain int token in range,
    below the sequence's limit, ids known and distinct): checked in full, then appended (to
    the token list, or to the store for a sequence whose tokens a batched step moved there).
    False, with nothing changed, for anything else (the general path then decides, and raises
    what it must)."""
    if type(tokens) is list or type(tokens) is tuple:
        vals = tokens
    elif isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype.kind in "iu":
        vals = tokens.tolist()
    else:
        return False
    seqs = live.distinct(ids) if len(vals) == len(ids) else None
    if seqs is None:
        return False
    tok = live.tok
    count_of, limit_of = tok.count_of, tok.limit_of
    for seq, t in zip(seqs, vals, strict=True):
        if type(t) is not int or not 0 <= t <= INT32_MAX:
            return False
        tokens = seq.tokens
        if len(tokens) >= seq.limit if tokens is not None else count_of[seq.row] >= limit_of[seq.row]:
            return False
    append = tok.append
    for seq, t in zip(seqs, vals, strict=True):
        tokens = seq.tokens
        if tokens is not None:
            tokens.append(t)
        else:
            append(seq.row, t)
    return True


def grow_batched(
    bm: BlockManager, live: LiveSequences, batch: DecodeBatch, counts: np.ndarray, tokens: np.ndarray, event: np.ndarray
) -> bool:
    """The usual step of one full-attention window: the `event` rows (ascending) all start a
    block, one beam each, within `max_seq_len` and the free blocks. Stores every row's token
    and grows those rows in one pass; False (nothing done) when a row needs more than that."""
    tpb = bm.tokens_per_block
    if len(bm.windows) != 1:
        return False
    wm = bm.windows[0]
    all_rows = live.slot_rows(batch.ids, wm)  # [n] the slot-table rows (cached per id list)
    if len(all_rows) != len(batch.ids):  # some request has beams
        return False
    slot_rows = all_rows[event]  # [k]
    by_id = live.seqs
    seqs = [by_id[r] for r in itemgetter_list(batch.ids, event.tolist())]
    if not all([s.batchable for s in seqs]):
        return False
    n = counts[event]  # [k] each row's token count before its token
    k = len(event)
    if k > wm.num_free_primary or (n % tpb).any() or n.max() >= bm.config.max_seq_len or not slot_rows.all():
        return False  # (slot-table row 0: a request holding no block here yet, `EMPTY_ROW`)
    windows = [s.windows[0] for s in seqs]
    tok = live.tok
    tok.append_rows(batch.rows, counts, tokens)
    blocks = wm.take_fresh(k, None)  # [k] claimed in row order, referenced once
    for sw, b in zip(windows, blocks, strict=True):
        sw.append_block(0, b)
    wm.slot_table.append_rows(slot_rows, np.frombuffer(wm.columns.slot, dtype=np.int32)[blocks])
    wm.counters.gen_alloc += k
    tok.set_limits(batch.rows[event], bm.grown_limits(n))
    return True


def itemgetter_list(items: Sequence, index: list[int]) -> list:
    """`[items[i] for i in index]` in one C call."""
    if len(index) == 1:
        return [items[index[0]]]
    return list(itemgetter(*index)(items)) if index else []


def plan_rows(
    bm: BlockManager, live: LiveSequences, ids: Sequence[Hashable], vals: list, rows, checked: bool
) -> list[tuple[int, int, int]]:
    """Check `rows` (ascending) as `add_token` would, one after the other: the first failure
    raises. Unless the ids are `checked` (live and distinct), unknown and repeated ids raise
    here. Free blocks are counted down per window as rows allocate, and up as sliding-window
    detaches release a block's last reference. Returns (row, how it commits, checked token)
    per row."""
    windows = bm.windows
    tpb = bm.tokens_per_block
    by_id = live.seqs
    free: list[int] | None = None
    pending: list[dict[int, int]] = [{} for _ in windows]  # window -> block -> references dropped
    seen: set = set()
    out = []
    for r in rows:
        rid, token = ids[r], vals[r]
        if checked:
            seq = by_id[rid]
        else:
            seq = live.get(rid)
            if rid in seen:
                raise DuplicateRequestError(f"request id {rid!r} appears twice in request_ids")
            seen.add(rid)
        n = seq.num_tokens + 1
        if n <= live.limit_of(seq) and type(token) is int and 0 <= token <= INT32_MAX:
            out.append((r, _PLAIN, token))
            continue
        if live.pending and rid in live.pending:
            raise InvalidRequestError(f"request {rid!r}: its newest token is pending (set_pending_tokens first)")
        token = checked_token(bm, seq, token, n)
        if free is None:
            free = [wm.num_free_primary for wm in windows]
        grows = (n - 1) % tpb == 0
        if grows:
            need = seq.beam_width
            for wm in windows:
                if free[wm.index] < need and wm.grows_blocks:
                    raise OutOfBlocksError(f"window {wm.window}: no free block for request {seq.request_id!r}")
            for wm in windows:
                free[wm.index] -= need
        detaches = False
        if bm.detaching:  # as `BlockManager.detach_out_of_window` will, once the token is in
            oldest = bm.oldest_query(seq, n)
            for wm in bm.detaching:
                sw = seq.windows[wm.index]
                ref, dropped = wm.refs.ref, pending[wm.index]
                for pos in range(sw.num_front_removed, wm.detach_end(oldest)):
                    detaches = True
                    held: set[int] = set()
                    for beam in sw.blocks:
                        b = beam[pos]
                        if b != PLACEHOLDER_BLOCK_ID and b not in held:
                            held.add(b)
                            k = dropped[b] = dropped.get(b, 0) + 1
                            if ref[b] == k:
                                free[wm.index] += 1
        simple = seq.beam_width == 1 and seq.extra_ids is None and not detaches  # (a cross cache raised above)
        out.append((r, _GROW if grows and simple else _SLOW, token))
    return out


def grow_rows(bm: BlockManager, live: LiveSequences, run: list[tuple[TrackedSequence, int]]) -> None:
    """Append each (sequence, token) of `run`, every one starting a block (beam width 1, no
    detach): per window one claim of victims, in row order, and one slot-table write."""
    tpb = bm.tokens_per_block
    k = len(run)
    retention = None
    if any(seq.retention is not None for seq, _ in run):
        retention = [seq.block_priority(seq.num_tokens // tpb, tpb) for seq, _ in run]
    for wm in bm.windows:
        widx = wm.index
        if not wm.grows_blocks:  # a recurrent-state chain grows placeholders
            for seq, _ in run:
                wm.extend_blocks(seq.windows[widx], [PLACEHOLDER_BLOCK_ID], None)
            continue
        blocks = wm.take_fresh(k, retention)  # capacity checked by plan_rows
        slot, table = wm.columns.slot, wm.slot_table
        rows = []
        for (seq, _), b in zip(run, blocks, strict=True):
            sw = seq.windows[widx]
            sw.append_block(0, b)
            rows.append(table.rows_of(sw)[0])
        table.append_rows(np.array(rows, dtype=np.intp), np.array([slot[b] for b in blocks], dtype=np.int32))
        wm.counters.gen_alloc += k
    for seq, token in run:
        seq.append(token)
        live.set_limit(seq)
