"""Bad input raises a clear typed error AND leaves the ledger exactly as it was (a
failed call leaves the ledger unchanged). Every case compares the
full `snapshot()` before and after on a ledger holding live sequences, beams, cached,
offloaded and pinned blocks, pending retention expiries and events."""
import numpy as np
import pytest
from ledger_helpers import FakeClock, make_config, make_manager

from kvjax import (
    CacheConfig,
    DuplicateRequestError,
    InvalidRequestError,
    KVCacheError,
    KVCacheManager,
    MultimodalItem,
    OutOfBlocksError,
    Request,
    RetentionConfig,
    TokenRangeRetention,
    UnknownRequestError,
)

R = range


def rich():
    """A ledger in a non-trivial state (numbers are not the point here, only that nothing moves)."""
    clock = FakeClock()
    m = make_manager(
        clock=clock,
        primary_blocks=14,
        secondary_blocks=2,
        max_beam_width=2,
        event_buffer_max_size=64,
        max_seq_len=64,
    )
    keep = RetentionConfig((TokenRangeRetention(0, None, 60, 100.0),))
    m.add_sequence(Request("seed", list(R(9)), retention=keep))
    m.remove_sequence("seed")  # cached 0, 1 (priority 60, expiry armed)
    m.add_sequence(Request("big", list(R(500, 552))))  # 13 blocks: offloads the seed chain
    m.remove_sequence("big", store_for_reuse=False)
    m.add_sequence(Request("a", list(R(13)), max_new_tokens=6))  # onboards 0, 1
    m.add_token("a", 13)
    m.add_token("a", 14)
    m.add_sequence(Request("b", list(R(100, 106)), max_new_tokens=4, beam_width=2))
    m.add_sequence(Request("p", list(R(200, 205))))
    m.pin_blocks("p")
    m.remove_sequence("p")
    m.flush_iteration_events()
    m.store_context_blocks("a")  # pending Stored event stays pending
    m.verify_integrity()
    assert m.num_free_blocks() > 0 and m.stats().onboarded_blocks > 0
    return m


@pytest.fixture
def m():
    return rich()


def unchanged(m, exc, fn, *args, match=None, **kwargs):
    before = m.snapshot()
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert m.snapshot() == before
    m.verify_integrity()
    return info.value


# =========================================================================== unknown / duplicate ids
UNKNOWN_CALLS = [
    ("add_token", ("zz", 1)),
    ("rewind", ("zz", 1)),
    ("set_context_position", ("zz", 0)),
    ("store_context_blocks", ("zz",)),
    ("store_new_block", ("zz",)),
    ("store_blocks_for_reuse", ("zz",)),
    ("remove_sequence", ("zz",)),
    ("pin_blocks", ("zz",)),
    ("block_ids", ("zz",)),
    ("block_table", (["a", "zz"],)),
    ("block_offsets", (["zz"],)),
    ("request_stats", ("zz",)),
    ("needed_blocks_one_step", ("zz",)),
    ("remaining_blocks_to_completion", ("zz",)),
    ("add_token", (["unhashable"], 1)),
]


@pytest.mark.parametrize(("name", "args"), UNKNOWN_CALLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(UNKNOWN_CALLS)])
def test_unknown_request_id(m, name, args):
    err = unchanged(m, UnknownRequestError, getattr(m, name), *args)
    assert isinstance(err, KeyError) and isinstance(err, KVCacheError)
    assert "zz" in str(err) or "unhashable" in str(err)


def test_unknown_id_in_scheduling_dry_run(m):
    m.start_scheduling()
    unchanged(m, KeyError, m.scheduling_remove_sequence, "zz")


def test_removed_id_is_unknown(m):
    m.remove_sequence("a")
    unchanged(m, UnknownRequestError, m.add_token, "a", 1)
    unchanged(m, UnknownRequestError, m.remove_sequence, "a")


