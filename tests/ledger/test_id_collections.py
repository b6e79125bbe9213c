"""Every ledger call that takes a collection of ids takes any iterable of them (docs/reliability.md:
lists, tuples, ranges, sets, 1-D arrays, generators, dict views), with the same answer as a list
and the same typed errors (duplicates, unknown ids) leaving the state unchanged."""
from __future__ import annotations

import numpy as np
import pytest
from ledger_helpers import make_config, make_manager

from kvjax import InvalidArgumentError, KVCacheManager, Request, UnknownRequestError

KINDS = {
    "list": list,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
    "generator": lambda ids: (i for i in ids),
    "array": np.array,
    "dict_keys": lambda ids: dict.fromkeys(ids).keys(),
}


def unchanged(m, exc, fn, *args, match=None):
    before = m.snapshot()
    with pytest.raises(exc, match=match):
        fn(*args)
    assert m.snapshot() == before
    m.verify_integrity()


def pinned_ledger(**cfg) -> tuple[KVCacheManager, list[int]]:
    """A finished request whose 3 blocks stay pinned (held only by their pins)."""
    m = make_manager(**cfg)
    m.add_sequence(Request("a", list(range(1, 10))))
    ids = m.block_ids("a")[0]
    m.pin_blocks("a")
    m.remove_sequence("a")
    return m, ids


@pytest.mark.parametrize("kind", KINDS)
def test_unpin_blocks_takes_any_collection(kind):
    m, ids = pinned_ledger()
    free = m.num_free_blocks()
    m.unpin_blocks(KINDS[kind](ids))
    assert m.num_free_blocks() == free + len(ids)
    m.verify_integrity()
    m, ids = pinned_ledger()
    m.unpin_blocks({m.windows[0]: KINDS[kind](ids)})  # per window, same
    assert m.num_free_blocks() == free + len(ids)


def test_unpin_blocks_from_a_generator_keeps_its_checks():
    m, ids = pinned_ledger()
    unchanged(m, InvalidArgumentError, m.unpin_blocks, (i for i in [ids[0], ids[0]]), match="not pinned 2")
    unchanged(m, InvalidArgumentError, m.unpin_blocks, (i for i in [ids[0], 99]))  # unknown id
    unchanged(m, InvalidArgumentError, m.unpin_blocks, {ids[0], 7})  # 7 exists but is not pinned
    unchanged(m, InvalidArgumentError, m.unpin_blocks, {m.windows[0]: (i for i in [ids[1], -1])})
    unchanged(m, InvalidArgumentError, m.unpin_blocks, np.array([ids]))  # 2-D
    unchanged(m, InvalidArgumentError, m.unpin_blocks, "01")
    unchanged(m, InvalidArgumentError, m.unpin_blocks, 3)


@pytest.mark.parametrize("kind", ["tuple", "set", "generator", "dict_keys"])
def test_request_id_collections_answer_as_a_list(kind):
    """The other id-collection calls: same answer as with a list, unknown ids still raise."""
    def ledger():
        m = KVCacheManager(make_config(primary_blocks=16))
        m.add_sequences(Request(r, list(range(1, 10)), max_new_tokens=6) for r in ("a", "b"))
        return m

    as_kind = KINDS[kind]
    ids = ["a"] if kind == "set" else ["a", "b"]  # a set has no order to compare rows by
    ref, m = ledger(), ledger()
    for name, call in [
        ("block_table", lambda led, ids: led.block_table(ids)),
        ("block_offsets", lambda led, ids: led.block_offsets(ids)),
        ("needed_blocks_one_step_many", lambda led, ids: led.needed_blocks_one_step_many(ids)),
        ("remaining_blocks_to_completion_many", lambda led, ids: led.remaining_blocks_to_completion_many(ids)),
    ]:
        np.testing.assert_array_equal(call(m, as_kind(ids)), call(ref, ids), err_msg=name)
        unchanged(m, UnknownRequestError, call, m, as_kind(["a", "zz"]))
    ref.add_tokens(["a"], [5])
    m.add_tokens(as_kind(["a"]), as_kind([5]))
    ref.store_new_blocks(ids)
    m.store_new_blocks(as_kind(ids))
    assert m.snapshot() == ref.snapshot()


def offload_plan() -> tuple[KVCacheManager, object]:
    """A ledger whose newest plan offloads a cached chain (several ops)."""
    m = make_manager(secondary_blocks=4)
    m.add_sequence(Request("a", list(range(1, 10))))
    m.remove_sequence("a")
    m.add_sequence(Request("f", list(range(100, 132))))  # takes every block: the chain offloads
    plan = m.take_transfers()
    assert len(plan) >= 2
    return m, plan


def test_failed_op_indices_take_any_collection():
    m, plan = offload_plan()
    by_list = m.transfers_failed(plan, [0, 1])
    for kind in ("tuple", "set", "generator", "array", "dict_keys"):
        m, plan = offload_plan()
        assert m.transfers_failed(plan, KINDS[kind]([0, 1])) == by_list, kind
    m, plan = offload_plan()
    unchanged(m, InvalidArgumentError, m.transfers_failed, plan, (i for i in [0, 0]))
    unchanged(m, InvalidArgumentError, m.transfers_failed, plan, (i for i in [0, len(plan)]))
    unchanged(m, InvalidArgumentError, m.transfers_failed, plan, np.zeros((1, 1), dtype=int))
