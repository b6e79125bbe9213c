"""`KVCacheManager`: the public ledger API (TensorRT-LLM's `KVCacheManager`; docs/semantics.md).

A facade: every method checks its arguments (`kvjax.ledger.validation`) before anything
changes, so a failed call leaves the ledger exactly as it was, takes the lock its thread
contract asks for (`kvjax.ledger.concurrency`), and hands the work to the module that owns
it, with the owners it needs (the `BlockManager`; `LiveSequences`, the state of every live
request): admission (`admission`), growth (`growth`, `block_manager`), the batched decode
step (`decode_batch`), storing for reuse and pins (`storing`), release (`block_manager`),
rewinds (`rewind`), scheduler queries (`scheduler_queries`), statistics (`stats`), block
tables (`block_tables`, `live_sequences`), failed transfers (`transfer_failures`) and
inspection (`inspection`). Nothing below imports this module or reads its attributes.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

from kvjax.config import CacheConfig
from kvjax.errors import ArgumentTypeError, InvalidRequestError, KVCacheError, UnknownRequestError
from kvjax.ledger import (
    admission,
    decode_batch,
    pending_tokens,
    recurrent,
    restores,
    rewind,
    scheduler_queries,
    storing,
    tier3,
)
from kvjax.ledger.block_manager import BlockManager
from kvjax.ledger.concurrency import reader, writer
from kvjax.ledger.events import KVCacheEvent
from kvjax.ledger.growth import add_token_slow
from kvjax.ledger.inspection import (
    BlockInfo,
    LedgerInspector,
    allocated_primary,
    block_info,
    free_primary,
    free_secondary,
    known_block,
)
from kvjax.ledger.integrity import ledger_snapshot, verify_ledger
from kvjax.ledger.live_sequences import LiveSequences
from kvjax.ledger.recurrent import RecurrentStep
from kvjax.ledger.reset import reset_prefix_cache
from kvjax.ledger.scheduler_queries import DryRun, PrefixReuseSummary, check_dry_run
from kvjax.ledger.sequence import TrackedSequence
from kvjax.ledger.stats import IterationStats, KVCacheStats, RequestStats, cache_stats, counter_totals, hit_rate, iteration_stats
from kvjax.ledger.transfer_failures import APPLIED, FAILED, TransferFailure, TransferLog, apply_failure
from kvjax.ledger.validation import (
    check_flag,
    check_max_blocks,
    check_op_indices,
    check_table_ids,
    check_timeout,
    window_manager,
)
from kvjax.request import Request
from kvjax.transfer_plan import TransferPlan
from kvjax.validation import INT32_MAX, check_id_list, check_int

__all__ = ["KVCacheManager", "PrefixReuseSummary", "RecurrentStep"]


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
        self._dry_run: DryRun | None = None
        self._transfers = TransferLog(require_transfer_acks)
        self.config = config
        self.clock = clock
        self._bm = BlockManager(config, clock)
        # every live sequence and where its tokens and table rows are (`LiveSequences`);
        # its dicts under their own names too, for the unlocked `add_token` path
        self._live = LiveSequences(self._bm)
        self._seqs = self._live.seqs
        self._listed = self._live.listed
        self._tok = self._live.tok
        self._iter_base = counter_totals(self._bm.windows)

    # ------------------------------------------------------------------ small helpers
    @property
    def tokens_per_block(self) -> int:
        return self._bm.tokens_per_block

    @property
    def windows(self) -> tuple[int, ...]:
        return self.config.windows

    @property
    def inspector(self) -> LedgerInspector:
        """Read-only views of internals (eviction order, cached paths, hashes, sizes): see
        `kvjax.ledger.inspection`."""
        return LedgerInspector(self._bm, self._lock)

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

    def _seq(self, request_id: Hashable) -> TrackedSequence:
        return self._live.get(request_id)

    # ------------------------------------------------------------------ admission
    @writer
    def add_sequence(self, request: Request) -> int:
        """Admit a request: reuse cached prefix blocks, allocate the rest of its prompt.
        Returns the prepopulated prompt length (tokens whose KV is already cached)."""
        return self._admit((request,))[0]

    @writer
    def add_sequences(self, requests: Iterable[Request]) -> list[int]:
        """Admit a batch atomically: all tree matches are found first, then claimed, so two
        requests partially matching one free block do not both reuse it in place."""
        if isinstance(requests, Request):
            raise InvalidRequestError("add_sequences takes a collection of Requests; use add_sequence for one")
        return self._admit(check_id_list("requests", requests, error=InvalidRequestError))

    def _admit(self, requests: Sequence[Request]) -> list[int]:
        return admission.admit(self._bm, self._live, requests)

    # ------------------------------------------------------------------ growth
    def add_token(self, request_id: Hashable, token: int | Sequence[int]) -> None:
        """Append one generated (or draft) token, allocating a block when it starts one. With
        several beams, `token` is one int per beam, or one int that every beam appends."""
        try:
            seq = self._seqs[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request id {request_id!r}") from None
        tokens = seq.tokens
        # below its limit (a cross cache's is 0: it never takes this path), the token is only
        # appended: nothing to allocate or detach
        if tokens is not None and len(tokens) < seq.limit and type(token) is int and 0 <= token <= INT32_MAX:
            tokens.append(token)
            return
        lock = self._lock  # the fast path above takes no lock (kvjax/ledger/concurrency.py)
        lock.acquire()
        try:
            pending_tokens.refuse_growth(self._live, request_id)
            if tokens is None:  # a batched step moved them into the store: a list again
                self._live.to_list(seq)
            add_token_slow(self._bm, self._live, seq, token, seq.num_tokens + 1)
            self._version += 1
        finally:
            lock.release()

    def add_tokens(self, request_ids: Sequence[Hashable], tokens: Sequence[int | Sequence[int]] | np.ndarray) -> None:
        """`add_token(request_ids[i], tokens[i])` for each i, in order, as one atomic call:
        every check (free blocks included) runs first, so a failure raises what the first
        failing `add_token` would and changes nothing. Ids must be distinct. `tokens`: a 1-D
        integer array, or a list (an entry may be one int per beam). Built for the decode step
        of a large batch (kvjax/ledger/decode_batch.py)."""
        lock = self._lock
        lock.acquire()
        try:
            if decode_batch.add_tokens(self._bm, self._live, request_ids, tokens):  # leaves its batch cached, current
                self._version += 1
        finally:
            lock.release()

    def add_pending_tokens(self, request_ids: Sequence[Hashable]) -> None:
        """`add_tokens` of tokens whose ids are not known yet (an overlapped engine's step n+1
        reserves the positions of the tokens step n is still sampling on the device): each
        request grows by one position, its block allocated as `add_tokens` would, holding
        `PENDING_TOKEN` until `set_pending_tokens`. Until then the request takes no other token
        and no stored block covers the position (kvjax/ledger/pending_tokens.py). Atomic, with
        `add_tokens`' checks and errors; one-beam self-attention requests without extra ids
        only, and none whose newest token is already pending (`InvalidRequestError`)."""
        lock = self._lock
        lock.acquire()
        try:
            pending_tokens.add_pending(self._bm, self._live, request_ids)
            self._version += 1
        finally:
            lock.release()

    @writer
    def set_pending_tokens(self, request_ids: Sequence[Hashable], tokens: Sequence[int] | np.ndarray) -> None:
        """Write the ids of the requests' pending tokens (`add_pending_tokens`); every id must
        be live and pending, every token an int in [0, 2**31): else `InvalidRequestError`
        (unknown ids `UnknownRequestError`) and nothing changes."""
        pending_tokens.fill(self._live, request_ids, tokens)

    @reader
    def pending_tokens(self) -> dict[Hashable, int]:
        """Requests whose newest token is pending, with its position."""
        return dict(self._live.pending)

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
        rewind.check_rewind(self._bm, seq, n)
        if n:
            rewind.rewind(self._bm, seq, n)
            self._live.truncated(seq)
            self._live.set_limit(seq)

    @writer
    def set_context_position(self, request_id: Hashable, position: int) -> None:
        """Chunked prefill: the first `position` tokens have their KV materialised (also how an
        engine reports progress recomputing after `transfers_failed`)."""
        position = check_int("context position", position, 0, None, error=InvalidRequestError)
        self._live.set_context_position(self._seq(request_id), position)

    # ------------------------------------------------------------------ recurrent states (hybrid models)
    @writer
    def begin_recurrent_step(self, request_ids: Sequence[Hashable], ends: Sequence[int] | None = None) -> RecurrentStep:
        """Begin the next forward's step of each request in the recurrent-state window: its
        read and write slots (copy-forward), per row (`kvjax.ledger.recurrent`). `ends[i]`:
        the token count the step's state will cover (default: `recurrent_next_chunk_end`).
        Call once per forward, before it; every check runs first."""
        return recurrent.begin_steps(self._bm, self._live, request_ids, ends)

    @reader
    def recurrent_next_chunk_end(self, request_id: Hashable) -> int:
        """Where the request's next step should end: its prompt's next snapshot point (or the
        prompt's end) during the prompt, so that its states can be reused; else its newest token."""
        return recurrent.next_chunk_end(self._bm, self._seq(request_id))

    @reader
    def recurrent_state_position(self, request_id: Hashable) -> int:
        """The token count of the state the request's next step reads (where that step starts)."""
        return recurrent.state_position(self._bm, self._seq(request_id))

    # ------------------------------------------------------------------ storing for reuse
    @writer
    def store_context_blocks(self, request_id: Hashable) -> None:
        """Make the materialised full context blocks reusable now ("early reuse")."""
        storing.store_context(self._bm, self._live, self._seq(request_id))

    def store_new_block(self, request_id: Hashable) -> None:
        """During generation: make newly completed full blocks reusable (beam width 1 only).
        Most calls (one per decode token) find nothing new and take no lock."""
        try:
            seq = self._seqs[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request id {request_id!r}") from None
        bm = self._bm
        if seq.beam_width == 1 and bm.reuse and bm.has_unstored_block(seq, self._live.materialised(seq)):
            self._store_new(seq)

    @writer
    def _store_new(self, seq: TrackedSequence) -> None:
        self._bm.store(seq, self._live.materialised(seq), allow_partial=False)

    @writer
    def store_new_blocks(self, request_ids: Sequence[Hashable]) -> None:
        """`store_new_block` of each request, in order, in one call (an engine's decode step,
        where most requests completed no block since the last store). Every id is looked up
        first: an unknown one raises `UnknownRequestError` and nothing is stored. Repeating an
        id is harmless (its second store finds nothing). Called with the id list of the step's
        `add_tokens` (admissions in between keep it), the requests with nothing new are found
        by one comparison of two columns, without reading their objects
        (`decode_batch.store_candidates`); otherwise each costs one comparison."""
        storing.store_new_blocks(self._bm, self._live, check_id_list("request_ids", request_ids))

    @writer
    def store_blocks_for_reuse(self, request_id: Hashable, pin: bool = False) -> list[int] | dict[int, list[int]]:
        """Store every block, the trailing partial one included, without releasing them; with
        `pin`, also take an extra reference on the sequence's blocks (undo with
        `unpin_blocks`). Returns the sequence's block ids (a dict window -> ids with several
        windows)."""
        pin = check_flag("pin", pin)
        seq = self._seq(request_id)
        storing.store_all(self._bm, self._live, seq)
        if pin:
            storing.pin(self._bm, seq)
        return storing.own_block_ids(self._bm, seq)

    @writer
    def pin_blocks(self, request_id: Hashable) -> None:
        """Keep the sequence's blocks alive past `remove_sequence` (e.g. a KV transfer)."""
        storing.pin(self._bm, self._seq(request_id))

    @writer
    def unpin_blocks(self, block_ids: Iterable[int] | Mapping[int, Iterable[int]]) -> None:
        """Drop one pin per listed id (any collection of ids for one window, or a dict window -> ids)."""
        storing.unpin(self._bm, block_ids)

    @writer
    def remove_sequence(self, request_id: Hashable, *, store_for_reuse: bool = True, pin: bool = False) -> None:
        """Finish a request: store all its blocks for reuse (the trailing partial one too; the
        newest token has no KV yet), optionally pin them, then release last block first."""
        store_for_reuse, pin = check_flag("store_for_reuse", store_for_reuse), check_flag("pin", pin)
        seq = self._seq(request_id)
        if store_for_reuse:
            storing.store_all(self._bm, self._live, seq)
        if pin:
            storing.pin(self._bm, seq)
        self._bm.release(seq)
        self._live.remove(seq)

    # ------------------------------------------------------------------ tables for kernels
    @reader
    def block_ids(self, request_id: Hashable, window: int | None = None) -> list[list[int]]:
        """Block ids per beam (placeholders as `PLACEHOLDER_BLOCK_ID`)."""
        wm = window_manager(self._bm, window)
        return [row.tolist() for row in self._seq(request_id).windows[wm.index].blocks]

    @reader
    def block_table(
        self, request_ids: Iterable[Hashable], window: int | None = None, *, max_blocks: int | None = None
    ) -> np.ndarray:
        """int32 `[rows, max_blocks]` primary slots, one row per (request, beam); padding and
        placeholders point to the null slot (slot `primary_blocks`), which no block owns.
        Thread-safe."""
        ids = check_id_list("request_ids", request_ids)
        try:
            max_blocks = check_max_blocks(self.config, max_blocks)
            wm = window_manager(self._bm, window)
        except KVCacheError:
            check_table_ids(ids)  # a bad id list is reported first
            raise
        return wm.slot_table.gather(self._live.slot_rows(ids, wm), max_blocks)

    @reader
    def block_offsets(self, request_ids: Iterable[Hashable], *, max_blocks: int | None = None) -> np.ndarray:
        """TensorRT-LLM `KVCacheIndex` offsets `[num_pools, rows, 2, max_blocks]` (int32). Thread-safe."""
        request_ids, max_blocks = check_table_ids(request_ids), check_max_blocks(self.config, max_blocks)
        return self._live.block_offsets(request_ids, max_blocks)

    # ------------------------------------------------------------------ counts and stats
    @reader
    def num_free_blocks(self, window: int | None = None) -> int:
        """Free primary blocks (cached-but-unreferenced ones count as free); with several
        windows and no `window`, the minimum over windows."""
        return free_primary(self._bm, window)

    @reader
    def num_allocated_blocks(self, window: int | None = None) -> int:
        """Referenced primary blocks; with several windows and no `window`, the maximum."""
        return allocated_primary(self._bm, window)

    @reader
    def num_free_secondary_blocks(self, window: int | None = None) -> int:
        return free_secondary(self._bm, window)

    @reader
    def stats(self) -> KVCacheStats:
        return cache_stats(self._bm.windows, self._bm.tokens_per_block)

    @reader
    def request_stats(self, request_id: Hashable) -> RequestStats:
        """What admission did for a live request."""
        seq = self._seq(request_id)
        reused, missed, total, new = seq.admit_counts
        return RequestStats(reused, missed, total, new, hit_rate(reused, missed), seq.prepopulated)

    @reader
    def iteration_stats(self) -> IterationStats:
        """Counters since the previous call, plus current occupancy."""
        out, self._iter_base = iteration_stats(self._bm.windows, self._iter_base)
        return out

    @reader
    def priority_of_block(self, block_id: int, window: int | None = None) -> int:
        wm = window_manager(self._bm, window)
        return wm.queues.priority[known_block(wm, block_id)]

    @reader
    def block(self, block_id: int, window: int | None = None) -> BlockInfo:
        """A snapshot of one block's metadata (inspection and tests; see `BlockInfo`)."""
        wm = window_manager(self._bm, window)
        return block_info(wm, known_block(wm, block_id))

    # ------------------------------------------------------------------ scheduler queries
    @reader
    def analyze_prefix_reuse(self, request: Request) -> PrefixReuseSummary:
        """Run admission's planning (tree walks, safe prefix, in-place or copy) without
        committing anything, and summarise it."""
        return scheduler_queries.analyze_prefix_reuse(self._bm, self._live, request)

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
        return scheduler_queries.needed_blocks_one_step(self._bm, self._live, request_or_id, two_steps_lookahead, window, summary)

    @reader
    def remaining_blocks_to_completion(
        self, request_or_id, window: int | None = None, *, summary: PrefixReuseSummary | None = None
    ) -> int:
        """Blocks still to allocate for the request to finish (TensorRT-LLM's formula for full
        attention). A sliding window holds at most its prompt at admission, then at most
        `ceil((window + num_draft_tokens) / tokens_per_block) + 1` blocks (growth is paid for by
        out-of-window releases), so its remaining need is the peak of those minus what is held now."""
        return scheduler_queries.remaining_blocks_to_completion(self._bm, self._live, request_or_id, window, summary)

    @reader
    def needed_blocks_one_step_many(
        self, request_ids: Sequence[Hashable], two_steps_lookahead: bool = False, window: int | None = None
    ) -> np.ndarray:
        """`needed_blocks_one_step` of each admitted request, int64 `[n]`, in one call (a
        scheduler's step asks it of every running request). Every id is looked up first: an
        unknown one raises `UnknownRequestError`."""
        return scheduler_queries.needed_blocks_one_step_many(self._bm, self._live, request_ids, two_steps_lookahead, window)

    @reader
    def remaining_blocks_to_completion_many(self, request_ids: Sequence[Hashable], window: int | None = None) -> np.ndarray:
        """`remaining_blocks_to_completion` of each admitted request, int64 `[n]`, in one call
        (a scheduler's step asks it of every running request). Every id is looked up first: an
        unknown one raises `UnknownRequestError`."""
        return scheduler_queries.remaining_blocks_to_completion_many(self._bm, self._live, request_ids, window)

    @reader
    def start_scheduling(self) -> None:
        """Begin a scheduling dry run: shadow ref counts start equal to the real ones. The dry
        run lasts until the ledger next changes (then its calls raise `SchedulingStateError`)."""
        self._dry_run = scheduler_queries.start_scheduling(self._bm, self._version)

    @reader
    def scheduling_remove_sequence(self, request_id: Hashable) -> None:
        """Dry run: count the blocks that would become free if the request were removed."""
        run = check_dry_run(self._dry_run, self._version)
        scheduler_queries.scheduling_remove_sequence(self._bm, run, self._live.get(request_id))

    @reader
    def scheduling_has_free_blocks(self, n: int, window: int | None = None) -> bool:
        return scheduler_queries.scheduling_has_free_blocks(self._bm, check_dry_run(self._dry_run, self._version), n, window)

    @reader
    def scheduling_num_free_blocks(self, window: int | None = None) -> int:
        """Dry run: the free blocks of `window` counting the removals so far (every window's
        least with `window=None`): `scheduling_has_free_blocks(n, window)` is `n <=` this, so a
        scheduler checking many requests against one dry run reads it once per removal."""
        return scheduler_queries.scheduling_num_free_blocks(self._bm, check_dry_run(self._dry_run, self._version), window)

    # ------------------------------------------------------------------ housekeeping
    @writer
    def refresh_blocks(self) -> int:
        """Expire retention durations (once per iteration). Returns blocks moved to priority 35."""
        return sum(wm.queues.refresh() for wm in self._bm.windows)

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
        if isinstance(plan_or_seq, TransferPlan):
            seq = plan_or_seq.seq
        else:
            seq = check_int("plan sequence number", plan_or_seq, 0, None)
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
    def transfers_failed(self, plan_or_seq: TransferPlan | int, op_indices: Sequence[int] | None = None) -> TransferFailure:
        """Report that the newest plan (all of it, or the ops at `op_indices`) did not take
        effect, before any forward reads its destinations. Blocks whose content did not
        arrive leave the tree; live requests that relied on them are cut back and must be
        recomputed from `TransferFailure.recompute_from[request_id]` tokens (report progress
        with `set_context_position`; sliding-window requests in `readmit` must be removed and
        admitted again). See kvjax/ledger/transfer_failures.py."""
        seq = self._open_plan(plan_or_seq)
        taken = self._bm.recorder.taken
        failed = check_op_indices(op_indices, len(taken[0]))
        result = apply_failure(self._bm, self._live, seq, list(zip(*taken, strict=True)), failed)
        self._transfers.status = FAILED
        return result

    @reader
    def verify_integrity(self) -> None:
        """Raise `IntegrityError` if any ledger invariant is broken."""
        verify_ledger(self._bm, self._live)

    @reader
    def snapshot(self) -> tuple:
        """A hashable picture of the whole ledger state (tests compare it around failed calls).
        Thread-safe: `add_token`'s unlocked fast path is switched off while it reads (every
        token list's limit is set to 0, so every sequence's next token takes the locked path,
        which waits); that path is one list append (a listed sequence's length is its list's
        length), so no sequence is ever seen half-way through it. It is switched back on
        before returning, so a snapshot leaves no trace: the calls a test makes between two
        snapshots take the paths they would without them."""
        live = self._live
        live.pause_fast_path()
        try:
            state = (self._transfers.state(), tuple(sorted(live.kv_valid.items(), key=repr)),
                     tuple(sorted(live.pending.items(), key=repr)))
            return ledger_snapshot(self._bm, live.seqs) + state
        finally:
            live.resume_fast_path()

    # ------------------------------------------------------------------ tier-3 hooks (kvjax.ledger.tier3)
    @writer
    def enable_host_notices(self, evict_guard: tier3.EvictGuard | None = None) -> None:
        """Start collecting `HostNotice`s (`take_host_notices`); `evict_guard(window, block_hash,
        host_slot) -> bool`, if given, is asked before a cached host block is evicted (True:
        keep it host-pinned; release it with `unpin_host_slots`). It must not raise or call
        the ledger."""
        if evict_guard is not None and not callable(evict_guard):
            raise ArgumentTypeError(f"evict_guard must be callable or None, got {evict_guard!r}")
        hub = tier3.hub_of(self._bm)
        hub.listening = True
        hub.guard = evict_guard

    @writer
    def take_host_notices(self) -> list[tier3.HostNotice]:
        """The host notices since the last call, in order (see `kvjax.ledger.tier3`)."""
        return tier3.take_notices(self._bm)

    @writer
    def pin_host_slots(self, window: int | None, slots: Iterable[int]) -> None:
        """One host pin per listed host slot (counted: pin twice, unpin twice): the block owning
        it is never evicted nor its slot reused until `unpin_host_slots`."""
        wm = window_manager(self._bm, window)
        tier3.check_host_window(wm)
        checked = tier3.check_slots(wm, slots)
        tier3.host_tier(self._bm, wm).pin(checked)

    @writer
    def unpin_host_slots(self, window: int | None, slots: Iterable[int]) -> None:
        """Drop one host pin per listed host slot (every one must be pinned that often)."""
        wm = window_manager(self._bm, window)
        tier3.check_host_window(wm)
        checked = tier3.check_slots(wm, slots)
        tier3.host_tier(self._bm, wm).unpin(checked)

    @reader
    def host_slot_pins(self, window: int | None = None) -> dict[int, int]:
        """Host slot -> host pins, for the pinned slots of `window`."""
        wm = window_manager(self._bm, window)
        t = tier3.tier_of(wm)
        return {} if t is None else t.pinned()

    @writer
    def reserve_restore(self, request: Request, num_blocks: int) -> tier3.Restore:
        """Reserve host blocks for up to `num_blocks` of the request's blocks after its local
        prefix match (`kvjax.ledger.restores`); fill their `host_slots`, then commit or abort."""
        return restores.reserve(self._bm, self._live, request, num_blocks)

    @writer
    def commit_restore(self, ticket: tier3.Restore | int, num_arrived: int | None = None) -> int:
        """The first `num_arrived` (None: all) restored blocks arrived: cache them, free the rest."""
        return restores.commit(self._bm, ticket, num_arrived)

    @writer
    def abort_restore(self, ticket: tier3.Restore | int) -> None:
        """Free a restore's host blocks; nothing is cached."""
        restores.abort(self._bm, ticket)