def test_duplicate_request_id(m):
    err = unchanged(m, DuplicateRequestError, m.add_sequence, Request("a", [1, 2, 3]))
    assert isinstance(err, ValueError) and isinstance(err, KVCacheError)


def test_duplicate_inside_a_batch(m):
    batch = [Request("n1", [1, 2, 3]), Request("n2", [4, 5]), Request("n1", [6])]
    unchanged(m, DuplicateRequestError, m.add_sequences, batch)
    assert "n1" not in m and "n2" not in m


def test_batch_with_a_live_duplicate(m):
    unchanged(m, DuplicateRequestError, m.add_sequences, [Request("n1", [1, 2, 3]), Request("b", [4])])


# =========================================================================== bad requests
@pytest.mark.parametrize(
    ("request_kwargs", "match"),
    [
        (dict(prompt=[]), "empty"),
        (dict(prompt=list(R(65))), "max_seq_len"),  # prompt over max_seq_len
        (dict(prompt=list(R(20)), max_new_tokens=45), "max_seq_len"),  # prompt + max_new over it
        (dict(prompt=[1, 2], beam_width=3), "beam"),  # over max_beam_width 2
        (dict(prompt=[1, 2.0]), "int"),
        (dict(prompt=[1, "2"]), "int"),
        (dict(prompt=[1, None]), "int"),
        (dict(prompt=[-1, 2, 3]), "int"),  # negative token id (add_token rejects it too)
        (dict(prompt=[1, 2**31]), "int"),  # beyond int32 (add_token rejects it too)
        (dict(prompt=[True, 2]), "int"),  # a bool is not a token id (add_token rejects it too)
    ],
)
def test_bad_request_rejected(m, request_kwargs, match):
    err = unchanged(m, InvalidRequestError, m.add_sequence, Request("new", **request_kwargs), match=match)
    assert isinstance(err, ValueError) and isinstance(err, KVCacheError)


@pytest.mark.parametrize("bad", [-1, -(2**31), 2**31, True, False])
@pytest.mark.parametrize("where", ["after a cached prefix", "last token", "with extra ids"])
def test_bad_token_past_the_match_rejected(m, bad, where):
    """Tokens the walk matched were checked when they were stored; the others are checked at
    admission: those the walk encoded by their sign bytes (-2**31 sets only the top one), the
    last prompt token (never encoded) on its own, and with extra ids in their 12-byte units."""
    extra = None
    if where == "after a cached prefix":
        prompt = [*R(8), bad, 9, 10]  # blocks [0..3] [4..7] are cached (request "a")
    elif where == "last token":
        prompt = [*R(8), 77, 9, bad]  # the match ends at 8: tokens 8 and 9 are encoded, the last is not
    else:
        prompt, extra = [1, 2, bad, 4, 5], [7] * 5
    unchanged(m, InvalidRequestError, m.add_sequence, Request("new", prompt, extra_ids=extra), match="int")
    good = [*R(8), 8, 9, 10] if extra is None else [1, 2, 3, 4, 5]
    assert m.add_sequence(Request("new", good, extra_ids=extra)) == (10 if extra is None else 0)  # 2 blocks + [8, 9]
    m.verify_integrity()


def test_not_a_request(m):
    unchanged(m, InvalidRequestError, m.add_sequence, {"request_id": "x", "prompt": [1]})
    unchanged(m, InvalidRequestError, m.add_sequences, [Request("ok", [1]), "nope"])


def test_unhashable_request_id(m):
    with pytest.raises(InvalidRequestError):
        Request(["x"], [1, 2])
    r = Request("ok", [1, 2])
    r.request_id = ["x"]  # a Request is mutable: admission checks again
    unchanged(m, InvalidRequestError, m.add_sequence, r)


def test_prompt_exactly_max_seq_len_is_fine(m):
    m2 = make_manager(max_seq_len=16, primary_blocks=8)
    assert m2.add_sequence(Request("x", list(R(16)))) == 0
    m2.verify_integrity()


