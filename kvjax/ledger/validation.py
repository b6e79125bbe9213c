"""Argument and request checks of `KVCacheManager`'s entry points (the rules live in
`kvjax.validation`).

Each function raises a typed `KVCacheError` before the manager touches any state, and returns
the argument normalised (numpy integers as `int`, id collections as lists).
"""
from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from operator import countOf
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvjax.config import CacheConfig
from kvjax.errors import DuplicateRequestError, InvalidArgumentError, InvalidRequestError
from kvjax.ledger.sequence import TrackedSequence
from kvjax.ledger.token_path import EXTRA_UNIT, NATIVE_LITTLE, PLAIN_UNIT, TokenPath
from kvjax.ledger.token_store import TokenStore
from kvjax.request import Request
from kvjax.validation import INT32_MAX, check_bool, check_id_list, check_int, check_real, is_int

if TYPE_CHECKING:
    from kvjax.ledger.block_manager import BlockManager
    from kvjax.ledger.window_manager import WindowBlockManager

# `_bool_in_prefix`: the byte of a native int32 holding its low 8 bits, a table mapping a
# low byte of 0 or 1 (a bool's value) to 0 and any other to 1, and how many such tokens a
# matched prefix may hold before numpy searches it instead
_LOW_BYTE = 0 if NATIVE_LITTLE else 3
_ZERO_IF_0_OR_1 = bytes(int(v > 1) for v in range(256))
_FEW_CANDIDATES = 32


def check_window(window: object) -> None:
    """None (the only window) or an int window size; a float or bool would alias an int key."""
    if window is not None and not is_int(window):
        raise InvalidArgumentError(f"window must be an int window size or None, got {window!r} ({type(window).__name__})")


def window_manager(bm: BlockManager, window: object) -> WindowBlockManager:
    """The manager of attention window `window` (None: the only one)."""
    check_window(window)
    if window is None:
        if len(bm.windows) != 1:
            raise InvalidArgumentError(f"this cache has several attention windows {bm.config.windows}; pass window=")
        return bm.windows[0]
    try:
        return bm.windows[bm.window_index[window]]  # type: ignore[index]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown attention window {window!r}; windows are {bm.config.windows}") from None


def max_table_width(config: CacheConfig) -> int:
    """Widest block table a caller may ask for: the power-of-two bucket of the widest row any
    sequence can have. A wider table can only be a mistake (and could be gigabytes)."""
    n = config.max_blocks_per_seq
    return 1 << (n - 1).bit_length()


def check_max_blocks(config: CacheConfig, max_blocks: object) -> int | None:
    if max_blocks is None:
        return None
    return check_int("max_blocks", max_blocks, 0, max_table_width(config))


def check_table_ids(request_ids: object) -> Sequence[Hashable]:
    """Request ids of a block table: a collection, each id once (a repeated row would make a
    forward write the same positions twice)."""
    ids = check_id_list("request_ids", request_ids)
    try:
        unique = len(set(ids)) == len(ids)
    except TypeError:  # an unhashable id: the lookup reports it as unknown
        return ids
    if not unique:
        seen: set = set()
        for rid in ids:
            if rid in seen:
                raise DuplicateRequestError(f"request id {rid!r} appears twice in request_ids")
            seen.add(rid)
    return ids


def check_flag(name: str, value: object) -> bool:
    return check_bool(name, value)


def check_timeout(timeout: object) -> float | None:
    """None (do not wait) or a finite number of seconds threading can wait for."""
    if timeout is None:
        return None
    return check_real("timeout", timeout, 0.0, threading.TIMEOUT_MAX)


def check_token_arg(token: object) -> int | list[int]:
    """`add_token`'s token: one int, or a list/tuple/1-D integer array of ints (one per beam)."""
    if is_int(token):
        return int(token)
    if isinstance(token, np.ndarray):
        if token.ndim != 1 or token.dtype.kind not in "iu":
            raise InvalidRequestError(f"token must be an int or a 1-D integer array, got {token.dtype} {token.shape}")
        token = token.tolist()
    if not isinstance(token, (list, tuple)):
        raise InvalidRequestError(f"token must be an int or one int per beam, got {token!r} ({type(token).__name__})")
    return [check_int("token", t, 0, INT32_MAX, error=InvalidRequestError) for t in token]


