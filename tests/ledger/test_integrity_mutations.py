"""Mutation tests of the ledger oracle: every check of `verify_integrity` fires.

About 2,000 tests trust `KVCacheManager.verify_integrity()` (`verify_ledger` in
kvjax/ledger/integrity.py, and `SlotTable.verify`) to catch a broken ledger, yet no healthy
run ever makes it fail. Each case here builds a realistic healthy ledger through the public
API, requires it to verify, applies ONE minimal corruption of internal state that breaks
exactly one invariant, and requires the `IntegrityError` of that check (matched by its
message). Checks run in order, so each corruption is chosen to get past every earlier check.
"""
from __future__ import annotations

import array
import contextlib
import heapq
import inspect
import re
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ledger_helpers import FakeClock

from kvjax import CacheConfig, KVCacheManager, MultimodalItem, Request, RetentionConfig, TokenRangeRetention
from kvjax.errors import IntegrityError
from kvjax.ledger import integrity
from kvjax.ledger.block_columns import PLACEHOLDER_BLOCK_ID, PRIMARY, SECONDARY
from kvjax.ledger.free_queues import NOT_FREE, NUM_PRIORITIES
from kvjax.ledger.radix_tree import NO_BLOCK, ROOT
from kvjax.ledger.sequence import StoreCursor
from kvjax.ledger.sorted_firsts import SortedFirsts

TPB = 4
SYS = list(range(12))  # a 3-block shared prefix


def _config(**overrides: Any) -> CacheConfig:
    base: dict[str, Any] = dict(tokens_per_block=TPB, num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=64, primary_blocks=20)
    base.update(overrides)
    return CacheConfig(**base)


# --------------------------------------------------------------------------- healthy ledgers
def rich() -> KVCacheManager:
    """One full-attention window with a secondary tier and events on. Live: "b" (decoding),
    "c" (two beams, partially reusing a cached block), "e" (big). The tree holds a 3-block
    prefix node with two children (its partial-match index built), an offloaded chain, cached
    blocks with armed retention expiries (and stale heap entries); the slot table has a free
    row, the tree a free node id."""
    m = KVCacheManager(_config(secondary_blocks=4, max_beam_width=2, event_buffer_max_size=64), clock=FakeClock())
    keep = RetentionConfig((TokenRangeRetention(0, None, 60, 100.0),))
    m.add_sequence(Request("a", SYS + list(range(100, 108)), retention=keep))
    m.remove_sequence("a")  # 5 blocks cached at priority 60, expiries armed
    m.add_sequence(Request("b", SYS + list(range(200, 206)), max_new_tokens=8))  # splits a's node after SYS
    m.add_token("b", 206)
    m.add_token("b", 207)
    m.store_context_blocks("b")
    m.add_sequence(Request("c", SYS + [100, 101, 50, 51, 52], beam_width=2, max_new_tokens=4))  # partial match
    m.add_sequence(Request("d", list(range(300, 306))))
    m.remove_sequence("d")  # cached at the default priority: offloaded under pressure
    low = RetentionConfig((TokenRangeRetention(0, None, 10),))
    m.add_sequence(Request("f", list(range(600, 608)), retention=low))
    m.remove_sequence("f")  # cached at priority 10: evicted first, its node id freed
    m.add_sequence(Request("e", list(range(400, 428))))  # pressure: evicts f, offloads d
    m.add_sequence(Request("g", list(range(700, 705))))
    m.remove_sequence("g", store_for_reuse=False)  # leaves a free slot-table row
    m.verify_integrity()
    wm, t = m._bm.windows[0], m._bm.tree
    assert wm.slot_table.free_rows and t.free_ids and wm.queues.heap_size > len(wm.queues.armed) > 0
    assert any(wm.columns.level[b] == SECONDARY for b in range(wm.num_blocks) if t.block_node[0][b] != NO_BLOCK)
    return m


def sliding() -> KVCacheManager:
    """A sliding window (8 tokens) next to full attention: "s" has detached its first blocks in
    the sliding window (placeholders with the null slot)."""
    m = KVCacheManager(_config(num_layers=2, attention_windows=(8, 64)))
    m.add_sequence(Request("s", list(range(10)), max_new_tokens=20))
    for i in range(10):
        m.add_token("s", 50 + i)
    m.verify_integrity()
    assert m._seqs["s"].windows[m._bm.window_index[8]].num_front_removed > 0
    return m


def multimodal() -> KVCacheManager:
    """Cached paths with a multimodal block (its own one-position node) and a salted signature;
    nothing was ever partially matched (no partial-match index)."""
    m = KVCacheManager(_config())
    m.add_sequence(Request("mm", list(range(16)), mm_items=(MultimodalItem(b"\x07" * 32, 5, 2),)))
    m.add_sequence(Request("salt", list(range(12)), cache_salt="s"))
    m.store_context_blocks("mm")
    m.store_context_blocks("salt")
    m.verify_integrity()
    t = m._bm.tree
    assert t.mm and any(t.sig[n] != 0 for n in t.iter_nodes()) and t.pindex[ROOT] is None
    return m


