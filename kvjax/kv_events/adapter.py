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

import dataclasses
import logging
import time
from collections.abc import Iterable

from kvjax.config import CacheConfig
from kvjax.ledger.events import CreatedData, KVCacheEvent, RemovedData, StoredBlock, StoredData, UpdatedData
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

log = logging.getLogger(__name__)

MEDIA = (MEDIUM_GPU, MEDIUM_CPU)  # ledger cache level 0 (primary) and 1 (secondary)


@dataclasses.dataclass(slots=True)
class _Known:
    """An announced block: enough to announce it again on another tier."""

    parent: int | bytes | None
    tokens: tuple[int, ...]
    lora_id: int | None
    extra: tuple | None
    level: int


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
        self._known: dict[tuple[int, int | bytes], _Known] = {}
        self._partial: set[tuple[int, int | bytes]] = set()  # stored but never announced
        self._next_id: int | None = None
        self.ledger_gaps = 0  # times the ledger's event ids jumped (its buffer dropped events)
        self.unknown_hashes = 0  # removes / updates of blocks never announced (skipped)

    @property
    def num_known_blocks(self) -> int:
        return len(self._known)

    def reset(self) -> None:
        self._known.clear()
        self._partial.clear()

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
            extra_keys=extra if extra is not None and any(e is not None for e in extra) else None,
            group_idx=self._group[window],
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=sliding,
        )

    def _stored(self, window: int, data: StoredData, out: list) -> None:
        parent = None if data.parent_hash is None else canonical_hash(data.parent_hash)
        run: list = []  # (hash, tokens, extra) of the current run: one tier, one LoRA id
        run_parent, run_level, run_lora = parent, None, None

        def emit():
            if run:
                assert run_level is not None  # set with the run's first block
                out.append(self._stored_event(
                    window, run_parent, [h for h, _, _ in run], [t for _, toks, _ in run for t in toks],
                    run_lora, run_level, [e for _, _, e in run],
                ))

        for blk in data.blocks:
            h = canonical_hash(blk.block_hash)
            tokens = _token_ids(blk)
            if len(tokens) != self.block_size:  # partial: only ever a leaf, never announced
                self._partial.add((window, h))
                emit()
                run = []
                continue
            extra = _extra_keys(blk)
            if run and (blk.cache_level != run_level or blk.lora_id != run_lora):
                emit()
                run_parent, run = run[-1][0], []
            if not run:
                run_level, run_lora = blk.cache_level, blk.lora_id
            run.append((h, tokens, extra))
            self._known[(window, h)] = _Known(parent, tokens, blk.lora_id, extra, blk.cache_level)
            parent = h
        emit()

    def _removed(self, window: int, hashes, out: list) -> None:
        group = self._group.get(window)
        by_level: dict[int, list] = {}
        order: list[int] = []
        for raw in hashes:
            h = canonical_hash(raw)
            rec = self._known.pop((window, h), None)
            if rec is None:
                if (window, h) in self._partial:
                    self._partial.discard((window, h))
                else:
                    self.unknown_hashes += 1
                continue
            if rec.level not in by_level:
                by_level[rec.level] = []
                order.append(rec.level)
            by_level[rec.level].append(h)
        for level in order:
            out.append(BlockRemoved(by_level[level], MEDIA[level], group))

    def _updated(self, window: int, data: UpdatedData, out: list) -> None:
        if data.cache_level is None:
            return  # a priority change: nothing on the wire
        h = canonical_hash(data.block_hash)
        rec = self._known.get((window, h))
        if rec is None:
            if (window, h) not in self._partial:
                self.unknown_hashes += 1
            return
        old, new = data.cache_level
        if old == new or rec.level == new:
            return
        out.append(BlockRemoved([h], MEDIA[rec.level], self._group[window]))
        rec.level = new
        out.append(self._stored_event(window, rec.parent, [h], list(rec.tokens), rec.lora_id, new,
                                      None if rec.extra is None else [rec.extra]))