def check_unpin_ids(block_ids: object) -> list[tuple[int | None, list | tuple]]:
    """Any collection of block ids (list, tuple, range, set, 1-D array, generator, ...), or a
    mapping window -> such a collection, as `(window or None, ids)` pairs: a generator is read
    once, here, before anything changes."""
    if isinstance(block_ids, Mapping):
        out = []
        for w, ids in block_ids.items():
            check_window(w)
            out.append((w, _id_collection("block_ids", ids)))
        return out
    return [(None, _id_collection("block_ids", block_ids))]


def _id_collection(name: str, ids: object) -> list | tuple:
    if isinstance(ids, np.ndarray) and ids.ndim != 1:
        raise InvalidArgumentError(f"{name} must be one-dimensional, got shape {ids.shape}")
    return check_id_list(name, ids)


def check_op_indices(op_indices: object, num_ops: int) -> set[int]:
    """The failed ops of a plan: None (all of them) or distinct indices into the plan."""
    if op_indices is None:
        return set(range(num_ops))
    op_indices = _id_collection("op_indices", op_indices)  # any collection; a generator is read once
    out = [check_int("op index", i, 0, num_ops - 1) for i in op_indices] if num_ops else list(op_indices)
    if op_indices and not num_ops:
        raise InvalidArgumentError("the plan has no ops")
    if len(set(out)) != len(out):
        raise InvalidArgumentError(f"op_indices lists an op twice: {sorted(out)}")
    if not out:
        raise InvalidArgumentError("op_indices is empty: report a plan that applied with transfers_applied")
    return set(out)


# ---------------------------------------------------------------------------- requests and tokens
def validate_request(
    request: object,
    config: CacheConfig,
    num_windows: int,
    is_cross: bool,
    live: dict,
    batch_ids: set | None,
    live_ok: bool,
    store: TokenStore,
) -> TrackedSequence:
    """A `Request` checked as admission needs it (its fields again: a Request is mutable),
    returned as the sequence admission would build. Token *values* are checked later, on the
    tokens the tree walk did not match (`check_token_values`)."""
    if not isinstance(request, Request):
        raise InvalidRequestError(f"expected a kvjax.Request, got {type(request).__name__}")
    request.validate()
    rid = request.request_id
    if not live_ok and (rid in live or (batch_ids is not None and rid in batch_ids)):
        raise DuplicateRequestError(f"request id {rid!r} is already tracked")
    if request.beam_width > config.max_beam_width:
        raise InvalidRequestError(f"beam_width={request.beam_width} exceeds max_beam_width={config.max_beam_width}")
    if is_cross:
        if request.encoder_len is None:
            raise InvalidRequestError("a cross-attention cache needs request.encoder_len")
        length = request.encoder_len
    else:
        length = len(request.prompt)
        if length == 0:
            raise InvalidRequestError(f"request {rid!r} has an empty prompt")
    if length + (0 if is_cross else request.max_new_tokens) > config.max_seq_len:
        raise InvalidRequestError(
            f"request {rid!r}: {length} prompt tokens + max_new_tokens={request.max_new_tokens} "
            f"exceed max_seq_len={config.max_seq_len}"
        )
    prompt = request.prompt
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequestError(f"request {rid!r}: prompt must be a list of token ids, got {type(prompt).__name__}")
    # One cheap pass over the whole prompt (exact ints keep the sum an int; floats, str and
    # None do not). Values are checked after the tree walk, on the tokens that did not
    # match: matched tokens equal cached ones, which were checked when they were stored.
    tokens = prompt
    try:
        exact = type(sum(prompt)) is int
    except TypeError:
        exact = False
    if not exact:  # numpy integers are converted once; anything else is rejected
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in prompt):
            raise InvalidRequestError(f"request {rid!r}: prompt tokens must be ints in [0, 2**31)")
        tokens = [int(t) for t in prompt]
    if request.extra_ids is not None and len(request.extra_ids) != len(request.prompt):
        raise InvalidRequestError(f"request {rid!r}: extra_ids needs one id per prompt token")
    return TrackedSequence(request, num_windows, is_cross, store, tokens)