def batched() -> KVCacheManager:
    """An engine's ledger after batched decode steps: 70 requests (above `add_tokens`'
    row-by-row threshold) whose tokens the first `add_tokens` moved into the token store, one
    of them 300 tokens long (two pages); "gone" left (a free row, free pages), "n" was admitted
    after the step (straight into the store), and a single `add_token` moved "z" back to a
    token list."""
    m = KVCacheManager(_config(primary_blocks=400, max_seq_len=600))
    ids = [f"r{i}" for i in range(68)] + ["gone", "z"]
    m.add_sequences([Request(i, [7 + k % 50 for k in range(5 + len(i))], max_new_tokens=8) for i in ids])
    m.add_sequence(Request("long", list(range(300)), max_new_tokens=8))
    m.add_tokens([*ids, "long"], [9] * 71)
    m.remove_sequence("gone")
    m.add_sequence(Request("n", [1, 2, 3, 4, 5], max_new_tokens=8))
    m.add_token("z", 11)
    m.verify_integrity()
    tok = m._tok
    assert tok.free_rows and tok.free_pages and m._listed.keys() == {"z"} and m._seqs["n"].tokens is None
    assert len(tok.row_pages[m._seqs["long"].row]) == 1 and tok.base[m._seqs["long"].row] == 299
    return m


def _trow(m: KVCacheManager, rid: str) -> int:
    return m._seqs[rid].row


def pages_shared(m: KVCacheManager) -> None:
    """Row r1's last page replaced by r2's (its tail moved with it): one page, two rows."""
    tok = m._tok
    a, b = _trow(m, "r1"), _trow(m, "r2")
    tok.row_pages[a][-1] = tok.row_pages[b][-1]
    tok.tail[a] = tok.tail[b]


# --------------------------------------------------------------------------- finders
def _wm(m: KVCacheManager, window: int | None = None):
    return m._bm.windows[0 if window is None else m._bm.window_index[window]]


def _tree(m: KVCacheManager):
    return m._bm.tree


def _sw(m: KVCacheManager, rid: str, window: int | None = None):
    return m._seqs[rid].windows[_wm(m, window).index]


def _row(m: KVCacheManager, rid: str, beam: int = 0, window: int | None = None) -> int:
    rows = _sw(m, rid, window).rows
    assert rows is not None
    return rows[beam]


def _node(m: KVCacheManager, pred: Callable[..., bool]) -> int:
    """The smallest live node id satisfying `pred(tree, n)` (the healthy ledger must have one)."""
    t = _tree(m)
    found = sorted(n for n in t.iter_nodes() if pred(t, n))
    assert found, "the healthy ledger lacks the node this corruption needs"
    return found[0]


def _leaf(m: KVCacheManager) -> int:
    """A leaf run of at least two positions."""
    return _node(m, lambda t, n: t.children[n] is None and t.length[n] >= 2)


def _inner(m: KVCacheManager) -> int:
    """A node of at least two positions with children and a partial-match index of 2+ live keys."""
    return _node(m, lambda t, n: t.children[n] and t.length[n] >= 2 and t.pindex[n] and len(t.pindex[n][0]) >= 2)


def _held(m: KVCacheManager, rid: str = "b") -> int:
    """The last block of `rid`'s beam 0 (referenced once, not shared)."""
    b = _sw(m, rid).blocks[0][-1]
    assert _wm(m).refs.ref[b] == 1
    return b


def _queue(m: KVCacheManager, level: int = PRIMARY) -> tuple[int, list[int]]:
    """(priority, blocks) of the longest free queue of `level` (at least two blocks)."""
    q = _wm(m).queues
    prio = max(range(NUM_PRIORITIES), key=lambda p: len(q.queue_ids(level, p)))
    blocks = q.queue_ids(level, prio)
    assert len(blocks) >= 2
    return prio, blocks


def _sentinel(m: KVCacheManager, level: int, prio: int) -> int:
    return _wm(m).queues.num_blocks + level * NUM_PRIORITIES + prio


def _unarmed_free(m: KVCacheManager) -> int:
    q = _wm(m).queues
    return next(b for b in q.free_blocks(PRIMARY) if b not in q.armed)


def _firsts(m: KVCacheManager) -> SortedFirsts:
    """The (plain) partial-match index of `_inner`, with every age entry live."""
    firsts = _tree(m).pindex[_inner(m)][0]
    assert firsts.head == firsts.stale == 0 and len(firsts.ages) >= 2
    return firsts


def _mm_node(m: KVCacheManager) -> int:
    return _node(m, lambda t, n: n in t.mm)


def _salted(m: KVCacheManager) -> int:
    return _node(m, lambda t, n: t.sig[n] != 0)


def _uncached(m: KVCacheManager) -> int:
    bn = _tree(m).block_node[0]
    return next(b for b in _sw(m, "e").blocks[0] if bn[b] == NO_BLOCK)


def _cached_held(m: KVCacheManager) -> int:
    """Block at position 0 of `_leaf` (a later position of the run exists)."""
    return _tree(m).values[0][_leaf(m)][0]


