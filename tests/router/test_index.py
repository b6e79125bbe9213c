"""PrefixIndex semantics: per replica, medium and group; longest-prefix matches; clearing."""
import pytest

from kvjax.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvjax.router import PrefixIndex, PrefixMatch


def stored(hashes, medium="GPU", group=0, parent=None, kind="full_attention"):
    return BlockStored(list(hashes), parent, [0] * 4 * len(hashes), 4, None, medium, None, group_idx=group,
                       kv_cache_spec_kind=kind)


def apply(index, replica, *events):
    index.apply(replica, KVEventBatch(0.0, list(events)))


def test_longest_prefix_per_replica():
    idx = PrefixIndex()
    apply(idx, "a", stored([1, 2, 3, 4]))
    apply(idx, "b", stored([1, 2]), stored([4]))  # b misses block 3: its run stops at 2
    apply(idx, "c", stored([2, 3]))  # no block 1: nothing usable
    m = idx.match([1, 2, 3, 4, 5], ["a", "b", "c", "d"])
    assert m == {"a": PrefixMatch(4, 4), "b": PrefixMatch(2, 2), "c": PrefixMatch(0, 0), "d": PrefixMatch(0, 0)}
    assert idx.match([], ["a"]) == {"a": PrefixMatch(0, 0)}
    assert idx.match([1, 2], ["a"]) == {"a": PrefixMatch(2, 2)}


def test_media_and_offload():
    idx = PrefixIndex()
    apply(idx, "a", stored([1, 2, 3]))
    apply(idx, "a", BlockRemoved([2], "GPU"), stored([2], "CPU", parent=1))  # offloaded
    assert idx.match([1, 2, 3], ["a"])["a"] == PrefixMatch(3, 2)
    assert idx.blocks("a", "GPU") == {1, 3} and idx.blocks("a", "CPU") == {2} and idx.blocks("a", None) == {1, 2, 3}
    apply(idx, "a", BlockRemoved([2], "CPU"))
    assert idx.match([1, 2, 3], ["a"])["a"] == PrefixMatch(1, 1)
    # a block on two tiers at once (a copy offload) stays until both copies are gone
    apply(idx, "a", stored([4], "GPU"), stored([4], "CPU"), BlockRemoved([4], "GPU"))
    assert idx.blocks("a", "CPU") == {4} and idx.blocks("a", "GPU") == {1, 3}
    apply(idx, "a", stored([5], "STORAGE"))  # another tier: held, not on the GPU
    assert idx.blocks("a", "STORAGE") == {5} and 5 not in idx.blocks("a", "GPU")


def test_removing_what_was_never_stored_is_ignored():
    idx = PrefixIndex()
    apply(idx, "a", BlockRemoved([9], "GPU"), stored([1]), BlockRemoved([1], "CPU"))
    assert idx.blocks("a", "GPU") == {1} and idx.num_blocks("a") == 1


def test_all_blocks_cleared_forgets_one_replica():
    idx = PrefixIndex()
    apply(idx, "a", stored([1, 2]))
    apply(idx, "b", stored([1, 2]))
    apply(idx, "a", AllBlocksCleared(), stored([7]))
    assert idx.blocks("a") == {7} and idx.blocks("b") == {1, 2}
    idx.clear_replica("b")
    assert idx.match([1, 2], ["a", "b"]) == {"a": PrefixMatch(0, 0), "b": PrefixMatch(0, 0)}
    assert idx.num_blocks("b") == 0 and idx._where == {(0, 7): {"a": 1}}  # nothing left behind
    idx.clear_replica("never-seen")


def test_groups_are_separate_and_full_attention_is_the_default():
    idx = PrefixIndex()
    apply(idx, "a", stored([1, 2], group=0, kind="sliding_window"), stored([1, 2, 3], group=1))
    assert idx.default_group() == 1
    assert idx.match([1, 2, 3], ["a"])["a"].blocks == 3
    assert idx.match([1, 2, 3], ["a"], group=0)["a"].blocks == 2
    apply(idx, "a", BlockRemoved([2], "GPU", group_idx=0))
    assert idx.blocks("a", group=1) == {1, 2, 3} and idx.blocks("a", group=0) == {1}


def test_hash_types():
    idx = PrefixIndex()
    apply(idx, "a", stored([b"\x01" * 32, -1]))  # bytes, and a signed i64 spelling of 2**64 - 1
    assert idx.match([b"\x01" * 32, (1 << 64) - 1], ["a"])["a"].blocks == 2
    with pytest.raises(TypeError):
        idx.apply_event("a", "BlockStored")


def test_a_bad_batch_changes_nothing():
    idx = PrefixIndex()
    apply(idx, "a", stored([1]))
    with pytest.raises(TypeError):
        apply(idx, "a", BlockRemoved([1], "GPU"), "not an event")
    with pytest.raises(ValueError):
        apply(idx, "a", stored([2]), stored([1 << 64]))
    assert idx.blocks("a") == {1} and idx.num_blocks("a") == 1 and idx.events_applied == 1