def check_token_values(seq: TrackedSequence, start: int, path: TokenPath | None = None) -> None:
    """Token ids from `start` on must be ints in [0, 2**31) (bools are not token ids); the
    first `start` (the ones the tree walk matched, so their values are cached ones) must not
    be bools.

    `path`: the prompt's first `path.num_tokens` tokens as admission encoded them (from block
    0): encoding proved them int32, so only their sign bytes are read (one C-level test
    instead of a `min` and a `max` over Python ints)."""
    tokens = seq.tokens
    assert tokens is not None  # checked before admission commits: still the prompt list
    if start and _bool_in_prefix(tokens, start, path):
        raise InvalidRequestError(f"request {seq.request_id!r}: prompt tokens must be ints in [0, 2**31)")
    rest = tokens[start:] if start else tokens
    if not rest:
        return
    # every token an exact int (one C-level count; identity hits), else look for a bool
    bad = countOf(map(type, rest), int) != len(rest) and bool in set(map(type, rest))
    if not bad:
        if path is not None and path.base == 0 and start < path.num_tokens:
            unit = path.unit
            sign = 3 if unit == EXTRA_UNIT or NATIVE_LITTLE else 0  # the byte holding a token's sign bit
            tail = tokens[path.num_tokens :]
            bad = not path.content[start * unit + sign :: unit].isascii() or (
                bool(tail) and (min(tail) < 0 or max(tail) > INT32_MAX)
            )
        else:
            bad = min(rest) < 0 or max(rest) > INT32_MAX
    if bad:
        raise InvalidRequestError(f"request {seq.request_id!r}: prompt tokens must be ints in [0, 2**31)")


def _bool_in_prefix(tokens: list, end: int, path: TokenPath | None) -> bool:
    """Is one of `tokens[:end]` a bool? They are the tokens the tree walk matched: equal to
    cached ints, so a bool among them can only sit where a 0 or a 1 is cached. In a plain
    prefix's encoding, the tokens whose low byte is 0 or 1 are found with byte operations (a
    strided slice, one `translate`, `find`; a random token id is one in 128), and only those
    have their types read; a prefix with many of them is searched with numpy instead."""
    if path is None or path.base != 0 or path.unit != PLAIN_UNIT or end > path.num_tokens:
        return bool in set(map(type, tokens[:end]))
    low = path.content[_LOW_BYTE : end * PLAIN_UNIT : PLAIN_UNIT].translate(_ZERO_IF_0_OR_1)  # [end]
    if low.count(0) > _FEW_CANDIDATES:
        small = np.flatnonzero(np.frombuffer(path.content, dtype=np.int32, count=end) <= 1)  # native int32 units
        return any(type(tokens[i]) is bool for i in small.tolist())
    i = low.find(0)
    while i >= 0:
        if type(tokens[i]) is bool:
            return True
        i = low.find(0, i + 1)
    return False


def check_beam_token(seq: TrackedSequence, token: object) -> int:
    """`add_token`'s token for a sequence on the slow path: one int (every beam appends it) or
    one int per beam; returns beam 0's token."""
    if isinstance(token, bool) or (isinstance(token, (list, tuple)) and any(isinstance(t, bool) for t in token)):
        raise InvalidRequestError(f"tokens must be ints, got {token!r}")
    if seq.beam_width == 1 and hasattr(token, "__index__"):
        token = int(token.__index__())
        if not 0 <= token <= INT32_MAX:
            raise InvalidRequestError(f"token must be an int in [0, 2**31), got {token!r}")
        return token
    if hasattr(token, "__index__"):  # one token for every beam
        token = [token] * seq.beam_width
    try:
        tokens = [int(t.__index__()) for t in cast("Iterable[Any]", token)]  # not iterable: TypeError
    except (TypeError, AttributeError):
        raise InvalidRequestError(f"token must be an int or one int per beam, got {token!r}") from None
    if len(tokens) != seq.beam_width:
        raise InvalidRequestError(f"request {seq.request_id!r} has {seq.beam_width} beams, got {len(tokens)} tokens")
    if not all(0 <= t <= INT32_MAX for t in tokens):
        raise InvalidRequestError(f"tokens must be ints in [0, 2**31), got {tokens!r}")
    return tokens[0]


def check_block_id(block_id: object, num_blocks: int, window: int, error: type[Exception]) -> int:
    """A block id of one window manager (an int in [0, num_blocks))."""
    if isinstance(block_id, (bool, np.bool_)) or not isinstance(block_id, (int, np.integer)) or not 0 <= block_id < num_blocks:
        raise error(f"unknown block id {block_id!r} in window {window}")
    return int(block_id)
