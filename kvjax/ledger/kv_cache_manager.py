"""`KVCacheManager`: the public ledger API (TensorRT-LLM's `KVCacheManager`; docs/semantics.md).

Validates every argument before touching state, so a failed call leaves the ledger exactly as
it was; delegates block decisions to `BlockManager`; answers the scheduler's questions; and
exports block tables, KVCacheIndex offsets and the transfer plan for the device side.
"""
from __future__ import annotations

import array
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence as Seq

import numpy as np

from kvjax.config import CacheConfig
from kvjax.errors import (
    ArgumentTypeError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidRequestError,
    OutOfBlocksError,
    SchedulingStateError,
    UnknownBlockError,
    UnknownRequestError,
)
from kvjax.ledger.block import PLACEHOLDER_BLOCK_ID, PRIMARY, SECONDARY, Block
from kvjax.ledger.block_manager import BlockManager
from kvjax.ledger.concurrency import reader, writer
from kvjax.ledger.events import KVCacheEvent
from kvjax.ledger.integrity import ledger_snapshot, verify_ledger
from kvjax.ledger.sequence import Sequence
from kvjax.ledger.stats import IterationStats, KVCacheStats, RequestStats, hit_rate
from kvjax.ledger.transfer_failures import APPLIED, FAILED, TransferFailure, TransferLog, apply_failure
from kvjax.ledger.transfer_plan import TransferPlan
from kvjax.ledger.validation import (
    check_flag,
    check_max_blocks,
    check_op_indices,
    check_table_ids,
    check_timeout,
    check_token_arg,
    check_unpin_ids,
    check_window,
)
from kvjax.request import Request
from kvjax.validation import check_id_list, check_int

_MAX_TOKEN_ID = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class PrefixReuseSummary:
    """Admission's own plan, read-only: "how much of this prompt is cached, and what would
    admitting it take?" (scheduler input; one tree walk per window).

    `reusable_blocks_all`: full blocks of the prompt admission would reuse (largest window);
    `reusable_blocks_allocated`: those already referenced by live sequences (the only ones a
    block budget may subtract: free cached blocks already count as free supply);
    `total_matched_tokens`: tokens admission would prepopulate (partial matches included);
    `first_new_block`: index of the first context block admission must allocate;
    `admission_blocks`: per window (ascending), the free primary blocks that window must have
    for the admission to succeed now (what `needed_blocks_one_step` answers, drafts aside).
    """

    reusable_blocks_all: int
    reusable_blocks_allocated: int
    total_matched_tokens: int
    first_new_block: int
    admission_blocks: tuple[int, ...] = ()


