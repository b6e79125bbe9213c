"""`LedgerEventAdapter`: kvjax ledger events -> vLLM wire events (the mapping in docs/kv_events.md).

The ledger's events say what happened to a block *in the tree*; the wire says which hashes a
replica holds *on which medium*. The gap between them is filled by remembering, for every block
the adapter has announced, its parent, tokens, LoRA id and tier (one record per cached block of
each window, so the state is bounded by the pool sizes):

- `Created` (a fresh cache)            -> `AllBlocksCleared` (once per batch), state reset
- `Stored(parent, blocks)`             -> `BlockStored` per run of full blocks on one tier;
                                          partial blocks are not announced (no request hash can
                                          name them: routers hash full blocks only)
- `Removed(hashes)`                    -> `BlockRemoved` on the tier each block was on
- `Updated(cache_level 0 -> 1)` offload -> `BlockRemoved(GPU)` + `BlockStored(CPU)`
- `Updated(cache_level 1 -> 0)` onboard -> `BlockRemoved(CPU)` + `BlockStored(GPU)`
- `Updated(priority only)`             -> nothing (the wire has no priorities)

A gap in the ledger's event ids (its bounded buffer dropped events) makes the adapter emit
`AllBlocksCleared` and forget its state: consumers then under-estimate what the replica holds
until new blocks are stored, which routes worse but never wrongly.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from typing import NamedTuple

from kvjax.config import CacheConfig
from kvjax.kv_events.wire import (
    KIND_FULL_ATTENTION,
    KIND_SLIDING_WINDOW,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireEvent,
    canonical_hash,
)
from kvjax.ledger.events import CreatedData, KVCacheEvent, RemovedData, StoredBlock, StoredColumns, StoredData, UpdatedData

log = logging.getLogger(__name__)

MEDIA = (MEDIUM_GPU, MEDIUM_CPU)  # ledger cache level 0 (primary) and 1 (secondary)


class _Known(NamedTuple):
    """An announced block: enough to announce it again on another tier (a tuple: the adapter
    files one per block it announces, so it is built by one C-level call)."""

    parent: int | bytes | None
    tokens: tuple[int, ...]
    lora_id: int | None
    extra: tuple | None
    level: int


_new_known = functools.partial(tuple.__new__, _Known)  # `_Known` from one tuple, without the Python-level `__new__`


def _token_ids(block: StoredBlock) -> tuple[int, ...]:
    """Token ids of a block (a key with extra ids stores (token, extra id) pairs)."""
    toks = block.tokens
    if toks and isinstance(toks[0], tuple):
        return tuple(t for t, _ in toks)
    return tuple(toks)


def _extra_keys(block: StoredBlock) -> tuple | None:
    """Per-block extra keys as vLLM publishes them: (multimodal hash hex, start offset) pairs."""
    if not block.mm_keys:
        return None
    return tuple((mm.hash.hex(), mm.start_offset) for mm in block.mm_keys)


class LedgerEventAdapter:
    """Converts one ledger's events into wire events; one instance per ledger, fed in order."""

    def __init__(self, config: CacheConfig, *, data_parallel_rank: int | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        self.block_size = config.tokens_per_block
        self.data_parallel_rank = data_parallel_rank
        self._group = {w: i for i, w in enumerate(config.windows)}
        self._spec = {
            w: (KIND_SLIDING_WINDOW, w) if config.is_swa(w) else (KIND_FULL_ATTENTION, None) for w in config.windows
        }
        # per window: announced blocks by hash, and partial blocks stored but never announced
        self._known: dict[int, dict[int | bytes, _Known]] = {w: {} for w in self._group}
        self._partial: dict[int, set[int | bytes]] = {w: set() for w in self._group}
        self._next_id: int | None = None
        self.ledger_gaps = 0  # times the ledger's event ids jumped (its buffer dropped events)
        self.unknown_hashes = 0  # removes / updates of blocks never announced (skipped)

    @property
    def num_known_blocks(self) -> int:
        return sum(map(len, self._known.values()))

    def reset(self) -> None:
        for known in self._known.values():
            known.clear()
        for partial in self._partial.values():
            partial.clear()

    # ------------------------------------------------------------------ conversion
    def convert(self, events: Iterable[KVCacheEvent], ts: float | None = None) -> KVEventBatch | None:
        """The wire batch for a list of ledger events (oldest first), or None if nothing
        on the wire changes."""
        events = list(events)
        for ev in events:  # check everything first: a bad event leaves the adapter as it was
            if not isinstance(ev, KVCacheEvent):
                raise TypeError(f"expected kvjax ledger events, got {type(ev).__name__}")
            if not isinstance(ev.data, (StoredData, RemovedData, UpdatedData, CreatedData)):
                raise TypeError(f"unknown ledger event data {type(ev.data).__name__}")
            if ev.window_size not in self._group:
                raise ValueError(f"event for window {ev.window_size}, which this cache does not have {tuple(self._group)}")
        out: list[WireEvent] = []
        cleared = False
        for ev in events:
            if self._next_id is not None and ev.event_id != self._next_id:
                self.ledger_gaps += 1
                log.warning("ledger event ids jumped from %d to %d (its event buffer dropped events): "
                            "publishing AllBlocksCleared", self._next_id, ev.event_id)
                self.reset()
                out.append(AllBlocksCleared())
                cleared = True
            self._next_id = ev.event_id + 1
            data = ev.data
            if isinstance(data, StoredData):
                self._stored(ev.window_size, data, out)
            elif isinstance(data, RemovedData):
                self._removed(ev.window_size, data.block_hashes, out)
            elif isinstance(data, UpdatedData):
                self._updated(ev.window_size, data, out)
            else:  # CreatedData
                if not cleared:
                    out.append(AllBlocksCleared())
                    cleared = True
                self.reset()
        if not out:
            return None
        return KVEventBatch(time.time() if ts is None else ts, out, self.data_parallel_rank)

    def _stored_event(self, window: int, parent, hashes: list, tokens: list[int], lora_id, level: int,
                      extra: list | None) -> BlockStored:
        kind, sliding = self._spec[window]
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=self.block_size,
            lora_id=lora_id,
            medium=MEDIA[level],
            lora_name=None,  # kvjax's LoRA adapters have integer ids only
            extra_keys=extra if extra is not None and extra.count(None) != len(extra) else None,
            group_idx=self._group[window],
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=sliding,
        )

    def _stored(self, window: int, data: StoredData, out: list) -> None:
        parent = None if data.parent_hash is None else canonical_hash(data.parent_hash)
        cols = data.columns
        if cols is not None and not cols.mm_keys and cols.block_size == self.block_size and len(set(cols.cache_levels)) == 1:
            self._stored_columns(window, parent, cols, out)
            return
        known, block_size = self._known[window], self.block_size
        # the current run (one tier, one LoRA id): hashes, token ids, extra keys
        hashes: list = []
        tokens: list[int] = []
        extras: list = []
        run_parent, run_level, run_lora = parent, None, None

        def emit() -> None:
            if hashes:
                assert run_level is not None  # set with the run's first block
                out.append(self._stored_event(window, run_parent, hashes, tokens, run_lora, run_level, extras))

        for blk in data.blocks:
            h = blk.block_hash
            if type(h) is not bytes:  # the ledger's SHA-256 hashes are bytes already
                h = canonical_hash(h)
            toks = blk.tokens
            if type(toks) is not tuple or (toks and type(toks[0]) is not int):  # pairs with extra ids
                toks = _token_ids(blk)
            if len(toks) != block_size:  # partial: only ever a leaf, never announced
                self._partial[window].add(h)
                emit()
                hashes, tokens, extras = [], [], []
                continue
            extra = _extra_keys(blk) if blk.mm_keys else None
            level, lora = blk.cache_level, blk.lora_id
            if hashes and (level != run_level or lora != run_lora):
                emit()
                run_parent, hashes, tokens, extras = hashes[-1], [], [], []
            if not hashes:
                run_level, run_lora = level, lora
            hashes.append(h)
            tokens += toks
            extras.append(extra)
            known[h] = _new_known((parent, toks, lora, extra, level))
            parent = h
        emit()

    def _stored_columns(self, window: int, parent, cols: StoredColumns, out: list) -> None:
        """`_stored` of a run the ledger built as columns, one tier and no multimodal keys:
        one `BlockStored` of its full blocks, read from the columns without per-block records."""
        bs = self.block_size
        toks = cols.token_ids
        hashes = [h if type(h) is bytes else canonical_hash(h) for h in cols.block_hashes]
        n_full = len(toks) // bs  # only the last block may be partial: never announced
        if n_full < len(hashes):
            self._partial[window].add(hashes.pop())
        if not hashes:
            return
        known, lora, level = self._known[window], cols.lora_id, cols.cache_levels[0]
        first = parent
        for i, h in enumerate(hashes):
            known[h] = _new_known((parent, toks[i * bs : (i + 1) * bs], lora, None, level))
            parent = h
        out.append(self._stored_event(window, first, hashes, list(toks[: n_full * bs]), lora, level, None))

    def _removed(self, window: int, hashes, out: list) -> None:
        group = self._group.get(window)
        known, partial = self._known[window], self._partial[window]
        by_level: dict[int, list] = {}
        order: list[int] = []
        for h in hashes:
            if type(h) is not bytes:
                h = canonical_hash(h)
            rec = known.pop(h, None)
            if rec is None:
                if h in partial:
                    partial.discard(h)
                else:
                    self.unknown_hashes += 1
                continue
            level = rec.level
            if level not in by_level:
                by_level[level] = []
                order.append(level)
            by_level[level].append(h)
        for level in order:
            out.append(BlockRemoved(by_level[level], MEDIA[level], group))

    def _updated(self, window: int, data: UpdatedData, out: list) -> None:
        if data.cache_level is None:
            return  # a priority change: nothing on the wire
        h = canonical_hash(data.block_hash)
        rec = self._known[window].get(h)
        if rec is None:
            if h not in self._partial[window]:
                self.unknown_hashes += 1
            return
        old, new = data.cache_level
        if old == new or rec.level == new:
            return
        out.append(BlockRemoved([h], MEDIA[rec.level], self._group[window]))
        self._known[window][h] = rec._replace(level=new)
        out.append(self._stored_event(window, rec.parent, [h], list(rec.tokens), rec.lora_id, new,
                                      None if rec.extra is None else [rec.extra]))