def test_cross_cache_needs_encoder_len():
    m = make_manager(cache_type="cross")
    unchanged(m, InvalidRequestError, m.add_sequence, Request("x", [1, 2]))
    m.add_sequence(Request("x", [1, 2], encoder_len=5))
    unchanged(m, InvalidRequestError, m.add_token, "x", 3)
    unchanged(m, InvalidRequestError, m.add_sequence, Request("y", [1], encoder_len=65))


# =========================================================================== request construction
@pytest.mark.parametrize(
    "ranges",
    [
        ((0, 8, 50), (4, 12, 60)),  # overlapping
        ((0, None, 50), (8, 12, 60)),  # a range after an open-ended one
        ((8, None, 50), (0, 10, 60)),  # overlapping once sorted
    ],
)
def test_invalid_retention_ranges_rejected_at_construction(ranges):
    with pytest.raises(ValueError):
        RetentionConfig(tuple(TokenRangeRetention(*r) for r in ranges))


@pytest.mark.parametrize(
    "args",
    [
        (8, 4, 50),  # negative length
        (-1, 4, 50),  # negative start
        (0, 4, 101),  # priority over 100
        (0, 4, -1),  # priority under 0
        (0, 4, 50, -1.0),  # negative duration
    ],
)
def test_invalid_token_range_rejected(args):
    with pytest.raises(ValueError):
        TokenRangeRetention(*args)


def test_valid_adjacent_ranges_accepted():
    r = RetentionConfig((TokenRangeRetention(4, None, 10), TokenRangeRetention(0, 4, 90)))
    assert [x.start for x in r.ranges] == [0, 4]  # sorted
    with pytest.raises(ValueError):
        RetentionConfig((), decode_priority=101)
    with pytest.raises(ValueError):
        RetentionConfig((), decode_duration_s=-1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt=[1, 2], extra_ids=[0]),  # one extra id per prompt token
        dict(prompt=[1, 2], beam_width=0),
        dict(prompt=[1, 2], max_new_tokens=-1),
        dict(prompt=[1, 2], num_draft_tokens=-1),
        dict(prompt=[1, 2], cache_salt=1.5),
        dict(prompt=[1, 2], lora_task_id="x"),
        dict(prompt=[1, 2], mm_items=(MultimodalItem(b"h", 1, 5),)),  # beyond the prompt
        dict(prompt=[1, 2], encoder_len=0),
        dict(prompt=[1, 2], retention="high"),
    ],
)
def test_invalid_request_construction(kwargs):
    with pytest.raises(ValueError):
        Request("r", **kwargs)


def test_invalid_multimodal_item():
    with pytest.raises(ValueError):
        MultimodalItem(b"", 0, 1)
    with pytest.raises(ValueError):
        MultimodalItem(b"x" * 33, 0, 1)
    with pytest.raises(ValueError):
        MultimodalItem(b"x", 0, 0)


def test_manager_needs_a_cache_config():
    with pytest.raises(TypeError):
        KVCacheManager({"tokens_per_block": 4})
    with pytest.raises(ValueError):
        CacheConfig(tokens_per_block=3, num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=16, primary_blocks=4)


# =========================================================================== out of blocks
def test_add_sequence_out_of_blocks(m):
    free = m.num_free_blocks()
    err = unchanged(m, OutOfBlocksError, m.add_sequence, Request("huge", list(R(1000, 1000 + 4 * free + 1))))
    assert isinstance(err, KVCacheError)


def test_add_sequences_fails_whole_batch_even_if_first_fit(m):
    free = m.num_free_blocks()
    assert free >= 2
    batch = [
        Request("n1", list(R(300, 304))),  # 1 block: fits
        Request("n2", list(R(400, 404))),  # 1 block: fits
        Request("n3", list(R(600, 600 + 4 * (free - 1)))),  # together: one too many
    ]
    unchanged(m, OutOfBlocksError, m.add_sequences, batch)
    assert all(r not in m for r in ("n1", "n2", "n3"))
    m.add_sequences(batch[:2])  # the prefix alone fits
    m.verify_integrity()