class KVCacheManager:
    """Host ledger of a paged KV cache. docs/semantics.md states the semantics of every call.

    Threads: one writer thread calls everything; other threads may call the reads marked
    "thread-safe" (docs/reliability.md). Failed transfers: see `transfers_failed`.
    """

    def __init__(
        self, config: CacheConfig, *, clock: Callable[[], float] = time.monotonic, require_transfer_acks: bool = False
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise ArgumentTypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        if not callable(clock):
            raise ArgumentTypeError(f"clock must be a callable returning seconds, got {clock!r}")
        require_transfer_acks = check_flag("require_transfer_acks", require_transfer_acks)
        self._lock = threading.RLock()  # see kvjax/ledger/concurrency.py
        self._version = 0  # completed mutations (a scheduling dry run checks it)
        self._sched_version = -1
        self._sched_removed: set = set()
        self._transfers = TransferLog(require_transfer_acks)
        self._kv_valid: dict[Hashable, int] = {}  # request -> valid KV length after a failed transfer
        self.config = config
        self.clock = clock
        self._bm = BlockManager(config, clock)
        self._seqs: dict[Hashable, Sequence] = {}
        self._tpb = config.tokens_per_block
        self._max_seq_len = config.max_seq_len
        self._has_swa = any(wm.is_swa for wm in self._bm.windows)
        self._sched_epoch = 0
        self._sched_free: list[int] | None = None
        self._iter_base = self._counter_totals()

    # ------------------------------------------------------------------ small helpers
    @property
    def tokens_per_block(self) -> int:
        return self._tpb

    @property
    def windows(self) -> tuple[int, ...]:
        return self.config.windows

    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def __contains__(self, request_id: Hashable) -> bool:
        try:
            return request_id in self._seqs
        except TypeError:  # unhashable: never tracked
            return False

    def __len__(self) -> int:
        return len(self._seqs)

    def _seq(self, request_id: Hashable) -> Sequence:
        try:
            return self._seqs[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request id {request_id!r}") from None

    def _window_manager(self, window: int | None):
        check_window(window)
        bm = self._bm
        if window is None:
            if len(bm.windows) != 1:
                raise InvalidArgumentError(f"this cache has several attention windows {self.windows}; pass window=")
            return bm.windows[0]
        try:
            return bm.windows[bm.window_index[window]]
        except (KeyError, TypeError):
            raise InvalidArgumentError(f"unknown attention window {window!r}; windows are {self.windows}") from None

    # ------------------------------------------------------------------ admission
    def _validate(self, request: Request, batch_ids: set | None = None, live_ok: bool = False) -> Sequence:
        if not isinstance(request, Request):
            raise InvalidRequestError(f"expected a kvjax.Request, got {type(request).__name__}")
        request.validate()  # a Request is mutable: its fields are checked again here
        rid = request.request_id
        if not live_ok and (rid in self._seqs or (batch_ids is not None and rid in batch_ids)):
            raise DuplicateRequestError(f"request id {rid!r} is already tracked")
        cfg = self.config
        if request.beam_width > cfg.max_beam_width:
            raise InvalidRequestError(f"beam_width={request.beam_width} exceeds max_beam_width={cfg.max_beam_width}")
        is_cross = self._bm.is_cross
        if is_cross:
            if request.encoder_len is None:
                raise InvalidRequestError("a cross-attention cache needs request.encoder_len")
            length = request.encoder_len
        else:
            length = len(request.prompt)
            if length == 0:
                raise InvalidRequestError(f"request {rid!r} has an empty prompt")
        if length + (0 if is_cross else request.max_new_tokens) > cfg.max_seq_len:
            raise InvalidRequestError(
                f"request {rid!r}: {length} prompt tokens + max_new_tokens={request.max_new_tokens} "
                f"exceed max_seq_len={cfg.max_seq_len}"
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
        return Sequence(request, len(self._bm.windows), is_cross, tokens)

    @staticmethod
    def _check_token_values(seq: Sequence, start: int) -> None:
        """Token ids from `start` on must be ints in [0, 2**31) (bools are not token ids)."""
        rest = seq.tokens[start:] if start else seq.tokens
        if rest and (bool in set(map(type, rest)) or min(rest) < 0 or max(rest) > _MAX_TOKEN_ID):
            raise InvalidRequestError(f"request {seq.request_id!r}: prompt tokens must be ints in [0, 2**31)")

    def add_sequence(self, request: Request) -> int:
        """Admit a request: reuse cached prefix blocks, allocate the rest of its prompt.
        Returns the prepopulated prompt length (tokens whose KV is already cached)."""
        return self.add_sequences([request])[0]

    @writer
    def add_sequences(self, requests: Iterable[Request]) -> list[int]:
        """Admit a batch atomically: all tree matches are found first, then claimed, so two
        requests partially matching one free block do not both reuse it in place."""
        if isinstance(requests, Request):
            raise InvalidRequestError("add_sequences takes a collection of Requests; use add_sequence for one")
        requests = check_id_list("requests", requests, error=InvalidRequestError)
        ids: set = set()
        seqs = []
        for r in requests:
            seqs.append(self._validate(r, ids))
            ids.add(r.request_id)
        bm = self._bm
        admissions = [bm.plan_sequence(s) for s in seqs]
        for adm in admissions:
            self._check_token_values(adm.seq, adm.prepopulated)
        in_place = bm.check_capacity(admissions)  # raises before any change
        bm.commit_admission(admissions, in_place)
        out = []
        for adm in admissions:
            seq = adm.seq
            reused, missed, total, new = adm.deltas
            seq.stats = RequestStats(reused, missed, total, new, hit_rate(reused, missed), adm.prepopulated)
            self._update_slow_at(seq)
            self._seqs[seq.request_id] = seq
            out.append(adm.prepopulated)
        return out

    # ------------------------------------------------------------------ growth
    def add_token(self, request_id: Hashable, token: int | Seq[int]) -> None:
        """Append one generated (or draft) token, allocating a block when it starts one. With
        several beams, `token` is one int per beam, or one int that every beam appends."""
        try:
            seq = self._seqs[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request id {request_id!r}") from None
        n = seq.num_tokens + 1
        if n < seq.slow_at and type(token) is int and 0 <= token <= _MAX_TOKEN_ID:
            seq.tokens.append(token)  # nothing to allocate or detach before `slow_at`
            seq.num_tokens = n
            return
        lock = self._lock  # the fast path above takes no lock (kvjax/ledger/concurrency.py)
        lock.acquire()
        try:
            self._add_token_slow(seq, token, n)
            self._version += 1
        finally:
            lock.release()

    def _add_token_slow(self, seq: Sequence, token, n: int) -> None:
        if type(token) is not int:
            token = check_token_arg(token)
        if seq.is_cross:
            raise InvalidRequestError("a cross-attention cache does not grow token by token")
        if type(token) is not int or seq.beam_width != 1:
            token = self._beam_token(seq, token)
        elif not 0 <= token <= _MAX_TOKEN_ID:
            raise InvalidRequestError(f"token must be an int in [0, 2**31), got {token!r}")
        if n > self._max_seq_len:
            raise InvalidRequestError(f"request {seq.request_id!r} would exceed max_seq_len={self._max_seq_len}")
        if (n - 1) % self._tpb == 0:
            self._bm.grow(seq, (n - 1) // self._tpb)
        seq.tokens.append(token)
        if seq.extra_ids is not None:
            seq.extra_ids.append(0)
        seq.num_tokens = n
        if self._has_swa:
            self._bm.detach_out_of_window(seq)
        self._update_slow_at(seq)

    def _update_slow_at(self, seq: Sequence) -> None:
        """Next token count at which `add_token` must allocate or detach a block."""
        if seq.is_cross or seq.beam_width != 1 or seq.extra_ids is not None:
            seq.slow_at = 0
            return
        tpb = self._tpb
        at = min(len(seq.windows[0].beams[0]) * tpb + 1, self._max_seq_len + 1)
        for wm in self._bm.windows:
            if wm.is_swa:  # the token count at which the next front block may leave the window
                at = min(at, wm.window + seq.num_draft_tokens + (seq.windows[wm.index].num_front_removed + 1) * tpb)
        seq.slow_at = at

    def _beam_token(self, seq: Sequence, token) -> int:
        if isinstance(token, bool) or (isinstance(token, (list, tuple)) and any(isinstance(t, bool) for t in token)):
            raise InvalidRequestError(f"tokens must be ints, got {token!r}")
        if seq.beam_width == 1 and hasattr(token, "__index__"):
            token = int(token.__index__())
            if not 0 <= token <= _MAX_TOKEN_ID:
                raise InvalidRequestError(f"token must be an int in [0, 2**31), got {token!r}")
            return token
        if hasattr(token, "__index__"):  # one token for every beam
            token = [token] * seq.beam_width
        try:
            tokens = [int(t.__index__()) for t in token]
        except (TypeError, AttributeError):
            raise InvalidRequestError(f"token must be an int or one int per beam, got {token!r}") from None
        if len(tokens) != seq.beam_width:
            raise InvalidRequestError(f"request {seq.request_id!r} has {seq.beam_width} beams, got {len(tokens)} tokens")
        if not all(0 <= t <= _MAX_TOKEN_ID for t in tokens):
            raise InvalidRequestError(f"tokens must be ints in [0, 2**31), got {tokens!r}")
        return tokens[0]

    @writer
    def rewind(self, request_id: Hashable, n: int) -> None:
        """Drop the last `n` generated tokens (rejected draft tokens). Blocks left empty are
        released to the front of their queue. The block that keeps the new last token but
        loses later positions is copied first if anyone else holds it (a pin, another
        sequence), so pinned and shared KV never changes; else, if cached, it leaves the tree.

        Sliding windows keep the blocks `num_draft_tokens` rewinds need; a longer rewind whose
        next query would see a released block raises `InvalidRequestError` and changes nothing."""
        n = check_int("rewind count", n, 0, None, error=InvalidRequestError)
        seq = self._seq(request_id)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidRequestError(f"rewind count must be an int >= 0, got {n!r}")
        if seq.beam_width != 1:
            raise InvalidRequestError("rewind needs beam_width 1")
        if n > seq.num_tokens - seq.prompt_len:
            raise InvalidRequestError(
                f"cannot rewind {n} tokens: request {request_id!r} has {seq.num_tokens - seq.prompt_len} generated tokens"
            )
        if n == 0:
            return
        tpb = self._tpb
        new_n = seq.num_tokens - n
        last = (new_n - 1) // tpb
        filled = new_n - last * tpb
        rewrites = filled < tpb  # block `last` loses positions that later tokens will rewrite
        query = seq.context_position if seq.context_position < seq.prompt_len else new_n - 1
        released = self._bm.released_blocks_visible(seq, query)
        if released:
            raise InvalidRequestError(
                f"cannot rewind {n} tokens of request {request_id!r}: the next query (position {query}) would see "
                f"blocks window(s) {released} already released (rewinds up to num_draft_tokens="
                f"{seq.num_draft_tokens} are always kept)"
            )
        cow = []
        for wm in self._bm.windows:
            blk = seq.windows[wm.index].beams[0][last]
            if rewrites and blk.ref_count > 1:
                cow.append(wm)
        for wm in cow:  # blocks the rewind itself frees may receive the copy
            freed = sum(1 for b in seq.windows[wm.index].beams[0][last + 1 :] if b.ref_count == 1)
            if wm.num_free_primary + freed < 1:
                raise OutOfBlocksError(f"window {wm.window}: rewind needs a free block to copy a shared block")
        for wm in self._bm.windows:
            sw = seq.windows[wm.index]
            beam, slots = sw.beams[0], sw.slots[0]
            while len(beam) > last + 1:
                wm.release_block(beam.pop(), to_front=True)
                slots.pop()
            blk = beam[last]
            if wm in cow:
                fresh = wm.copy_prefix(blk, filled, None, None)
                fresh.ref_count += 1
                wm.release_block(blk)
                beam[last] = fresh
                slots[last] = fresh.slot
            elif blk.node is not None and blk.node.key.num_tokens > filled:
                wm.drop_cached(blk, evicted=False)
            if sw.store_depth > last:
                sw.store_node, sw.store_depth = None, 0
        del seq.tokens[new_n:]
        if seq.extra_ids is not None:
            del seq.extra_ids[new_n:]
        seq.num_tokens = new_n
        seq.context_position = min(seq.context_position, new_n)
        self._update_slow_at(seq)

    @writer
    def set_context_position(self, request_id: Hashable, position: int) -> None:
        """Chunked prefill: the first `position` tokens have their KV materialised (also how an
        engine reports progress recomputing after `transfers_failed`)."""
        position = check_int("context position", position, 0, None, error=InvalidRequestError)
        seq = self._seq(request_id)
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= seq.num_tokens:
            raise InvalidRequestError(f"context position must be an int in [0, {seq.num_tokens}], got {position!r}")
        released = self._bm.released_blocks_visible(seq, position) if position < seq.prompt_len else None
        if released:
            raise InvalidRequestError(
                f"request {request_id!r}: a chunk starting at {position} would see blocks window(s) {released} already released"
            )
        seq.context_position = position
        if request_id in self._kv_valid:  # recomputing after a failed transfer
            if position >= seq.num_tokens - 1:
                del self._kv_valid[request_id]
            else:
                self._kv_valid[request_id] = position

    # ------------------------------------------------------------------ storing for reuse
    def _can_store(self, seq: Sequence) -> bool:
        return self._bm.reuse and not seq.is_cross

    def _materialised(self, seq: Sequence) -> int:
        """Tokens whose KV exists: the context position during a chunked prefill, else all but
        the newest token (whose KV the next forward writes); after a failed transfer, no more
        than what is still valid."""
        if seq.context_position < seq.prompt_len:
            return seq.context_position
        if self._kv_valid:
            valid = self._kv_valid.get(seq.request_id)
            if valid is not None:
                return min(valid, seq.num_tokens - 1)
        return seq.num_tokens - 1

    @writer
    def store_context_blocks(self, request_id: Hashable) -> None:
        """Make the materialised full context blocks reusable now ("early reuse")."""
        seq = self._seq(request_id)
        if self._can_store(seq):
            self._bm.store(seq, min(self._materialised(seq), seq.prompt_len), allow_partial=False)

    def store_new_block(self, request_id: Hashable) -> None:
        """During generation: make newly completed full blocks reusable (beam width 1 only)."""
        seq = self._seq(request_id)
        if self._can_store(seq) and seq.beam_width == 1 and self._completed_unstored(seq):
            self._store_new(seq)

    def _completed_unstored(self, seq: Sequence) -> bool:
        """Has a full block completed since the last store? Most calls (one per decode token)
        answer no and change nothing, so they skip the lock."""
        n_full = self._materialised(seq) // self._tpb
        for sw in seq.windows:
            node = sw.store_node
            if n_full > (sw.store_depth if node is not None and node.attached else 0):
                return True
        return False

    @writer
    def _store_new(self, seq: Sequence) -> None:
        self._bm.store(seq, self._materialised(seq), allow_partial=False)

    @writer
    def store_blocks_for_reuse(self, request_id: Hashable, pin: bool = False) -> list[int] | dict[int, list[int]]:
        """Store every block, the trailing partial one included, without releasing them; with
        `pin`, also take an extra reference on the sequence's blocks (undo with
        `unpin_blocks`). Returns the sequence's block ids (a dict window -> ids with several
        windows)."""
        pin = check_flag("pin", pin)
        seq = self._seq(request_id)
        if self._can_store(seq) and seq.beam_width == 1:
            self._bm.store(seq, self._materialised(seq), allow_partial=True)
        if pin:
            self._pin(seq)
        return self._own_block_ids(seq)

    def _own_block_ids(self, seq: Sequence) -> list[int] | dict[int, list[int]]:
        ids = {wm.window: [b.block_id for b in seq.windows[wm.index].unique_blocks()] for wm in self._bm.windows}
        return next(iter(ids.values())) if len(ids) == 1 else ids

    def _pin(self, seq: Sequence) -> None:
        for wm in self._bm.windows:
            for blk in seq.windows[wm.index].unique_blocks():
                blk.ref_count += 1
                blk.pin_count += 1

    @writer
    def pin_blocks(self, request_id: Hashable) -> None:
        """Keep the sequence's blocks alive past `remove_sequence` (e.g. a KV transfer)."""
        self._pin(self._seq(request_id))

    @writer
    def unpin_blocks(self, block_ids: Seq[int] | dict[int, Seq[int]]) -> None:
        """Drop one pin per listed id (a list for one window, or a dict window -> ids)."""
        check_unpin_ids(block_ids)
        if isinstance(block_ids, dict):
            items = [(self._window_manager(w), list(ids)) for w, ids in block_ids.items()]
        else:
            items = [(self._window_manager(None), list(block_ids))]
        for wm, ids in items:
            counts: dict[int, int] = {}
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < len(wm.blocks):
                    raise InvalidArgumentError(f"unknown block id {i!r} in window {wm.window}")
                counts[int(i)] = counts.get(int(i), 0) + 1
            for i, k in counts.items():
                if wm.blocks[i].pin_count < k:
                    raise InvalidArgumentError(f"block {i} of window {wm.window} is not pinned {k} time(s)")
        for wm, ids in items:
            for i in ids:
                blk = wm.blocks[int(i)]
                blk.pin_count -= 1
                wm.release_block(blk)

    @writer
    def remove_sequence(self, request_id: Hashable, *, store_for_reuse: bool = True, pin: bool = False) -> None:
        """Finish a request: store all its blocks for reuse (the trailing partial one too; the
        newest token has no KV yet), optionally pin them, then release last block first."""
        store_for_reuse, pin = check_flag("store_for_reuse", store_for_reuse), check_flag("pin", pin)
        seq = self._seq(request_id)
        if store_for_reuse and self._can_store(seq) and seq.beam_width == 1:
            self._bm.store(seq, self._materialised(seq), allow_partial=True)
        if pin:
            self._pin(seq)
        self._bm.release(seq)
        del self._seqs[request_id]
        self._kv_valid.pop(request_id, None)

    # ------------------------------------------------------------------ tables for kernels
    @reader
    def block_ids(self, request_id: Hashable, window: int | None = None) -> list[list[int]]:
        """Block ids per beam (placeholders as `PLACEHOLDER_BLOCK_ID`)."""
        wm = self._window_manager(window)
        sw = self._seq(request_id).windows[wm.index]
        return [[b.block_id for b in beam] for beam in sw.beams]

    def _rows(self, request_ids: Iterable[Hashable], index: int) -> list[array.array]:
        rows = []
        for rid in request_ids:
            rows.extend(self._seq(rid).windows[index].slots)
        return rows

    @reader
    def block_table(self, request_ids: Iterable[Hashable], window: int | None = None, *, max_blocks: int | None = None) -> np.ndarray:
        """int32 `[rows, max_blocks]` primary slots, one row per (request, beam); padding and
        placeholders point to the null slot (slot `primary_blocks`), which no block owns.
        Thread-safe."""
        request_ids, max_blocks = check_table_ids(request_ids), check_max_blocks(self.config, max_blocks)
        wm = self._window_manager(window)
        return self._table(self._rows(request_ids, wm.index), wm.null_slot, max_blocks)

    @staticmethod
    def _table(rows: list[array.array], null_slot: int, max_blocks: int | None) -> np.ndarray:
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        longest = int(lengths.max()) if len(rows) else 0
        width = longest if max_blocks is None else max_blocks
        if width < longest:
            raise InvalidArgumentError(f"max_blocks={max_blocks} is smaller than the longest block list ({longest})")
        out = np.full((len(rows), width), null_slot, dtype=np.int32)
        if longest:
            # one copy of all rows' slots, scattered under a ragged mask (no per-row numpy calls)
            flat = np.frombuffer(b"".join(rows), dtype=np.int32)
            out[np.arange(width) < lengths[:, None]] = flat
        return out

    @reader
    def block_offsets(self, request_ids: Iterable[Hashable], *, max_blocks: int | None = None) -> np.ndarray:
        """TensorRT-LLM `KVCacheIndex` offsets `[num_pools, rows, 2, max_blocks]` (int32). Thread-safe."""
        from kvjax.offsets import kvcache_index_offsets

        request_ids, max_blocks = check_table_ids(request_ids), check_max_blocks(self.config, max_blocks)
        bm = self._bm
        if max_blocks is None:
            max_blocks = max((len(r) for wm in bm.windows for r in self._rows(request_ids, wm.index)), default=0)
        tables = {wm.window: self._table(self._rows(request_ids, wm.index), wm.null_slot, max_blocks) for wm in bm.windows}
        return kvcache_index_offsets(self.config, tables)

    # ------------------------------------------------------------------ counts and stats
    @reader
    def num_free_blocks(self, window: int | None = None) -> int:
        """Free primary blocks (cached-but-unreferenced ones count as free); with several
        windows and no `window`, the minimum over windows."""
        if window is None and len(self._bm.windows) > 1:
            return min(wm.num_free_primary for wm in self._bm.windows)
        return self._window_manager(window).num_free_primary

    @reader
    def num_allocated_blocks(self, window: int | None = None) -> int:
        """Referenced primary blocks; with several windows and no `window`, the maximum."""
        if window is None and len(self._bm.windows) > 1:
            return max(wm.num_primary - wm.num_free_primary for wm in self._bm.windows)
        wm = self._window_manager(window)
        return wm.num_primary - wm.num_free_primary

    @reader
    def num_free_secondary_blocks(self, window: int | None = None) -> int:
        if window is None and len(self._bm.windows) > 1:
            return min(wm.num_free_secondary for wm in self._bm.windows)
        return self._window_manager(window).num_free_secondary

    def _counter_totals(self) -> list[int]:
        totals = None
        for wm in self._bm.windows:
            t = wm.counters.as_tuple()
            totals = list(t) if totals is None else [a + b for a, b in zip(totals, t)]
        return totals

    @reader
    def stats(self) -> KVCacheStats:
        ws = self._bm.windows
        c = dict(zip(ws[0].counters.__slots__, self._counter_totals()))
        reused = c["reused_full"] + c["reused_partial"]
        max_blocks = sum(wm.num_primary for wm in ws)
        free = sum(wm.num_free_primary for wm in ws)
        return KVCacheStats(
            max_num_blocks=max_blocks,
            free_num_blocks=free,
            used_num_blocks=max_blocks - free,
            tokens_per_block=self._tpb,
            alloc_total_blocks=c["alloc_total"],
            alloc_new_blocks=c["alloc_new"],
            reused_blocks=reused,
            missed_blocks=c["missed"],
            cache_hit_rate=hit_rate(reused, c["missed"]),
            num_free_blocks_per_window={wm.window: wm.num_free_primary for wm in ws},
            max_secondary_blocks=sum(wm.num_secondary for wm in ws),
            free_secondary_blocks=sum(wm.num_free_secondary for wm in ws),
            offloaded_blocks=c["offloaded"],
            onboarded_blocks=c["onboarded"],
            copied_blocks=c["copied"],
            evicted_blocks=c["evicted"],
            allocated_bytes=sum(wm.block_bytes * (wm.num_primary - wm.num_free_primary) for wm in ws),
        )

    @reader
    def request_stats(self, request_id: Hashable) -> RequestStats:
        """What admission did for a live request."""
        return self._seq(request_id).stats

    @reader
    def iteration_stats(self) -> IterationStats:
        """Counters since the previous call, plus current occupancy."""
        ws = self._bm.windows
        now = self._counter_totals()
        d = dict(zip(ws[0].counters.__slots__, (a - b for a, b in zip(now, self._iter_base))))
        self._iter_base = now
        reused = d["reused_full"] + d["reused_partial"]
        p_free = sum(wm.num_free_primary for wm in ws)
        s_free = sum(wm.num_free_secondary for wm in ws)
        return IterationStats(
            alloc_total_blocks=d["alloc_total"],
            alloc_new_blocks=d["alloc_new"],
            reused_blocks=reused,
            full_reused_blocks=d["reused_full"],
            partial_reused_blocks=d["reused_partial"],
            missed_blocks=d["missed"],
            cache_hit_rate=hit_rate(reused, d["missed"]),
            gen_alloc_blocks=d["gen_alloc"],
            offloaded_blocks=d["offloaded"],
            onboarded_blocks=d["onboarded"],
            copied_blocks=d["copied"],
            offload_bytes=d["offload_bytes"],
            onboard_bytes=d["onboard_bytes"],
            copy_bytes=d["copy_bytes"],
            evicted_blocks=d["evicted"],
            primary_used_blocks=sum(wm.num_primary for wm in ws) - p_free,
            primary_free_blocks=p_free,
            secondary_used_blocks=sum(wm.num_secondary for wm in ws) - s_free,
            secondary_free_blocks=s_free,
        )

    @reader
    def priority_of_block(self, block_id: int, window: int | None = None) -> int:
        wm = self._window_manager(window)
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)) or not 0 <= block_id < len(wm.blocks):
            raise UnknownBlockError(f"unknown block id {block_id!r} in window {wm.window}")
        return wm.blocks[int(block_id)].priority

    @reader
    def block(self, block_id: int, window: int | None = None) -> Block:
        """The metadata handle of a block (read-only use: inspection and tests)."""
        wm = self._window_manager(window)
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)) or not 0 <= block_id < len(wm.blocks):
            raise UnknownBlockError(f"unknown block id {block_id!r} in window {wm.window}")
        return wm.blocks[int(block_id)]

    # ------------------------------------------------------------------ scheduler queries
    @reader
    def analyze_prefix_reuse(self, request: Request) -> PrefixReuseSummary:
        """Run admission's planning (tree walks, safe prefix, in-place or copy) without
        committing anything, and summarise it."""
        bm = self._bm
        adm = bm.plan_sequence(self._query_sequence(request))
        blocks = tuple(bm.window_need(wm, [adm]).required for wm in bm.windows)
        wa = adm.windows[-1]
        full = [b for b in wa.matched if b is not None]
        allocated = sum(1 for b in full if b.ref_count > 0)
        return PrefixReuseSummary(len(full), allocated, adm.prepopulated, len(wa.matched), blocks)

    @staticmethod
    def _check_query_args(two_steps_lookahead: object, summary: object) -> bool:
        if summary is not None and not isinstance(summary, PrefixReuseSummary):
            raise InvalidArgumentError(f"summary must be a PrefixReuseSummary or None, got {summary!r}")
        return check_flag("two_steps_lookahead", two_steps_lookahead)

    def _query_sequence(self, request: Request) -> Sequence:
        """A Request passed to a query is checked as admission would check it (its id may be
        live); returns the sequence admission would build."""
        if not isinstance(request, Request):
            raise InvalidRequestError(f"expected a kvjax.Request, got {type(request).__name__}")
        seq = self._validate(request, None, live_ok=True)
        self._check_token_values(seq, 0)
        return seq

    def _resolve(self, request_or_id) -> tuple[Request, Sequence | None]:
        if isinstance(request_or_id, Request):
            live = self._seqs.get(request_or_id.request_id) if request_or_id in self else None
            if live is None:
                self._query_sequence(request_or_id)
            return request_or_id, live
        seq = self._seq(request_or_id)
        return seq.request, seq

    @reader
    def needed_blocks_one_step(
        self,
        request_or_id,
        two_steps_lookahead: bool = False,
        window: int | None = None,
        *,
        summary: PrefixReuseSummary | None = None,
    ) -> int:
        """Blocks the next step needs in `window`.

        For a request not yet admitted: the free primary blocks admission needs now (from
        admission's own plan: matches, the safe sliding-window prefix, onboards, partial
        copies, fresh blocks), plus the blocks its first step's draft tokens start. Whenever
        every window's answer is at most its `num_free_blocks`, `add_sequence` succeeds, and
        a batch whose summed answers fit is admitted by `add_sequences`. Without drafts the
        answer is exact: admission takes that many blocks, or one fewer when the plan copies a
        free block and allocates nothing else, as the copy source cannot be its own target.
        Pass the `summary` of `analyze_prefix_reuse` to skip the tree walks.

        For an admitted request: the blocks the next one (or two) steps of generation, draft
        tokens included, start (out-of-window releases not credited).
        """
        two_steps_lookahead = self._check_query_args(two_steps_lookahead, summary)
        wm = self._window_manager(window)
        request, seq = self._resolve(request_or_id)
        tpb = self._tpb
        beam = request.beam_width
        if seq is None:  # context phase
            if summary is None or len(summary.admission_blocks) != len(self._bm.windows):
                summary = self.analyze_prefix_reuse(request)
            needed = summary.admission_blocks[wm.index]
            if request.num_draft_tokens and not self._bm.is_cross:  # added by the first step
                prompt_len = len(request.prompt)
                with_drafts = min(prompt_len + request.num_draft_tokens, self._max_seq_len)
                needed += (-(-with_drafts // tpb) - -(-prompt_len // tpb)) * beam
            return needed
        if seq.is_cross or seq.context_position < seq.prompt_len:
            return 0
        curr = seq.num_tokens
        steps = 2 if two_steps_lookahead else 1
        max_add = min(steps * (seq.num_draft_tokens + 1), seq.max_new_tokens - (curr - seq.prompt_len))
        nxt = curr + max(max_add, 0)
        if nxt > wm.max_token_num:
            return 0
        return (-(-nxt // tpb) - -(-curr // tpb)) * beam

    @reader
    def remaining_blocks_to_completion(
        self, request_or_id, window: int | None = None, *, summary: PrefixReuseSummary | None = None
    ) -> int:
        """Blocks still to allocate for the request to finish (TensorRT-LLM's formula for full
        attention). A sliding window holds at most its prompt at admission, then at most
        `ceil((window + num_draft_tokens) / tokens_per_block) + 1` blocks (growth is paid for by
        out-of-window releases), so its remaining need is the peak of those minus what is held now."""
        self._check_query_args(False, summary)
        wm = self._window_manager(window)
        request, seq = self._resolve(request_or_id)
        cfg, tpb = self.config, self._tpb
        bubble = cfg.sink_bubble_length
        beam = request.beam_width
        if self._bm.is_cross:
            return -(-request.encoder_len // tpb) if seq is None else 0
        prompt_len = len(request.prompt)
        final = prompt_len + request.max_new_tokens
        alloc = 0 if seq is None else len(seq.windows[wm.index].beams[0])
        reuse_ok = self._bm.reuse and not cfg.is_variable_window and alloc == 0
        if wm.is_swa:
            held = 0 if seq is None else alloc - seq.windows[wm.index].num_front_removed
            ctx = -(-(prompt_len + bubble) // tpb)
            if reuse_ok:
                summary = summary or self.analyze_prefix_reuse(request)
                ctx -= min(summary.reusable_blocks_allocated, (prompt_len - 1) // tpb)
            # held blocks peak at ceil((window + drafts) / tpb) + 1: the blocks the oldest draft
            # query sees, and a new block is allocated before the token's detach releases one
            span = wm.window + request.num_draft_tokens
            steady = min(-(-(final + bubble) // tpb), -(-span // tpb) + 1) * beam
            # until the first token is added nothing has left the window: if that token starts
            # a block, the whole context plus one block is held for a moment
            cur = prompt_len if seq is None else seq.num_tokens
            first = (ctx if seq is None else held) + beam * int(cur < final and (cur + bubble) % tpb == 0)
            peak = max(first, steady)
            return max(0, peak - held)
        span = wm.window + wm.temporary_window
        ctx = (min(prompt_len, span) + bubble) // tpb
        total = -(-(min(final, span) + bubble) // tpb)
        gen = total - ctx
        reusable = 0
        if reuse_ok:
            summary = summary or self.analyze_prefix_reuse(request)
            reusable = min(summary.reusable_blocks_allocated, ctx, (prompt_len - 1) // tpb)
        cur_tokens = prompt_len if seq is None else seq.num_tokens
        extra = int(final > wm.window and -(-final // tpb) > -(-cur_tokens // tpb) and -(-final // tpb) > total)
        if alloc < ctx - reusable:
            return (ctx - reusable - alloc) + (gen + extra) * beam
        return max(0, (total - reusable - alloc + extra) * beam)

    @reader
    def start_scheduling(self) -> None:
        """Begin a scheduling dry run: shadow ref counts start equal to the real ones. The dry
        run lasts until the ledger next changes (then its calls raise `SchedulingStateError`)."""
        self._sched_epoch += 1
        self._sched_free = [wm.num_free_primary for wm in self._bm.windows]
        self._sched_version = self._version
        self._sched_removed = set()

    def _check_dry_run(self) -> None:
        if self._sched_free is None:
            raise SchedulingStateError("call start_scheduling() first")
        if self._sched_version != self._version:
            raise SchedulingStateError("the ledger changed since start_scheduling(); start a new dry run")

    @reader
    def scheduling_remove_sequence(self, request_id: Hashable) -> None:
        """Dry run: count the blocks that would become free if the request were removed."""
        self._check_dry_run()
        seq = self._seq(request_id)
        if request_id in self._sched_removed:
            raise DuplicateRequestError(f"request {request_id!r} was already removed in this dry run")
        self._sched_removed.add(request_id)
        epoch = self._sched_epoch
        for wm in self._bm.windows:
            for blk in seq.windows[wm.index].unique_blocks():
                if blk.sched_epoch != epoch:
                    blk.sched_epoch = epoch
                    blk.sched_ref_count = blk.ref_count
                blk.sched_ref_count -= 1
                if blk.sched_ref_count == 0:
                    self._sched_free[wm.index] += 1

    @reader
    def scheduling_has_free_blocks(self, n: int, window: int | None = None) -> bool:
        self._check_dry_run()
        n = check_int("n", n, 0, None)
        if window is None:
            return all(f >= n for f in self._sched_free)
        return self._sched_free[self._window_manager(window).index] >= n

    # ------------------------------------------------------------------ housekeeping
    @writer
    def refresh_blocks(self) -> int:
        """Expire retention durations (once per iteration). Returns blocks moved to priority 35."""
        return sum(wm.policy.refresh() for wm in self._bm.windows)

    def get_latest_events(self, timeout: float | None = None) -> list[KVCacheEvent]:
        """Published events, oldest first (waits up to `timeout` s for some). Thread-safe: the
        event queue has its own lock, so a router may block here without stalling the writer."""
        timeout = check_timeout(timeout)
        ev = self._bm.events
        return [] if ev is None else ev.get_latest(timeout)

    @writer
    def flush_iteration_events(self) -> None:
        if self._bm.events is not None:
            self._bm.events.flush()

    @writer
    def reset_prefix_cache(self) -> int:
        """Drop every cached block no live request references (Removed events; the blocks stay
        free, first in line for allocation). Blocks of live requests stay cached. Returns the
        number of blocks dropped. See `kvjax.ledger.reset`."""
        from kvjax.ledger.reset import reset_prefix_cache

        return reset_prefix_cache(self._bm)

    @writer
    def take_transfers(self) -> TransferPlan:
        """The ordered data movements decided since the last call (apply before the forward).
        The plan carries the next sequence number; taking it acknowledges the previous plan
        (see `transfers_failed`)."""
        log = self._transfers
        log.check_take()
        recorder = self._bm.recorder
        return recorder.take(log.issue(len(recorder)))

    def _open_plan(self, plan_or_seq: TransferPlan | int) -> int:
        seq = plan_or_seq.seq if isinstance(plan_or_seq, TransferPlan) else check_int("plan sequence number", plan_or_seq, 0, None)
        self._transfers.check_report(seq)
        return seq

    @writer
    def transfers_applied(self, plan_or_seq: TransferPlan | int) -> None:
        """Acknowledge that the newest plan took effect in full (optional unless the manager
        was built with `require_transfer_acks=True`). A second report, or a report about any
        plan but the newest, raises `TransferSequenceError`: a plan applied twice or out of
        order is caught here."""
        self._open_plan(plan_or_seq)
        self._transfers.status = APPLIED

    @writer
    def transfers_failed(self, plan_or_seq: TransferPlan | int, op_indices: Seq[int] | None = None) -> TransferFailure:
        """Report that the newest plan (all of it, or the ops at `op_indices`) did not take
        effect, before any forward reads its destinations. Blocks whose content did not
        arrive leave the tree; live requests that relied on them are cut back and must be
        recomputed from `TransferFailure.recompute_from[request_id]` tokens (report progress
        with `set_context_position`; sliding-window requests in `readmit` must be removed and
        admitted again). See kvjax/ledger/transfer_failures.py."""
        seq = self._open_plan(plan_or_seq)
        taken = self._bm.recorder.taken
        failed = check_op_indices(op_indices, len(taken[0]))
        result = apply_failure(self, seq, list(zip(*taken)), failed)
        self._transfers.status = FAILED
        return result

    @reader
    def verify_integrity(self) -> None:
        """Raise `IntegrityError` if any ledger invariant is broken."""
        verify_ledger(self._bm, self._seqs)

    @reader
    def snapshot(self) -> tuple:
        """A hashable picture of the whole ledger state (tests compare it around failed calls).
        Thread-safe: `add_token`'s unlocked fast path is switched off (every sequence's next
        token takes the locked path) and an append already under way is waited out."""
        seqs = self._seqs
        for seq in seqs.values():
            seq.slow_at = 0  # `_update_slow_at` restores it on the sequence's next token
        for _ in range(10_000):  # at most one append can be in flight (one writer)
            if all(len(s.tokens) == s.num_tokens for s in seqs.values() if not s.is_cross):
                break
            time.sleep(0)
        state = (self._transfers.state(), tuple(sorted(self._kv_valid.items(), key=repr)))
        return ledger_snapshot(self._bm, seqs) + state
