"""Bad input, everywhere, before any state changes (every entry point refuses it with a typed error).

A table over the whole public surface (every argument of every `KVCacheManager` method, and
the constructors of `Request`, `RetentionConfig`, `TokenRangeRetention`, `MultimodalItem`,
`CacheConfig` and `KVCacheManager`) times classes of bad input (wrong types, bools where ints
go, floats, NaN/inf, numpy scalars and arrays, huge and negative values). Every case must raise
the documented `KVCacheError` subclass and leave `snapshot()` exactly as it was; numpy integer
scalars are accepted wherever an int is. docs/reliability.md has the same table in prose.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from ledger_helpers import FakeClock, busy_manager, make_config

from kvjax import (
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidRequestError,
    KVCacheError,
    KVCacheManager,
    MultimodalItem,
    PrefixReuseSummary,
    Request,
    RetentionConfig,
    SchedulingStateError,
    TokenRangeRetention,
    UnknownBlockError,
    UnknownRequestError,
)
from kvjax.errors import ArgumentTypeError, TransferSequenceError

# classes of bad input (a value standing for each)
BAD = {
    "str": "1",
    "none": None,
    "bool": True,
    "np_bool": np.bool_(True),
    "float": 1.0,  # integral, still not an int
    "half": 0.5,
    "nan": math.nan,
    "inf": math.inf,
    "np_float": np.float64(1.0),
    "array": np.array([1, 2]),
    "array0": np.array(1),
    "list": [1],
    "huge": 10**30,
    "negative": -1,
}
ALL = frozenset(BAD)
FLAGS = frozenset({"bool", "np_bool"})  # valid for a bool argument


def cases(rows):
    out = []
    for name, fn, valid, error in rows:
        for cls in sorted(ALL - valid):
            err = error.get(cls, error[None]) if isinstance(error, dict) else error
            out.append(pytest.param(fn, BAD[cls], err, id=f"{name}-{cls}"))
    return out


HOST_SLOTS = {"array": UnknownBlockError, None: InvalidArgumentError}  # [1, 2]: slot 2 is out of range
HOST_SLOT = {"huge": UnknownBlockError, "negative": UnknownBlockError, None: InvalidArgumentError}

# (name, call(manager, value), classes that are valid there, error or {class: error, None: default})
MANAGER_ROWS = [
    ("add_token.token", lambda m, v: m.add_token("a", v), {"list"}, InvalidRequestError),
    ("add_token.beam_tokens", lambda m, v: m.add_token("b", [1, v]), set(), InvalidRequestError),
    ("add_token.request_id", lambda m, v: m.add_token(v, 1), set(), UnknownRequestError),
    ("add_tokens.token", lambda m, v: m.add_tokens(["a", "c"], [1, v]), {"list"}, InvalidRequestError),
    ("add_tokens.beam_tokens", lambda m, v: m.add_tokens(["a", "b"], [1, [1, v]]), set(), InvalidRequestError),
    ("add_tokens.tokens", lambda m, v: m.add_tokens(["a"], v), {"list"}, InvalidArgumentError),
    ("add_tokens.request_id", lambda m, v: m.add_tokens(["a", v], [1, 2]), set(), UnknownRequestError),
    (
        "add_tokens.request_ids",
        lambda m, v: m.add_tokens(v, [1]),
        set(),
        {"list": UnknownRequestError, None: InvalidArgumentError},
    ),
    ("add_pending_tokens.request_id", lambda m, v: m.add_pending_tokens(["a", v]), set(), UnknownRequestError),
    (
        "add_pending_tokens.request_ids",
        lambda m, v: m.add_pending_tokens(v),
        set(),
        {"list": UnknownRequestError, "array": UnknownRequestError, None: InvalidArgumentError},
    ),
    ("set_pending_tokens.token", lambda m, v: m.set_pending_tokens(["a"], [v]), set(), InvalidRequestError),
    (
        "set_pending_tokens.tokens",
        lambda m, v: m.set_pending_tokens(["a"], v),
        set(),
        {"list": InvalidRequestError, "array": InvalidArgumentError, None: InvalidArgumentError},
    ),
    ("set_pending_tokens.request_id", lambda m, v: m.set_pending_tokens([v], [1]), set(), UnknownRequestError),
    ("store_new_blocks.request_id", lambda m, v: m.store_new_blocks(["a", v]), set(), UnknownRequestError),
    (
        "store_new_blocks.request_ids",
        lambda m, v: m.store_new_blocks(v),
        set(),
        {"list": UnknownRequestError, "array": UnknownRequestError, None: InvalidArgumentError},
    ),
    ("rewind.n", lambda m, v: m.rewind("a", v), set(), InvalidRequestError),
    ("set_context_position.position", lambda m, v: m.set_context_position("a", v), set(), InvalidRequestError),
    ("store_blocks_for_reuse.pin", lambda m, v: m.store_blocks_for_reuse("a", pin=v), FLAGS, InvalidArgumentError),
    ("remove_sequence.store_for_reuse", lambda m, v: m.remove_sequence("a", store_for_reuse=v), FLAGS, InvalidArgumentError),
    ("remove_sequence.pin", lambda m, v: m.remove_sequence("a", pin=v), FLAGS, InvalidArgumentError),
    ("unpin_blocks.ids", lambda m, v: m.unpin_blocks(v), set(), InvalidArgumentError),
    ("unpin_blocks.id", lambda m, v: m.unpin_blocks([v]), set(), InvalidArgumentError),
    # (arrays and lists cannot be dict keys at all)
    ("unpin_blocks.window", lambda m, v: m.unpin_blocks({v: [0]}), {"array", "array0", "list"}, InvalidArgumentError),
    ("block_ids.window", lambda m, v: m.block_ids("a", v), {"none"}, InvalidArgumentError),
    (
        "block_table.request_ids",
        lambda m, v: m.block_table(v),
        set(),
        {"list": UnknownRequestError, "array": UnknownRequestError, None: InvalidArgumentError},
    ),
    ("block_table.window", lambda m, v: m.block_table(["a"], v), {"none"}, InvalidArgumentError),
    ("block_table.max_blocks", lambda m, v: m.block_table(["a"], max_blocks=v), {"none"}, InvalidArgumentError),
    ("block_offsets.max_blocks", lambda m, v: m.block_offsets(["a"], max_blocks=v), {"none"}, InvalidArgumentError),
    ("num_free_blocks.window", lambda m, v: m.num_free_blocks(v), {"none"}, InvalidArgumentError),
    ("num_allocated_blocks.window", lambda m, v: m.num_allocated_blocks(v), {"none"}, InvalidArgumentError),
    ("num_free_secondary_blocks.window", lambda m, v: m.num_free_secondary_blocks(v), {"none"}, InvalidArgumentError),
    ("priority_of_block.block_id", lambda m, v: m.priority_of_block(v), set(), UnknownBlockError),
    ("block.block_id", lambda m, v: m.block(v), set(), UnknownBlockError),
    ("request_stats.request_id", lambda m, v: m.request_stats(v), set(), UnknownRequestError),
    # (no recurrent-state window in this cache: tests/ledger/test_recurrent_window.py has a hybrid's table)
    ("begin_recurrent_step.request_ids", lambda m, v: m.begin_recurrent_step(v), set(), InvalidArgumentError),
    ("recurrent_next_chunk_end.request_id", lambda m, v: m.recurrent_next_chunk_end(v), set(), UnknownRequestError),
    ("recurrent_state_position.request_id", lambda m, v: m.recurrent_state_position(v), set(), UnknownRequestError),
    ("add_sequence.request", lambda m, v: m.add_sequence(v), set(), InvalidRequestError),
    ("add_sequences.requests", lambda m, v: m.add_sequences(v), set(), InvalidRequestError),
    ("add_sequence.prompt_token", lambda m, v: m.add_sequence(Request("new", [1, v])), set(), InvalidRequestError),
    ("analyze_prefix_reuse.request", lambda m, v: m.analyze_prefix_reuse(v), set(), InvalidRequestError),
    (
        "analyze_prefix_reuse.prompt_token",
        lambda m, v: m.analyze_prefix_reuse(Request("q", [1, 2, v])),
        set(),
        InvalidRequestError,
    ),
    ("needed_blocks_one_step.request", lambda m, v: m.needed_blocks_one_step(v), set(), UnknownRequestError),
    ("needed_blocks_one_step.two_steps", lambda m, v: m.needed_blocks_one_step("a", v), FLAGS, InvalidArgumentError),
    ("needed_blocks_one_step.window", lambda m, v: m.needed_blocks_one_step("a", window=v), {"none"}, InvalidArgumentError),
    (
        "needed_blocks_one_step.summary",
        lambda m, v: m.needed_blocks_one_step(Request("q", [1, 2]), summary=v),
        {"none"},
        InvalidArgumentError,
    ),
    (
        "remaining_blocks_to_completion.window",
        lambda m, v: m.remaining_blocks_to_completion("a", v),
        {"none"},
        InvalidArgumentError,
    ),
    (
        "remaining_blocks_to_completion.summary",
        lambda m, v: m.remaining_blocks_to_completion("a", summary=v),
        {"none"},
        InvalidArgumentError,
    ),
    (
        "remaining_blocks_to_completion.prompt_token",
        lambda m, v: m.remaining_blocks_to_completion(Request("q", [v, 2])),
        set(),
        InvalidRequestError,
    ),
    ("needed_blocks_one_step_many.request_id", lambda m, v: m.needed_blocks_one_step_many(["a", v]), set(), UnknownRequestError),
    (
        "needed_blocks_one_step_many.request_ids",
        lambda m, v: m.needed_blocks_one_step_many(v),
        set(),
        {"list": UnknownRequestError, "array": UnknownRequestError, None: InvalidArgumentError},
    ),
    ("needed_blocks_one_step_many.two_steps", lambda m, v: m.needed_blocks_one_step_many(["a"], v), FLAGS, InvalidArgumentError),
    (
        "needed_blocks_one_step_many.window",
        lambda m, v: m.needed_blocks_one_step_many(["a"], window=v),
        {"none"},
        InvalidArgumentError,
    ),
    (
        "remaining_blocks_to_completion_many.request_id",
        lambda m, v: m.remaining_blocks_to_completion_many(["a", v]),
        set(),
        UnknownRequestError,
    ),
    (
        "remaining_blocks_to_completion_many.request_ids",
        lambda m, v: m.remaining_blocks_to_completion_many(v),
        set(),
        {"list": UnknownRequestError, "array": UnknownRequestError, None: InvalidArgumentError},
    ),
    (
        "remaining_blocks_to_completion_many.window",
        lambda m, v: m.remaining_blocks_to_completion_many(["a"], v),
        {"none"},
        InvalidArgumentError,
    ),
    (
        "scheduling_remove_sequence.request_id",
        lambda m, v: (m.start_scheduling(), m.scheduling_remove_sequence(v)),
        set(),
        UnknownRequestError,
    ),
    (
        "scheduling_has_free_blocks.n",
        lambda m, v: (m.start_scheduling(), m.scheduling_has_free_blocks(v)),
        {"huge"},
        InvalidArgumentError,
    ),
    (
        "scheduling_has_free_blocks.window",
        lambda m, v: (m.start_scheduling(), m.scheduling_has_free_blocks(1, v)),
        {"none"},
        InvalidArgumentError,
    ),
    (
        "scheduling_num_free_blocks.window",
        lambda m, v: (m.start_scheduling(), m.scheduling_num_free_blocks(v)),
        {"none"},
        InvalidArgumentError,
    ),
    (
        "get_latest_events.timeout",
        lambda m, v: m.get_latest_events(v),
        {"none", "float", "half", "np_float"},
        InvalidArgumentError,
    ),
    (
        "transfers_failed.plan",
        lambda m, v: m.transfers_failed(v),
        set(),
        {"huge": TransferSequenceError, None: InvalidArgumentError},
    ),
    ("transfers_failed.op_indices", lambda m, v: m.transfers_failed(m._transfers.issued, v), {"none"}, InvalidArgumentError),
    # tier-3 hooks (kvjax.ledger.tier3): the busy manager has host slots 0 and 1
    ("pin_host_slots.slots", lambda m, v: m.pin_host_slots(None, v), {"list"}, HOST_SLOTS),
    ("pin_host_slots.slot", lambda m, v: m.pin_host_slots(None, [0, v]), set(), HOST_SLOT),
    ("pin_host_slots.window", lambda m, v: m.pin_host_slots(v, [0]), {"none"}, InvalidArgumentError),
    ("unpin_host_slots.slots", lambda m, v: m.unpin_host_slots(None, v), set(), HOST_SLOTS),
    ("unpin_host_slots.slot", lambda m, v: m.unpin_host_slots(None, [v]), set(), HOST_SLOT),
    ("unpin_host_slots.window", lambda m, v: m.unpin_host_slots(v, [0]), set(), InvalidArgumentError),
    ("host_slot_pins.window", lambda m, v: m.host_slot_pins(v), {"none"}, InvalidArgumentError),
    ("enable_host_notices.evict_guard", lambda m, v: m.enable_host_notices(v), {"none"}, InvalidArgumentError),
    ("reserve_restore.request", lambda m, v: m.reserve_restore(v, 1), set(), InvalidRequestError),
    ("reserve_restore.num_blocks", lambda m, v: m.reserve_restore(Request("q", list(range(17))), v), set(), InvalidArgumentError),
    ("commit_restore.ticket", lambda m, v: m.commit_restore(v), set(), InvalidArgumentError),
    ("abort_restore.ticket", lambda m, v: m.abort_restore(v), set(), InvalidArgumentError),
    (
        "transfers_applied.plan",
        lambda m, v: m.transfers_applied(v),
        set(),
        {"huge": TransferSequenceError, None: InvalidArgumentError},
    ),
]


@pytest.fixture(scope="module")
def busy():
    return busy_manager()


@pytest.mark.parametrize(("call", "value", "error"), cases(MANAGER_ROWS))
def test_manager_rejects_bad_argument(busy, call, value, error):
    m = busy
    before = m.snapshot()
    with pytest.raises(error) as info:
        call(m, value)
    assert isinstance(info.value, KVCacheError)
    assert m.snapshot() == before
    m.verify_integrity()


def request_rows():
    p = [1, 2, 3]
    return [
        ("Request.request_id", lambda v: Request(v, p), ALL - {"list", "array", "nan"}),
        # a tuple id (its fast path takes flat tuples of ints and strs): unhashable members fail
        ("Request.request_id_in_tuple", lambda v: Request(("client", v), p), ALL - {"list", "array", "array0"}),
        ("Request.request_id_nested", lambda v: Request(("client", (1, v)), p), ALL - {"list", "array", "array0"}),
        ("Request.prompt", lambda v: Request("r", v), {"list", "array"}),
        ("Request.max_new_tokens", lambda v: Request("r", p, max_new_tokens=v), set()),
        ("Request.beam_width", lambda v: Request("r", p, beam_width=v), set()),
        ("Request.num_draft_tokens", lambda v: Request("r", p, num_draft_tokens=v), set()),
        ("Request.lora_task_id", lambda v: Request("r", p, lora_task_id=v), {"none"}),
        ("Request.cache_salt", lambda v: Request("r", p, cache_salt=v), {"none", "str"}),
        ("Request.extra_ids", lambda v: Request("r", p, extra_ids=v), {"none"}),
        ("Request.extra_ids_entry", lambda v: Request("r", p, extra_ids=[0, v, 0]), set()),
        ("Request.mm_items", lambda v: Request("r", p, mm_items=v), set()),
        ("Request.retention", lambda v: Request("r", p, retention=v), {"none"}),
        ("Request.encoder_len", lambda v: Request("r", p, encoder_len=v), {"none"}),
        ("TokenRangeRetention.start", lambda v: TokenRangeRetention(v, None, 50), set()),
        ("TokenRangeRetention.end", lambda v: TokenRangeRetention(0, v, 50), {"none"}),
        ("TokenRangeRetention.priority", lambda v: TokenRangeRetention(0, None, v), set()),
        (
            "TokenRangeRetention.duration_s",
            lambda v: TokenRangeRetention(0, None, 50, v),
            {"none", "float", "half", "np_float", "huge"},
        ),
        ("RetentionConfig.ranges", lambda v: RetentionConfig(v), set()),
        ("RetentionConfig.decode_priority", lambda v: RetentionConfig((), v), set()),
        (
            "RetentionConfig.decode_duration_s",
            lambda v: RetentionConfig((), 35, v),
            {"none", "float", "half", "np_float", "huge"},
        ),
        ("MultimodalItem.hash", lambda v: MultimodalItem(v, 0, 1), set()),
        ("MultimodalItem.start", lambda v: MultimodalItem(b"h", v, 1), set()),
        ("MultimodalItem.length", lambda v: MultimodalItem(b"h", 0, v), set()),
    ]


@pytest.mark.parametrize(
    ("make", "value"),
    [pytest.param(fn, BAD[c], id=f"{name}-{c}") for name, fn, valid in request_rows() for c in sorted(ALL - valid)],
)
def test_request_constructors_reject_bad_field(make, value):
    with pytest.raises(InvalidRequestError):
        make(value)


CONFIG_FIELDS = {
    "tokens_per_block": set(),
    "num_layers": set(),
    "num_kv_heads": {"list"},  # one per layer (the config has one layer)
    "head_dim": {"list"},
    "max_seq_len": set(),
    "primary_blocks": set(),
    "secondary_blocks": set(),
    "dtype": set(),
    "attention_windows": {"none", "list", "array"},
    "max_beam_width": set(),
    "enable_block_reuse": FLAGS,
    "enable_partial_reuse": FLAGS,
    "copy_on_partial_reuse": FLAGS,
    "onboard_blocks": FLAGS,
    "secondary_offload_min_priority": set(),
    "sink_token_length": set(),
    "cache_type": set(),
    "event_buffer_max_size": set(),
    "max_num_tokens": {"none"},
    "layout": set(),
}


@pytest.mark.parametrize(
    ("field", "value"),
    [pytest.param(f, BAD[c], id=f"CacheConfig.{f}-{c}") for f, valid in CONFIG_FIELDS.items() for c in sorted(ALL - valid)],
)
def test_cache_config_rejects_bad_field(field, value):
    if field in ("num_kv_heads", "head_dim") and isinstance(value, np.ndarray) and value.shape == (2,):
        value = np.array([1, 2, 3])  # a one-per-layer array of the wrong length (1 layer)
    with pytest.raises(InvalidArgumentError):
        make_config(**{field: value})


def test_manager_constructor_rejects_bad_arguments():
    for bad in ({"tokens_per_block": 4}, None, "config"):
        with pytest.raises(ArgumentTypeError):
            KVCacheManager(bad)
    cfg = make_config()
    for bad in (None, 1.0, "clock"):
        with pytest.raises(ArgumentTypeError):
            KVCacheManager(cfg, clock=bad)
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidArgumentError):
            KVCacheManager(cfg, require_transfer_acks=bad)


# --------------------------------------------------------------------------- numpy integers are ints
def test_numpy_integers_are_accepted_as_ints():
    """Engines pass numpy scalars (`int(arr[i])` is easy to forget): every int argument takes a
    numpy integer and behaves exactly as with the Python int; bools and floats never pass."""
    i = np.int64
    cfg = make_config(tokens_per_block=i(4), primary_blocks=np.int32(8), max_seq_len=i(64))
    assert type(cfg.tokens_per_block) is int and type(cfg.primary_blocks) is int
    r = Request("a", np.arange(9, dtype=np.int32), max_new_tokens=i(4), beam_width=np.uint8(1),
                retention=RetentionConfig((TokenRangeRetention(i(0), i(8), i(60), np.float32(2.0)),)))
    assert type(r.max_new_tokens) is int and r.prompt == list(range(9))
    a, b = KVCacheManager(make_config()), KVCacheManager(cfg)
    for m in (a, b):
        m.add_sequence(Request("a", list(range(9)), max_new_tokens=4))
    b.add_token("a", i(9))
    a.add_token("a", 9)
    b.set_context_position("a", i(10))
    a.set_context_position("a", 10)
    b.rewind("a", np.int16(1))
    a.rewind("a", 1)
    assert a.block_table(["a"], max_blocks=16).tolist() == b.block_table(np.array(["a"]), max_blocks=i(16)).tolist()
    assert a.priority_of_block(0) == b.priority_of_block(i(0))
    assert a.snapshot() == b.snapshot()


@pytest.mark.parametrize("length", [9, 200])
@pytest.mark.parametrize("where", ["first", "middle", "last matched"])
@pytest.mark.parametrize("style", ["dense", "sparse"])
def test_a_bool_token_is_refused_even_where_the_tree_matched(length, where, style):
    """A cached prefix proves the matched tokens' values, not their types: True equals the
    cached 1, so a prompt with a bool where a 0 or 1 is cached must still be refused (the
    unmatched rest always was), and the ledger left as it was. Dense: every token a 0 or a 1
    (the numpy search); sparse: a few among large ids, some of which share their low byte
    (256, 65536: the byte search's candidates)."""
    m = KVCacheManager(make_config(tokens_per_block=4, primary_blocks=128, max_seq_len=512))
    pos = {"first": 0, "middle": length // 2, "last matched": length - 2}[where]
    if style == "dense":
        prompt = [(7 * i) % 2 for i in range(length)]  # 0s and 1s: every position could hold a bool
    else:
        prompt = [(256, 65536)[i % 2] if i % 25 == 3 else 5002 + 3 * i for i in range(length)]
        prompt = [t + 2 if 0 < t & 0xFF < 2 else t for t in prompt]
        prompt[pos] = 1
    m.add_sequence(Request("a", prompt, max_new_tokens=1))
    m.store_context_blocks("a")
    m.remove_sequence("a")
    bad = list(prompt)
    bad[pos] = bool(bad[pos])
    before = m.snapshot()
    with pytest.raises(InvalidRequestError, match="prompt tokens"):
        m.add_sequence(Request("b", bad, max_new_tokens=1))
    assert m.snapshot() == before
    m.verify_integrity()
    ints = list(prompt)
    ints[pos] = np.int64(ints[pos])  # a numpy integer there is an int: converted, and matched
    assert m.add_sequence(Request("c", ints, max_new_tokens=1)) == length - 1
    assert m._seqs["c"].token_list() == [int(t) for t in ints]
    m.verify_integrity()


# --------------------------------------------------------------------------- the known offenders
def test_fractional_retention_start_is_refused_before_admission():
    with pytest.raises(InvalidRequestError):
        TokenRangeRetention(start=0.5, end=None, priority=80)


def test_nan_or_infinite_durations_are_refused():
    for d in (math.nan, math.inf, -1.0):
        with pytest.raises(InvalidRequestError):
            TokenRangeRetention(0, None, 80, d)
        with pytest.raises(InvalidRequestError):
            RetentionConfig((), 35, d)


def test_extra_ids_and_multimodal_starts_must_be_ints_even_when_changed_later(busy):
    m = busy
    with pytest.raises(InvalidRequestError):
        Request("x", [1, 2], extra_ids=[0, 1.5])
    with pytest.raises(InvalidRequestError):
        MultimodalItem(b"h", 0.0, 1)
    r = Request("x", [1, 2, 3], extra_ids=[0, 0, 0])
    r.extra_ids[1] = "oops"  # a Request is mutable: admission checks it again
    before = m.snapshot()
    with pytest.raises(InvalidRequestError):
        m.add_sequence(r)
    assert m.snapshot() == before


def test_huge_block_table_width_is_refused_without_allocating(busy):
    m = busy
    before = m.snapshot()
    with pytest.raises(InvalidArgumentError, match="max_blocks"):
        m.block_table(["a"], max_blocks=10**10)
    widest = 1 << (m.config.max_blocks_per_seq - 1).bit_length()
    assert m.block_table(["a"], max_blocks=widest).shape == (1, widest)  # power-of-two padding is fine
    assert m.snapshot() == before


def test_a_request_twice_in_one_block_table(busy):
    with pytest.raises(DuplicateRequestError):
        busy.block_table(["a", "a"])


def test_scheduling_remove_twice_and_out_of_order():
    m = busy_manager()
    m.start_scheduling()
    m.scheduling_remove_sequence("a")
    free = [m.scheduling_has_free_blocks(n) for n in range(20)]
    assert free == [n <= m.scheduling_num_free_blocks() for n in range(20)]
    with pytest.raises(DuplicateRequestError):
        m.scheduling_remove_sequence("a")  # would count a's blocks free twice
    assert [m.scheduling_has_free_blocks(n) for n in range(20)] == free  # prediction intact
    m.add_token("a", 7)  # the ledger moves on: the dry run is stale
    m.add_sequence(Request("late", [5, 6, 7]))
    with pytest.raises(SchedulingStateError):
        m.scheduling_has_free_blocks(1)
    with pytest.raises(SchedulingStateError):
        m.scheduling_num_free_blocks()
    with pytest.raises(SchedulingStateError):
        m.scheduling_remove_sequence("b")
    m.start_scheduling()  # a new dry run starts clean, "a" may be removed again
    m.scheduling_remove_sequence("a")
    fresh = KVCacheManager(make_config())
    with pytest.raises(SchedulingStateError):
        fresh.scheduling_has_free_blocks(0)


def test_contains_never_raises(busy):
    assert ["unhashable"] not in busy and "zz" not in busy and "a" in busy


def test_every_public_method_is_in_the_table():
    """A new public method must join the table above (or be argument-free)."""
    covered = {name.split(".")[0] for name, *_ in MANAGER_ROWS}
    no_args = {"stats", "iteration_stats", "refresh_blocks", "flush_iteration_events", "take_transfers",
               "verify_integrity", "snapshot", "start_scheduling", "reset_prefix_cache", "pending_tokens",
               "take_host_notices"}
    id_only = {"store_context_blocks", "store_new_block", "pin_blocks"}  # unknown ids: test_errors.py
    public = {n for n in dir(KVCacheManager) if not n.startswith("_") and callable(getattr(KVCacheManager, n))}
    assert public - covered - no_args - id_only == set()


@pytest.mark.parametrize("name", ["store_context_blocks", "store_new_block", "pin_blocks", "remove_sequence", "request_stats"])
def test_id_only_methods_reject_unknown_and_unhashable_ids(busy, name):
    for bad in ("zz", ["x"], math.nan, None):
        before = busy.snapshot()
        with pytest.raises(UnknownRequestError):
            getattr(busy, name)(bad)
        assert busy.snapshot() == before


def test_prefix_reuse_summary_from_elsewhere_is_accepted(busy):
    s = busy.analyze_prefix_reuse(Request("q", list(range(9))))
    assert isinstance(s, PrefixReuseSummary)
    assert busy.needed_blocks_one_step(Request("q", list(range(9))), summary=s) >= 0


def test_durations_expire_on_the_injected_clock():
    clock = FakeClock()
    m = KVCacheManager(make_config(), clock=clock)
    m.add_sequence(Request("a", list(range(9)), retention=RetentionConfig((TokenRangeRetention(0, None, 80, 1.0),))))
    m.remove_sequence("a")
    clock.advance(0.5)
    assert m.refresh_blocks() == 0
    clock.advance(1.0)
    assert m.refresh_blocks() == 3  # [0, 4), [4, 8) and the partial [8]


def test_tuple_request_ids_are_tracked_like_any_other():
    """A flat tuple of ints and strs takes the request's fast check; a tuple holding anything
    else takes the general one. Both are admitted and found again by an equal tuple."""
    m = KVCacheManager(make_config(tokens_per_block=4, primary_blocks=8))
    plain, general = ("client", 7), ("client", (1, 2.5))
    assert Request(plain, [1, 2, 3])._plain() and not Request(general, [1, 2, 3])._plain()
    for rid in (plain, general):
        m.add_sequence(Request(rid, [1, 2, 3, 4, 5]))
    m.add_token(("client", 7), 9)
    m.add_token(("client", (1, 2.5)), 9)
    assert m.block_ids(("client", 7)) != m.block_ids(("client", (1, 2.5)))
    assert len(m.block_ids(("client", 7))[0]) == len(m.block_ids(("client", (1, 2.5)))[0]) == 2
    with pytest.raises(DuplicateRequestError):
        m.add_sequence(Request(("client", 7), [1]))
    m.verify_integrity()