def test_add_sequences_counts_reused_blocks_held_by_the_batch():
    m = make_manager(primary_blocks=4)
    m.add_sequence(Request("s", list(R(9))))
    m.remove_sequence("s")  # blocks 0, 1 cached, 4 free
    # each request reuses 0, 1 and needs one fresh block; cached blocks in use are not free
    batch = [Request(i, list(R(9))) for i in R(3)]
    unchanged(m, OutOfBlocksError, m.add_sequences, batch)
    assert m.add_sequences(batch[:2]) == [8, 8]


def test_add_token_out_of_blocks():
    m = make_manager(primary_blocks=2, max_beam_width=2)
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=8))
    m.add_sequence(Request("b", list(R(10, 14)), max_new_tokens=8))
    unchanged(m, OutOfBlocksError, m.add_token, "a", 4)
    m.remove_sequence("b")
    m2 = make_manager(primary_blocks=4, max_beam_width=2)
    m2.add_sequence(Request("a", list(R(4)), max_new_tokens=8, beam_width=2))  # shared 0; per beam 1, 2
    m2.add_sequence(Request("f", [9]))
    unchanged(m2, OutOfBlocksError, m2.add_token, "a", [4, 5])  # needs one block per beam, 0 free


def test_add_token_out_of_blocks_in_one_window_only():
    m = make_manager(num_layers=2, attention_windows=(64, 8), primary_blocks={8: 1, 64: 4})
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=8))
    unchanged(m, OutOfBlocksError, m.add_token, "a", 4)  # window 8 has no free block


def test_rewind_copy_needs_a_free_block():
    m = make_manager(primary_blocks=3)
    m.add_sequence(Request("a", list(R(8)), max_new_tokens=8))
    for t in R(8, 11):
        m.add_token("a", t)  # blocks 0, 1, 2: the pool is full
    m.store_blocks_for_reuse("a", pin=True)  # 11 tokens: block 2 cached as [8, 9], pinned
    # rewinding to 9 or 10 tokens rewrites positions of block 2, which a pin protects: a copy
    # is needed and no block is free (the rewind releases none)
    unchanged(m, OutOfBlocksError, m.rewind, "a", 2)
    unchanged(m, OutOfBlocksError, m.rewind, "a", 1)  # position 10 may hold KV (a verified draft)
    m.rewind("a", 3)  # 8 tokens: block 2 leaves the sequence whole (the pin keeps it), no copy
    assert m.block_ids("a") == [[0, 1]] and m.block(2).ref_count == 1
    m.verify_integrity()


# =========================================================================== bad tokens / growth
@pytest.mark.parametrize("token", [-1, 2**31, 1.0, "x", None, [1, 2], True])
def test_bad_token(m, token):
    unchanged(m, InvalidRequestError, m.add_token, "a", token)


@pytest.mark.parametrize("token", [[1], [1, 2, 3], [1, -1], -5, [1.5, 2]])
def test_bad_beam_tokens(m, token):
    unchanged(m, InvalidRequestError, m.add_token, "b", token)


def test_add_token_past_max_seq_len():
    m = make_manager(max_seq_len=8, primary_blocks=4)
    m.add_sequence(Request("a", list(R(6))))
    m.add_token("a", 6)
    m.add_token("a", 7)
    unchanged(m, InvalidRequestError, m.add_token, "a", 8, match="max_seq_len")


def test_numpy_token_accepted(m):
    m.add_token("a", np.int32(7))
    m.verify_integrity()


# =========================================================================== rewind / context position
def test_rewind_too_far(m):
    unchanged(m, InvalidRequestError, m.rewind, "a", 3)  # only 2 generated tokens
    unchanged(m, InvalidRequestError, m.rewind, "a", -1)
    unchanged(m, InvalidRequestError, m.rewind, "a", 1.0)
    unchanged(m, InvalidRequestError, m.rewind, "b", 1)  # beams cannot rewind
    m.rewind("a", 2)