# --------------------------------------------------------------------------- corruptions
def unlink(m: KVCacheManager, b: int) -> None:
    """Splice free block `b` out of its queue's links and count (its record `queue[b]` kept)."""
    q = _wm(m).queues
    p, f = q.prev[b], q.next[b]
    q.next[p] = f
    q.prev[f] = p
    q.num_free[q.queue[b] // NUM_PRIORITIES] -= 1


def drop_from_queues(m: KVCacheManager, b: int) -> None:
    """`unlink`, and the record cleared too: the queues are consistent, the block is lost."""
    unlink(m, b)
    _wm(m).queues.queue[b] = NOT_FREE


def arm(m: KVCacheManager, b: int) -> None:
    """An armed retention expiry (entry and time) for `b`."""
    q = _wm(m).queues
    q.armed[b] = 999
    q.expiry[b] = 1.0


def drop_live_heap_entry(m: KVCacheManager) -> None:
    """Remove the heap entry of one armed block (keeping the heap a heap)."""
    q = _wm(m).queues
    b, c = next(iter(q.armed.items()))
    q._heap.remove((q.expiry[b], c, b))
    heapq.heapify(q._heap)


def grow_in_place(m: KVCacheManager, n: int) -> None:
    """Node `n` takes a second position holding a copy of its first block's tokens."""
    t = _tree(m)
    t.length[n] = 2
    t.content[n] = t.content[n] * 2


def refile_first_child(m: KVCacheManager, n: int) -> None:
    """`n`'s first child moves to a key that is not its first block."""
    kids = _tree(m).children[n]
    kids[b"\x01" * 4 * TPB] = kids.pop(next(iter(kids)))


def hand_back_second_beam(m: KVCacheManager) -> None:
    """Beam 1 of "c" loses its row (returned, emptied, to the free rows): the slot table stays
    consistent, but "c" has two beams and one row."""
    sw, st = _sw(m, "c"), _wm(m).slot_table
    assert sw.rows is not None
    r = sw.rows.pop()
    st.table[r, :] = st.null_slot
    st.lengths[r] = 0
    st.free_rows.append(r)
    st.row_of_id["c"] = sw.rows[0]  # one row now: the directory files it, as for a one-beam request


def shorten_row(m: KVCacheManager) -> None:
    """"b"'s row loses its last slot (reset to the null slot, as a truncate would)."""
    st, r = _wm(m).slot_table, _row(m, "b")
    n = int(st.lengths[r])
    st.table[r, n - 1] = st.null_slot
    st.lengths[r] = n - 1


def swap_ages(m: KVCacheManager) -> None:
    firsts = _firsts(m)
    firsts.ages[0], firsts.ages[1] = firsts.ages[1], firsts.ages[0]
    firsts.births[0], firsts.births[1] = firsts.births[1], firsts.births[0]


def root_self_loop(m: KVCacheManager) -> None:
    """The root filed as its own child, under the key its (empty) content gives: any other node
    reached twice trips an earlier check (its parent link or its key), so only this loop reaches
    the "reachable twice" check (without it the walk would never end)."""
    t = _tree(m)
    assert t.pindex[ROOT] is None  # (an index would notice the new key first)
    t.parent[ROOT] = ROOT
    t.children[ROOT][b""] = ROOT


def overlap_ids(m: KVCacheManager) -> None:
    """The node with the lowest position ids claims the first id of the next one."""
    t = _tree(m)
    a, b = sorted(t.iter_nodes(), key=lambda n: t.pid[n])[:2]
    t.pid_end[a] = t.pid[b] + 1


def live_node_listed_free(m: KVCacheManager) -> None:
    t = _tree(m)
    t.free_ids[0] = _leaf(m)


# (id, builder, corruption, message regex)
Case = tuple[str, Callable[[], KVCacheManager], Callable[[KVCacheManager], object], str]
def cursor_on_foreign_block(m: KVCacheManager) -> None:
    """Request b's storing cursor (its hint kept) moves to the first position of a node that
    does not hold b's block at the cursor's depth."""
    sw = _sw(m, "b")
    own = sw.blocks[0][sw.cursor.full_blocks - 1]
    n = _node(m, lambda t, n: own not in t.values[0][n])
    sw.cursor = StoreCursor(n, _tree(m).pid[n], sw.cursor.full_blocks)


CASES: list[Case] = [
    # ---------------------------------------------------------------- TokenStore.verify
    # a row filed under an id nobody has
    ("tok-directory", batched, lambda m: m._tok.row_of_id.__setitem__("ghost", m._tok.free_rows[0]),
     r"token store: the rows in use are not the sequences' rows"),
    # a free row listed twice
    ("tok-free-row-twice", batched, lambda m: m._tok.free_rows.append(m._tok.free_rows[0]),
     r"token store: a free row is in use, listed twice, or lost"),
    # a prefix shorter than its length says
    ("tok-prefix-length", batched, lambda m: m._tok.prefix.__setitem__(_trow(m, "r3"), m._tok.prefix[_trow(m, "r3")][:-4]),
     r"token store: row \d+ has a prefix of \d+ bytes for \d+ tokens"),
    # a page more than the tokens need
    ("tok-extra-page", batched, lambda m: m._tok.row_pages[_trow(m, "r4")].insert(0, m._tok.free_pages.pop()),
     r"token store: row \d+ holds 2 pages for \d+ tokens, or a stale tail"),
    # a tail naming another page
    ("tok-stale-tail", batched, lambda m: m._tok.tail.__setitem__(_trow(m, "r4"), m._tok.tail[_trow(m, "r4")] + 256),
     r"token store: row \d+ holds 1 pages for \d+ tokens, or a stale tail"),
    # one page held by two rows
    ("tok-page-twice", batched, pages_shared, r"token store: a page of row \d+ is held twice"),
    # a free page lost
    ("tok-free-page-lost", batched, lambda m: m._tok.free_pages.pop(),
     r"token store: a free page is in use, listed twice, or lost"),
    # a reservation out of step with its row
    ("tok-reservation", batched, lambda m: m._tok.row_reserve.__setitem__(_trow(m, "r5"), m._tok.row_reserve[_trow(m, "r5")] + 1),
     r"token store: the page reservations are not the live rows'"),
    # a free row with a count
    ("tok-free-row-count", batched, lambda m: m._tok.count.__setitem__(m._tok.free_rows[0], 3),
     r"token store: a free row has a count, a prefix, a tail or a limit, or a limit is negative"),
    # ---------------------------------------------------------------- token lists and limits
    # a sequence keeping a list that the manager does not file
    ("seq-list-unfiled", batched, lambda m: m._listed.pop("z"),
     r"the sequences keeping their tokens as a list are not the ones the manager files"),
    # a token list's fast-path limit one token too far
    ("seq-list-limit", batched, lambda m: setattr(m._seqs["z"], "limit", m._seqs["z"].limit + 1),
     r"request 'z': its token list has a stale limit"),
    # a token-store row's limit one token too far
    ("seq-store-limit", batched, lambda m: m._tok.limit.__setitem__(_trow(m, "r6"), m._tok.limit[_trow(m, "r6")] + 1),
     r"request 'r6': its token-store row has a stale limit"),
    # a row cut below its prompt
    ("seq-fewer-than-prompt", batched, lambda m: m._tok.truncate(_trow(m, "r7"), 2),
     r"request 'r7' holds fewer tokens than its prompt"),
    # ---------------------------------------------------------------- SlotTable.verify
    # more rows handed out than the table has
    ("slots-rows-beyond-table", rich, lambda m: setattr(_wm(m).slot_table, "next_row", _wm(m).slot_table.table.shape[0] + 1),
     r"slot table: row count and lengths disagree"),
    # two sequences hold one row
    ("slots-row-shared", rich, lambda m: setattr(_sw(m, "e"), "rows", [_row(m, "b")]),
     r"slot table: row \d+ of 'e' is out of range or also held by 'b'"),
    # a sequence holds the always-empty row 0
    ("slots-row-out-of-range", rich, lambda m: setattr(_sw(m, "e"), "rows", [0]),
     r"slot table: row 0 of 'e' is out of range or also held by None"),
    # the row directory (a changing batch's block table reads it) files a row under another id
    ("slots-directory-wrong-row", rich, lambda m: _wm(m).slot_table.row_of_id.__setitem__("b", _row(m, "e")),
     r"slot table: the row directory is stale for request\(s\) 'b'"),
    # the directory lost a live one-beam request
    ("slots-directory-missing", rich, lambda m: _wm(m).slot_table.row_of_id.pop("e"),
     r"slot table: the row directory is stale for request\(s\) 'e'"),
    # the directory still files a request that left
    ("slots-directory-left-over", rich, lambda m: _wm(m).slot_table.row_of_id.__setitem__("gone", 1),
     r"slot table: the row directory is stale for request\(s\) 'gone'"),
    # a free row listed twice
    ("slots-free-row-twice", rich, lambda m: _wm(m).slot_table.free_rows.append(_wm(m).slot_table.free_rows[0]),
     r"slot table: a free row is held, out of range, or listed twice"),
    # a held row also listed free
    ("slots-free-row-held", rich, lambda m: _wm(m).slot_table.free_rows.append(_row(m, "b")),
     r"slot table: a free row is held, out of range, or listed twice"),
    # a row id past the handed-out ones listed free in place of a real one (counts still agree;
    # passed unnoticed before the range test joined this check)
    ("slots-free-row-out-of-range", rich, lambda m: _wm(m).slot_table.free_rows.__setitem__(0, 63),
     r"slot table: a free row is held, out of range, or listed twice"),
    # a free row forgotten (leaked)
    ("slots-row-leaked", rich, lambda m: _wm(m).slot_table.free_rows.pop(),
     r"slot table: \d+ rows handed out, \d+ held \+ 0 free"),
    # the width bound fell below a row's length
    ("slots-longest-too-small", rich, lambda m: setattr(_wm(m).slot_table, "longest", _wm(m).slot_table.longest - 1),
     r"slot table: a row length is out of bounds"),
    # a negative row length
    ("slots-negative-length", rich, lambda m: _wm(m).slot_table.lengths.__setitem__(_wm(m).slot_table.free_rows[0], -1),
     r"slot table: a row length is out of bounds"),
    # a free row keeps a length
    ("slots-free-row-not-empty", rich, lambda m: _wm(m).slot_table.lengths.__setitem__(_wm(m).slot_table.free_rows[0], 1),
     r"slot table: a row nobody holds is not empty"),
    # a slot past the end of "b"'s row
    ("slots-stale-entry-past-end", rich,
     lambda m: _wm(m).slot_table.table.__setitem__((_row(m, "b"), int(_wm(m).slot_table.lengths[_row(m, "b")])), 0),
     r"slot table: an entry past a row's end is not the null slot"),
    # a store hint on a row nobody holds
    ("slots-free-row-hint", rich, lambda m: _wm(m).slot_table.store_due.__setitem__(_wm(m).slot_table.free_rows[0], 8),
     r"slot table: a row nobody holds has a store hint, or a hint is negative"),
    # a negative store hint on a held row
    ("slots-negative-hint", rich, lambda m: _wm(m).slot_table.store_due.__setitem__(_row(m, "b"), -4),
     r"slot table: a row nobody holds has a store hint, or a hint is negative"),
    # ---------------------------------------------------------------- sequences
    # a store hint that is not its cursor's (b's cursor: 4 full blocks, so 20)
    ("seq-hint-for-another-cursor", rich, lambda m: _wm(m).slot_table.store_due.__setitem__(_row(m, "b"), 16),
     r"window 64: request 'b' has store hint 16 for cursor StoreCursor\(node=\d+, pid=\d+, full_blocks=4\)"),
    # a store hint trusting a cursor whose position holds another block than the request's own
    ("seq-hint-on-foreign-position", rich, cursor_on_foreign_block,
     r"window 64: the store hint of request 'b' trusts cursor StoreCursor\(node=\d+, pid=\d+, full_blocks=4\), "
     r"whose position lost block 5"),
    # a token without its block
    ("seq-tokens-without-block", rich, lambda m: m._seqs["b"].tokens.append(208),
     r"window 64: request 'b' has block lists of lengths \{5\}, expected 6"),
    # two beams, one row
    ("seq-rows-per-beam", rich, hand_back_second_beam,
     r"window 64: request 'c' has 2 beams but 1 slot-table rows"),
    # a row shorter than its beam
    ("seq-row-shorter-than-beam", rich, shorten_row,
     r"window 64: request 'b' beam 0 has 5 blocks but 4 slots"),
    # a placeholder where the sequence still holds its block
    ("seq-placeholder-past-prefix", rich, lambda m: _sw(m, "b").blocks[0].__setitem__(4, PLACEHOLDER_BLOCK_ID),
     r"window 64: request 'b' has a placeholder at 4 past the detached prefix"),
    # a detached block's slot entry still shows a real slot
    ("seq-placeholder-slot", sliding,
     lambda m: _wm(m, 8).slot_table.table.__setitem__((_row(m, "s", window=8), 0), 5),
     r"window 8: placeholder of 's' at 0 has slot 5"),
    # the detached prefix claims one more block than was detached
    ("seq-real-block-in-prefix", sliding, lambda m: setattr(sw := _sw(m, "s", 8), "num_front_removed", sw.num_front_removed + 1),
     r"window 8: request 's' holds a real block inside its detached prefix"),
    # a block id past the pool
    ("seq-foreign-block-id", rich, lambda m: _sw(m, "b").blocks[0].__setitem__(4, _wm(m).num_blocks),
     r"window 64: request 'b' holds block id 24, not one of this manager's"),
    # a held block moved to secondary memory
    ("seq-holds-secondary", rich, lambda m: _wm(m).columns.level.__setitem__(_held(m), SECONDARY),
     r"window 64: request 'b' references secondary block \d+"),
    # a row's slot is another block's
    ("seq-slot-mismatch", rich, lambda m: _wm(m).slot_table.table.__setitem__((_row(m, "b"), 4), _wm(m).columns.slot[0]),
     r"window 64: slot row of 'b' says 0 at 4, block \d+ owns \d+"),
    # ---------------------------------------------------------------- free queues
    # the last block of a queue links into another queue's sentinel
    ("queue-links-to-non-block", rich,
     lambda m: _wm(m).queues.next.__setitem__(_queue(m)[1][-1], _sentinel(m, PRIMARY, 0)),
     r"window 64: free queue \(0,\d+\) links to \d+, not a block"),
    # a queue loops back to its first block
    ("queue-loops", rich, lambda m: _wm(m).queues.next.__setitem__(_queue(m)[1][-1], _queue(m)[1][0]),
     r"window 64: block \d+ is in two free queues \(or a queue loops\)"),
    # a later (higher-priority) queue runs on into a block of the longest queue
    ("queue-block-in-two-queues", rich,
     lambda m: _wm(m).queues.next.__setitem__(_wm(m).queues.queue_ids(PRIMARY, 60)[-1], _queue(m)[1][0]),
     r"window 64: block \d+ is in two free queues \(or a queue loops\)"),
    # a back link skips a block
    ("queue-asymmetric-links", rich,
     lambda m: _wm(m).queues.prev.__setitem__(_queue(m)[1][1], _sentinel(m, PRIMARY, _queue(m)[0])),
     r"window 64: free queue \(0,\d+\) links are not symmetric at block \d+"),
    # a queued block records another queue
    ("queue-record-mismatch", rich, lambda m: _wm(m).queues.queue.__setitem__(_queue(m)[1][0], 99),
     r"window 64: block \d+ queued at \(0,\d+\) but records queue 99"),
    # a free block of a primary queue owns secondary memory
    ("queue-wrong-level", rich, lambda m: _wm(m).columns.level.__setitem__(_queue(m)[1][0], SECONDARY),
     r"window 64: block \d+ at level 1 sits in level-0 queue"),
    # a queued block's priority changed in place
    ("queue-wrong-priority", rich, lambda m: _wm(m).queues.priority.__setitem__(_queue(m)[1][0], 99),
     r"window 64: block \d+ has priority 99 but sits in queue \d+"),
    # the sentinel's tail link points at the first block
    ("queue-stale-tail", rich,
     lambda m: _wm(m).queues.prev.__setitem__(_sentinel(m, PRIMARY, _queue(m)[0]), _queue(m)[1][0]),
     r"window 64: free queue \(0,\d+\) tail link is stale"),
    # one free block too many counted
    ("queue-free-count", rich, lambda m: _wm(m).queues.num_free.__setitem__(PRIMARY, _wm(m).queues.num_free[PRIMARY] + 1),
     r"window 64: level 0 counts \d+ free blocks, queues hold \d+"),
    # an empty queue marked non-empty
    ("queue-mask-extra-bit", rich, lambda m: _wm(m).queues.nonempty.__setitem__(SECONDARY, _wm(m).queues.nonempty[SECONDARY] | 1),
     r"window 64: level 1 non-empty mask is stale"),
    # a non-empty queue marked empty
    ("queue-mask-missing-bit", rich,
     lambda m: _wm(m).queues.nonempty.__setitem__(PRIMARY, _wm(m).queues.nonempty[PRIMARY] & ~(1 << _queue(m)[0])),
     r"window 64: level 0 non-empty mask is stale"),
    # a block spliced out of its queue still records it
    ("queue-record-without-membership", rich, lambda m: unlink(m, _queue(m)[1][0]),
     r"window 64: block \d+ records a free queue but none holds it"),
    # a referenced block with an armed expiry
    ("expiry-armed-on-held", rich, lambda m: arm(m, _held(m)),
     r"window 64: block \d+ has an expiry armed but is not free"),
    # an armed free block without its expiry time
    ("expiry-armed-without-time", rich, lambda m: _wm(m).queues.expiry.popitem(),
     r"window 64: block \d+ has an expiry armed but is not free"),
    # an expiry time nobody armed
    ("expiry-time-unarmed", rich, lambda m: _wm(m).queues.expiry.__setitem__(_unarmed_free(m), 5000.0),
     r"window 64: expiry times and armed heap entries disagree"),
    # the heap lost an armed block's entry (its retention would never expire)
    ("expiry-heap-entry-lost", rich, lambda m: drop_live_heap_entry(m),
     r"window 64: block \d+'s armed expiry has no heap entry"),
    # the heap outgrew its compaction bound
    ("expiry-heap-unbounded", rich, lambda m: setattr(_wm(m).queues, "heap_limit", _wm(m).queues.heap_size - 1),
     r"window 64: expiry heap holds \d+ entries, limit \d+"),
    # ---------------------------------------------------------------- reference counts
    # a negative pin count
    ("refs-negative-pins", rich, lambda m: _wm(m).refs.pin.__setitem__(_unarmed_free(m), -1),
     r"window 64: block \d+ has negative pins"),
    # one reference too many
    ("refs-extra-ref", rich, lambda m: _wm(m).refs.ref.__setitem__(_held(m), 2),
     r"window 64: block \d+ ref_count 2 != 1 sequence refs \+ 0 pins"),
    # a pin that holds no reference
    ("refs-pin-without-ref", rich, lambda m: _wm(m).refs.pin.__setitem__(_held(m), 1),
     r"window 64: block \d+ ref_count 1 != 1 sequence refs \+ 1 pins"),
    # an unreferenced block dropped from the free queues entirely
    ("refs-leak", rich, lambda m: drop_from_queues(m, _unarmed_free(m)),
     r"window 64: block \d+ is unreferenced but in no free queue \(leak\)"),
    # a held block queued as free (a consistent queue entry)
    ("refs-held-and-free", rich, lambda m: _wm(m).queues.push(_held(m)),
     r"window 64: block \d+ is referenced and free at once"),
    # two primary blocks own one slot
    ("slots-not-permutation-primary", rich,
     lambda m: _wm(m).columns.slot.__setitem__(_unarmed_free(m), _wm(m).columns.slot[_held(m)]),
     r"window 64: level-0 slots are not a permutation of 0\.\.19"),
    # a secondary block owns a slot past the secondary pool
    ("slots-not-permutation-secondary", rich,
     lambda m: _wm(m).columns.slot.__setitem__(_wm(m).queues.free_blocks(SECONDARY)[0], 4),
     r"window 64: level-1 slots are not a permutation of 0\.\.3"),
    # ---------------------------------------------------------------- radix tree
    # the root filed as its own child: the one corruption this check can catch first (see root_self_loop)
    ("tree-reachable-twice", multimodal, root_self_loop, r"tree node 0 is reachable twice"),
    # a leaf keeps an empty child map
    ("tree-empty-child-map", rich, lambda m: _tree(m).children.__setitem__(_leaf(m), {}),
     r"tree node \d+ keeps an empty child map"),
    # a live node with no positions
    ("tree-no-positions", rich, lambda m: _tree(m).length.__setitem__(_leaf(m), 0),
     r"live tree node \d+ has no positions"),
    # a live (linked) node whose content was dropped as if freed (was a TypeError in the
    # parent's key check before that check tested it)
    ("tree-no-content", rich, lambda m: _tree(m).content.__setitem__(_leaf(m), None),
     r"live tree node \d+ has no positions"),
    # the last position lost all its tokens
    ("tree-tokens-short", rich,
     lambda m: _tree(m).content.__setitem__(n := _leaf(m), _tree(m).content[n][: (_tree(m).length[n] - 1) * 4 * TPB]),
     r"tree node \d+: \d+ tokens do not fill 2 positions"),
    # a torn token (bytes not a multiple of the unit)
    ("tree-tokens-torn", rich, lambda m: _tree(m).content.__setitem__(_leaf(m), _tree(m).content[_leaf(m)] + b"\x00"),
     r"tree node \d+: \d+ tokens do not fill 2 positions"),
    # positions beyond the node's id range
    ("tree-pid-range", rich,
     lambda m: _tree(m).pid_end.__setitem__(n := _leaf(m), _tree(m).pid[n] + _tree(m).length[n] - 1),
     r"tree node \d+: position ids \[\d+, \d+\) outside its range ending \d+"),
    # the next position id rewound into a live node's range
    ("tree-pid-past-next", rich, lambda m: setattr(t := _tree(m), "next_pid", max(t.pid_end[n] for n in t.iter_nodes()) - 1),
     r"tree node \d+: position ids \[\d+, \d+\) outside its range ending \d+"),
    # a multimodal block's node grew a second position
    ("tree-mm-in-run", multimodal, lambda m: grow_in_place(m, _mm_node(m)),
     r"tree node \d+ holds a multimodal block inside a run of 2"),
    # a live node's signature counted as unused
    ("tree-signature-unreferenced", multimodal, lambda m: _tree(m).sig_refs.__setitem__(_tree(m).sig[_salted(m)], 0),
     r"tree node \d+ carries a released signature"),
    # a live node's signature released (was a TypeError, as above)
    ("tree-signature-released", multimodal, lambda m: _tree(m).signatures.__setitem__(_tree(m).sig[_salted(m)], None),
     r"tree node \d+ carries a released signature"),
    # a leaf ending on an empty position
    ("tree-unpruned-leaf-end", rich, lambda m: _tree(m).values[0][_leaf(m)].__setitem__(-1, NO_BLOCK),
     r"empty tree position left unpruned at the end of leaf node \d+"),
    # a node with children lost its last token
    ("tree-partial-inner", rich, lambda m: _tree(m).content.__setitem__(n := _inner(m), _tree(m).content[n][:-4]),
     r"tree node \d+ ends on a partial block but has children"),
    # one cached hash too many
    ("tree-hash-count", rich, lambda m: _tree(m).hashes[_leaf(m)].append(None),
     r"tree node \d+: 3 cached hashes for 2 positions"),
    # a window row longer than the node
    ("tree-row-long", rich, lambda m: _tree(m).values[0][_leaf(m)].append(NO_BLOCK),
     r"tree node \d+: window 64 row does not cover its 2 positions"),
    # a leaf's window row one position short (was an IndexError in the leaf-end check before
    # that check moved after this one)
    ("tree-row-short", rich, lambda m: _tree(m).values[0][_leaf(m)].pop(),
     r"tree node \d+: window 64 row does not cover its 2 positions"),
    # a leaf's window row missing (was a TypeError, as above)
    ("tree-row-missing", rich, lambda m: _tree(m).values[0].__setitem__(_leaf(m), None),
     r"tree node \d+: window 64 row does not cover its 2 positions"),
    # a block copied into a second position (the leaf's last)
    ("tree-block-twice", rich, lambda m: _tree(m).values[0][_leaf(m)].__setitem__(-1, _tree(m).values[0][_inner(m)][0]),
     r"block \d+ of window 64 sits at two tree positions"),
    # a child names another parent
    ("tree-parent-link", rich, lambda m: _tree(m).parent.__setitem__(_leaf(m), ROOT),
     r"tree link broken under node \d+: child \d+ names parent 0"),
    # a child's depth off by one
    ("tree-depth", rich, lambda m: _tree(m).depth.__setitem__(_leaf(m), _tree(m).depth[_leaf(m)] + 1),
     r"tree node \d+: depth 4 after a parent ending at 3"),
    # a child filed under a key that is not its first block
    ("tree-child-key", rich, lambda m: refile_first_child(m, _inner(m)),
     r"tree node \d+ is filed under a key that is not its first block"),
    # the partial-match index lost a live key
    ("tree-pindex-stale", rich, lambda m: _firsts(m).dead.add(_firsts(m).keys[0]),
     r"partial-match index of tree node \d+ is stale"),
    # a leaf keeps a partial-match index
    ("tree-leaf-pindex", rich,
     lambda m: _tree(m).pindex.__setitem__(_leaf(m), {0: SortedFirsts([b"k"], [b"k"], array.array("q", [1]))}),
     r"leaf tree node \d+ keeps a partial-match index"),
    # two nodes claim one position id
    ("tree-overlapping-ids", rich, overlap_ids, r"two tree nodes own overlapping position ids"),
    # one position counted too many
    ("tree-counts", rich, lambda m: setattr(_tree(m), "num_positions", _tree(m).num_positions + 1),
     r"tree counts \d+ nodes / \d+ positions, walk found \d+ / \d+"),
    # an uncached block points into the tree
    ("tree-dangling-block-node", rich, lambda m: _tree(m).block_node[0].__setitem__(_uncached(m), _inner(m)),
     r"window 64: block \d+ points at a tree position that does not hold it"),
    # a cached block points at the next position of its run
    ("tree-wrong-block-offset", rich, lambda m: _tree(m).block_offset[0].__setitem__(_cached_held(m), 1),
     r"window 64: block \d+ points at \(\d+, 1\) but is held at \(\d+, 0\)"),
    # a freed node id forgotten
    ("tree-node-id-leaked", rich, lambda m: _tree(m).free_ids.pop(),
     r"tree node table: \d+ ids, \d+ live \+ root, 0 free"),
    # a live node listed as free instead of a free one (counts agree)
    ("tree-live-node-listed-free", rich, live_node_listed_free, r"free tree node \d+ still holds data or is linked"),
    # a free node id keeps content
    ("tree-free-node-content", rich, lambda m: _tree(m).content.__setitem__(_tree(m).free_ids[0], b""),
     r"free tree node \d+ still holds data or is linked"),
    # a signature counts one node more than carry it
    ("tree-signature-count", rich, lambda m: _tree(m).sig_refs.__setitem__(0, _tree(m).sig_refs[0] + 1),
     r"signature \(False, None, None\) counts \d+ nodes, \d+ carry it"),
    # ---------------------------------------------------------------- partial-match age lists
    # births and ages of different lengths
    ("ages-malformed", rich, lambda m: _firsts(m).births.append(0), r"partial-match age list of tree node \d+ is malformed"),
    # the head moved past a live entry
    ("ages-head-skips-live", rich, lambda m: setattr(_firsts(m), "head", 1),
     r"partial-match age list of tree node \d+ skips a live child"),
    # two live entries in the wrong (not creation) order
    ("ages-order", rich, swap_ages, r"partial-match age list of tree node \d+ is out of step with its children"),
    # a stale entry counted that is not there
    ("ages-stale-count", rich, lambda m: setattr(_firsts(m), "stale", 1),
     r"partial-match age list of tree node \d+ is out of step with its children"),
]


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Fail, instead of hanging, when the walk never ends (the root loop, were its check gone)."""

    def expire(signum, frame):
        raise AssertionError(f"verify_integrity ran past {seconds} s: a loop went unnoticed")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize(("builder", "corrupt", "message"), [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_check_fires(builder, corrupt, message) -> None:
    m = builder()
    m.verify_integrity()  # healthy
    corrupt(m)
    with _deadline(10.0), pytest.raises(IntegrityError, match=message):
        m.verify_integrity()


def test_case_ids_unique_and_messages_compile() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))
    for c in CASES:
        re.compile(c[3])


# --------------------------------------------------------------------------- what the checks read
def test_heap_entries_copy_the_whole_expiry_heap() -> None:
    """`FreeQueues.heap_entries` (read by the lost-expiry check) holds every heap entry, the
    stale ones too, as an immutable copy: a later arming changes the heap, not the copy."""
    m = rich()
    q = _wm(m).queues
    entries = q.heap_entries()
    assert isinstance(entries, tuple) and sorted(entries) == sorted(q._heap)
    assert len(entries) == q.heap_size > len(q.armed) > 0
    assert all((q.expiry[b], c, b) in entries for b, c in q.armed.items())
    keep = RetentionConfig((TokenRangeRetention(0, None, 70, 50.0),))
    m.add_sequence(Request("x", list(range(800, 808)), retention=keep))
    m.remove_sequence("x")  # arms two more expiries
    assert q.heap_size == len(entries) + 2 and len(q.heap_entries()) == q.heap_size
    m.verify_integrity()


@pytest.mark.parametrize("builder", [rich, multimodal])
def test_first_key_is_the_key_each_child_is_filed_under(builder) -> None:
    """`first_key(c)` (read by the child-key check) is the key `c`'s parent files it under, and
    its first block's bytes open `c`'s content (multimodal and salted nodes included)."""
    m = builder()
    t = _tree(m)
    checked = 0
    for n in [ROOT, *t.iter_nodes()]:
        for key, c in (t.children[n] or {}).items():
            first, own_key = t.first_key(c)
            assert own_key == key
            assert t.content[c].startswith(first) and len(first) == min(len(t.content[c]), t.unit(c) * TPB)
            checked += 1
    assert checked == t.num_nodes


def test_every_check_says_which_invariant_it_guards() -> None:
    """A failing check is found by its name and its docstring: every check function has one."""
    checks = {
        name: f
        for name, f in vars(integrity).items()
        if inspect.isfunction(f) and f.__module__ == integrity.__name__ and name.lstrip("_").startswith(("verify", "check"))
    }
    assert len(checks) >= 20
    assert [name for name, f in checks.items() if not (f.__doc__ or "").strip()] == []
