"""Claiming and releasing blocks through `RefCounts` (a block is referenced or in exactly one
free queue, never both, whichever call takes it), and the storing cursor `StoreCursor`."""
from ledger_helpers import make_manager

from kvjax import Request
from kvjax.ledger.free_queues import NOT_FREE, PRIMARY, SECONDARY
from kvjax.ledger.sequence import StoreCursor


def _wm(m):
    return m._bm.windows[0]


def _referenced_and_out_of_queues(wm, blocks) -> bool:
    return all(wm.refs.ref[b] == 1 and wm.queues.queue[b] == NOT_FREE for b in blocks)


def test_claim_takes_a_free_block_out_of_its_queue_and_references_it():
    m = make_manager()
    wm = _wm(m)
    free_before = wm.queues.num_free[PRIMARY]
    wm.refs.claim(3)
    assert _referenced_and_out_of_queues(wm, [3])
    assert wm.queues.num_free[PRIMARY] == free_before - 1
    wm.refs.claim(3)  # a second holder: already out of the queues
    assert wm.refs.ref[3] == 2 and wm.queues.num_free[PRIMARY] == free_before - 1
    wm.refs.release(3)
    assert wm.queues.queue[3] == NOT_FREE  # one holder left
    wm.refs.release(3)
    assert wm.refs.ref[3] == 0 and wm.queues.queue[3] != NOT_FREE
    assert wm.queues.num_free[PRIMARY] == free_before


def test_claim_many_skips_gaps_and_blocks_in_use():
    m = make_manager()
    wm = _wm(m)
    wm.refs.claim(1)
    wm.refs.claim_many([0, None, 1, 2])
    assert [wm.refs.ref[b] for b in range(4)] == [1, 2, 1, 0]
    assert all(wm.queues.queue[b] == NOT_FREE for b in (0, 1, 2))
    wm.refs.claim_many([4, 5], free=[4, 5])  # the caller saw both free
    assert _referenced_and_out_of_queues(wm, [4, 5])
    assert wm.queues.num_free[PRIMARY] == 8 - 5


def test_claim_victims_returns_referenced_blocks_in_eviction_order():
    m = make_manager()
    wm = _wm(m)
    order = wm.queues.free_blocks(PRIMARY)
    out = wm.refs.claim_victims(3)
    assert out == order[:3]
    assert _referenced_and_out_of_queues(wm, out)
    wm.refs.release_run(out)
    assert wm.queues.free_blocks(PRIMARY) == order[3:] + out


def test_get_free_block_copy_prefix_and_take_fresh_all_return_referenced_blocks():
    m = make_manager()
    wm = _wm(m)
    b = wm.get_free_block(None, None)
    c = wm.copy_prefix(b, 2, None, None)
    fresh = wm.take_fresh(2, None)
    assert _referenced_and_out_of_queues(wm, [b, c, *fresh])
    assert len({b, c, *fresh}) == 4
    for x in (b, c, *fresh):
        wm.release_block(x)
    m.verify_integrity()


def test_onboard_returns_its_target_to_the_queues_unreferenced():
    m = make_manager(primary_blocks=4, secondary_blocks=2, onboard_blocks=True)
    wm = _wm(m)
    sec = wm.num_primary  # a secondary block, claimed by a sequence about to reuse it
    wm.refs.claim(sec)
    wm.onboard(sec)
    assert wm.columns.level[sec] == PRIMARY
    assert wm.refs.ref[sec] == 1
    assert sum(wm.refs.ref) == 1  # the swapped-out target went back unreferenced
    assert wm.queues.num_free == [3, 2]
    wm.release_block(sec)


def test_an_offloaded_victim_goes_back_unreferenced_and_its_spare_is_claimed():
    m = make_manager(primary_blocks=4, secondary_blocks=2)
    m.add_sequence(Request("seed", list(range(9))))
    m.remove_sequence("seed")  # blocks 0, 1 cached; free order 3, 2, 1, 0
    wm = _wm(m)
    assert [wm.get_free_block(None, None) for _ in range(2)] == [3, 2]  # uncached victims
    b = wm.get_free_block(None, None)  # victim 1 is cached: offloaded into spare 4, which is claimed
    assert b == 4 and wm.columns.level[4] == PRIMARY and wm.columns.level[1] == SECONDARY
    assert _referenced_and_out_of_queues(wm, [3, 2, 4])
    assert wm.refs.ref[1] == 0 and wm.queues.queue[1] != NOT_FREE  # on secondary memory, free
    assert wm.counters.offloaded == 1
    for x in (3, 2, 4):
        wm.release_block(x)
    m.verify_integrity()


def test_store_moves_a_named_cursor_that_the_tree_still_holds():
    m = make_manager()
    m.add_sequence(Request("a", list(range(9))))
    m.store_context_blocks("a")
    cur = m._seqs["a"].windows[0].cursor
    assert isinstance(cur, StoreCursor) and cur.full_blocks == 2
    tree = m._bm.tree
    assert tree.holds(cur.node, cur.pid)
    assert not tree.holds(cur.node, tree.pid[cur.node] + tree.length[cur.node])  # one past the node's end
    for t in range(9, 13):  # token 12 is not computed yet: 12 materialised, 3 full blocks
        m.add_token("a", t)
    m.store_new_block("a")
    cur2 = m._seqs["a"].windows[0].cursor
    assert cur2.full_blocks == 3 and tree.holds(cur2.node, cur2.pid)
    m.verify_integrity()