def test_rewind_into_released_sliding_window_blocks():
    m = make_manager(attention_windows=(8,))
    m.add_sequence(Request("a", list(R(4)), max_new_tokens=20))
    for t in R(4, 16):
        m.add_token("a", t)  # blocks 0, 1 detached
    unchanged(m, InvalidRequestError, m.rewind, "a", 12)  # back into block 0


@pytest.mark.parametrize("pos", [-1, 16, 1.5, True])
def test_set_context_position_out_of_range(m, pos):
    unchanged(m, InvalidRequestError, m.set_context_position, "a", pos)


# =========================================================================== pin / unpin
def test_unpin_unpinned_ids(m):
    pinned = m.block_ids("a")[0]  # live, never pinned
    unchanged(m, ValueError, m.unpin_blocks, [pinned[-1]])
    unchanged(m, ValueError, m.unpin_blocks, [99])  # unknown id
    unchanged(m, ValueError, m.unpin_blocks, [-1])
    unchanged(m, ValueError, m.unpin_blocks, ["0"])


def test_unpin_is_all_or_nothing():
    m = make_manager()
    m.add_sequence(Request("a", list(R(9))))
    m.pin_blocks("a")
    m.remove_sequence("a")
    unchanged(m, ValueError, m.unpin_blocks, [0, 1, 5])  # 5 is not pinned: 0, 1 keep their pins
    unchanged(m, ValueError, m.unpin_blocks, [0, 0])  # pinned once, unpinned twice
    unchanged(m, ValueError, m.unpin_blocks, {64: [0], 8: [1]})  # unknown window
    m.unpin_blocks({64: [0, 1, 2]})
    assert m.num_free_blocks() == 8


# =========================================================================== windows and misc
def test_window_arguments():
    m = make_manager(num_layers=2, attention_windows=(64, 8))
    m.add_sequence(Request("a", list(R(5))))
    unchanged(m, ValueError, m.block_ids, "a")  # several windows: window= required
    unchanged(m, ValueError, m.block_table, ["a"])
    unchanged(m, ValueError, m.block_ids, "a", 16)
    unchanged(m, ValueError, m.num_free_blocks, 16)
    unchanged(m, ValueError, m.priority_of_block, 0)


def test_priority_of_unknown_block(m):
    unchanged(m, KeyError, m.priority_of_block, 14 + 2)
    unchanged(m, KeyError, m.priority_of_block, -1)


def test_scheduling_requires_start(m):
    unchanged(m, RuntimeError, m.scheduling_remove_sequence, "a")
    unchanged(m, RuntimeError, m.scheduling_has_free_blocks, 1)


def test_failed_calls_leave_transfers_and_events_untouched(m):
    before = m.snapshot()
    for call in (
        lambda: m.add_sequence(Request("huge", list(R(2000, 2032)))),
        lambda: m.add_token("zz", 1),
        lambda: m.rewind("a", 5),
    ):
        with pytest.raises(KVCacheError):
            call()
    assert m.snapshot() == before
    m.take_transfers()  # what the successful setup decided
    m.flush_iteration_events()
    assert len(m.take_transfers()) == 0


def test_error_config_check():
    # sanity: a fixture-free config can be built with the helper defaults
    assert make_config().windows == (64,)


def test_numpy_integer_prompt_tokens_are_accepted_as_ints():
    # a list of numpy ints (e.g. from array.tolist() of another dtype, or a comprehension over an
    # array) is as good as Python ints: same keys, so it reuses what Python-int prompts stored
    import numpy as np

    m = make_manager()
    m.add_sequence(Request("py", list(R(9))))
    m.remove_sequence("py")
    assert m.add_sequence(Request("np", [np.int64(t) for t in R(9)])) == 8
    assert m._seqs["np"].token_list() == list(R(9))
    m.verify_integrity()
