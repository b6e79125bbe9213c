"""`BlockManager`: the window managers, the shared radix tree, events and the transfer recorder,
and the multi-window algorithms that span them (admission with reuse, token growth, storing,
release).

Admission is two-phase so that it is atomic and batch-aware: `plan_admission` walks the tree
(read-only) for every request and window, fixes the prepopulated length (the minimum over
windows, shortened until every sliding window is safe), decides in-place versus copy for
partial matches and checks capacity; only then does `commit_admission` claim, copy, onboard
and allocate. A failed check raises before anything changed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvjax.config import DEFAULT_PRIORITY, CacheConfig
from kvjax.errors import OutOfBlocksError
from kvjax.ledger.block import PRIMARY, SECONDARY, Block
from kvjax.ledger.block_key import BlockKey
from kvjax.ledger.events import KVCacheEventManager
from kvjax.ledger.radix_tree import UnifiedBlockTree
from kvjax.ledger.sequence import Sequence
from kvjax.ledger.transfer_plan import TransferRecorder
from kvjax.ledger.window_manager import WindowBlockManager

_new_key = tuple.__new__

# One matched position: (block or None for an out-of-window placeholder, tokens matched).
Entry = tuple[Block | None, int]


@dataclasses.dataclass
class WindowAdmission:
    """What admission will do for one request in one window."""

    entries: list[Entry]
    num_shared: int  # context blocks shared by all beams
    num_per_beam: int  # 1 when the last context block is allocated once per beam
    missing_ends: list[int]  # end token of every position a sliding window lacks (SWA walk)
    coverage: int  # tokens the walk matched


@dataclasses.dataclass
class Admission:
    seq: Sequence
    windows: list[WindowAdmission]
    prepopulated: int = 0
    # per-request deltas: reused, missed, alloc_total, alloc_new
    deltas: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0, 0])


class BlockManager:
    def __init__(self, config: CacheConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.tree = UnifiedBlockTree(config.tokens_per_block)
        self.recorder = TransferRecorder()
        self.events = KVCacheEventManager(config.event_buffer_max_size) if config.event_buffer_max_size > 0 else None
        self.windows = [
            WindowBlockManager(i, w, config, self.tree, self.recorder, self.events, clock)
            for i, w in enumerate(config.windows)
        ]
        self.window_index = {wm.window: wm.index for wm in self.windows}
        self.is_cross = config.cache_type == "cross"
        # TensorRT-LLM disables reuse when sink tokens leave a bubble before generation starts.
        self.reuse = config.enable_block_reuse and not self.is_cross and config.sink_bubble_length == 0

    # ------------------------------------------------------------------ admission: plan
    def walk(self, wm: WindowBlockManager, seq: Sequence, usable: int, num_shared: int) -> WindowAdmission:
        """One read-only tree walk matching the sequence's keys in one window."""
        tpb = self.tokens_per_block
        cfg = self.config
        partial_ok = cfg.enable_partial_reuse
        skip_referenced = not cfg.copy_on_partial_reuse
        w = wm.window
        node = self.tree.root
        entries: list[Entry] = []
        missing: list[int] = []
        coverage = 0
        tokens = seq.tokens
        plain = seq.extra_ids is None and not seq.mm_items  # key = tokens + lora + salt only
        lora, salt = seq.lora_task_id, seq.salt_id
        swa = wm.is_swa
        for d in range(num_shared):
            start = d * tpb
            end = start + tpb
            if end > usable:
                end = usable
                if end <= start:
                    break
            # a plain tuple equals (and hashes like) the BlockKey it mirrors: no key object needed
            key = (tuple(tokens[start:end]), None, lora, salt, ()) if plain else seq.key(start, end)
            child = node.children.get(key)
            if child is not None:
                blk = child.blocks.get(w)
                if blk is not None and child.is_full:
                    entries.append((blk, tpb))
                    coverage += tpb
                    node = child
                    continue
                if blk is None and swa:  # a gap a sliding window may not need
                    entries.append((None, tpb))
                    coverage += tpb
                    missing.append(end)
                    node = child
                    continue
            if partial_ok:
                cand, n = self.tree.best_partial_child(node, BlockKey._make(key), w, skip_referenced)
                if cand is not None:
                    entries.append((cand.blocks[w], n))
                    coverage += n
            break
        while entries and entries[-1][0] is None:  # a walk cannot end on a gap
            entries.pop()
            coverage -= tpb
            missing.pop()
        return WindowAdmission(entries, num_shared, 0, missing, coverage)

    def _safe(self, wm: WindowBlockManager, wa: WindowAdmission, length: int) -> bool:
        """Can `length` prepopulated tokens be reused in this window? Sliding windows need every
        position inside the window before the reuse point to be real."""
        if length > wa.coverage:
            return False
        if not wm.is_swa:
            return True
        last_gap = 0
        for end in wa.missing_ends:
            if end - self.tokens_per_block < length:
                last_gap = end
        return last_gap == 0 or length >= last_gap + wm.window

    def plan_sequence(self, seq: Sequence) -> Admission:
        tpb = self.tokens_per_block
        n_ctx = -(-seq.prompt_len // tpb)
        beam = seq.beam_width
        admission = Admission(seq, [])
        if self.is_cross:
            for wm in self.windows:
                admission.windows.append(WindowAdmission([], n_ctx, 0, [], 0))
            return admission
        if not self.reuse:
            shared = n_ctx if beam == 1 or seq.prompt_len % tpb == 0 else n_ctx - 1
            for wm in self.windows:
                admission.windows.append(WindowAdmission([], shared, 1 if shared < n_ctx else 0, [], 0))
            return admission
        shared = n_ctx if beam == 1 else n_ctx - 1
        usable = seq.prompt_len - 1  # the last prompt token is always recomputed (its logits)
        was = [self.walk(wm, seq, usable, shared) for wm in self.windows]
        length = min(usable, min(wa.coverage for wa in was))
        while length > 0 and not all(self._safe(wm, wa, length) for wm, wa in zip(self.windows, was)):
            length = (length - 1) // tpb * tpb
        for wm, wa in zip(self.windows, was):
            wa.num_per_beam = 1 if shared < n_ctx else 0
            if length < wa.coverage or wm.is_swa:
                wa.entries = self._truncate(wm, wa.entries, length)
        admission.windows = was
        admission.prepopulated = length
        return admission

    def _truncate(self, wm: WindowBlockManager, entries: list[Entry], length: int) -> list[Entry]:
        """Keep the matches inside the first `length` tokens (a straddled block becomes a
        partial match); a sliding window leaves positions it will never read as placeholders."""
        tpb = self.tokens_per_block
        out: list[Entry] = []
        for d, (blk, n) in enumerate(entries):
            start = d * tpb
            if start >= length:
                break
            out.append((blk, min(n, length - start)))
        if wm.is_swa:
            needed_from = length - wm.window + 1  # first key position the first new query sees
            for d, (blk, n) in enumerate(out):
                if (d + 1) * tpb <= needed_from:
                    out[d] = (None, n)
        return out

    def check_capacity(self, admissions: list[Admission]) -> dict[int, dict[Block, int | None]]:
        """Raise `OutOfBlocksError` unless every window can serve the whole batch; returns, per
        window, each partially matched block -> index of the request reusing it in place."""
        tpb = self.tokens_per_block
        in_place_by_window: dict[int, dict[Block, int | None]] = {}
        for wm in self.windows:
            full: dict[Block, None] = {}
            partial: dict[Block, list[int]] = {}
            need = 0
            for i, adm in enumerate(admissions):
                wa = adm.windows[wm.index]
                for blk, n in wa.entries:
                    if blk is None:
                        continue
                    if n == tpb:
                        full[blk] = None
                    else:
                        partial.setdefault(blk, []).append(i)
                need += (wa.num_shared - len(wa.entries)) + wa.num_per_beam * adm.seq.beam_width
            in_place: dict[Block, int | None] = {}
            for blk, claimers in partial.items():
                ok = blk not in full and blk.ref_count == 0 and wm.is_leaf(blk)
                in_place[blk] = claimers[-1] if ok else None
                need += len(claimers) - (1 if ok else 0)  # copies
                if ok and blk.level == SECONDARY:
                    need += 1  # onboard target
            held = 0
            for blk in full:
                if blk.ref_count == 0:
                    if blk.level == PRIMARY:
                        held += 1
                    else:
                        need += 1  # onboard target
                elif blk.level == SECONDARY:
                    need += 1
            for blk in partial:
                if blk.ref_count == 0 and blk.level == PRIMARY and blk not in full:
                    held += 1
            free = wm.num_free_primary - held
            if need > free:
                raise OutOfBlocksError(
                    f"window {wm.window}: admission needs {need} free primary blocks, {free} available"
                )
            in_place_by_window[wm.index] = in_place
        return in_place_by_window

    # ------------------------------------------------------------------ admission: commit
    def commit_admission(self, admissions: list[Admission], in_place_by_window: dict) -> None:
        tpb = self.tokens_per_block
        reuse = self.reuse
        for wm in self.windows:
            widx = wm.index
            in_place = in_place_by_window[widx]
            c = wm.counters
            policy = wm.policy
            # Phase A: take every matched block that is free out of the free queues, so no
            # allocation below can evict a block some request of the batch reuses or copies.
            held: list[Block] = []
            for adm in admissions:
                for blk, _ in adm.windows[widx].entries:
                    if blk is not None and blk.free_level >= 0:
                        policy.take(blk)
                        held.append(blk)
            # Phase B: per request, in order: claim, onboard, copy or reuse in place, allocate.
            for i, adm in enumerate(admissions):
                seq = adm.seq
                wa = adm.windows[widx]
                sw = seq.windows[widx]
                before = (c.reused_full + c.reused_partial, c.missed, c.alloc_total, c.alloc_new)
                single = seq.beam_width == 1
                retention = seq.retention is not None
                beam0, slots0 = sw.beams[0], sw.slots[0]
                cursor = None
                for d, (blk, n) in enumerate(wa.entries):
                    if blk is None:
                        wm.append_placeholder(sw)
                        sw.num_front_removed = d + 1
                        continue
                    if n == tpb:
                        if retention:
                            prio, dur = seq.block_priority(d, tpb)
                            if prio is not None and prio != blk.priority:
                                wm.set_priority(blk, prio)
                            blk.duration = dur
                        else:
                            blk.duration = None
                        blk.ref_count += 1
                        if blk.level == SECONDARY:
                            wm.onboard(blk)
                        c.reused_full += 1
                        if cursor is None or cursor[1] == d:
                            cursor = (blk.node, d + 1)
                    else:
                        prio, dur = seq.block_priority(d, tpb)
                        if in_place.get(blk) == i:
                            wm.drop_cached(blk, evicted=False)
                            policy.claim(blk, DEFAULT_PRIORITY if prio is None else prio, dur)
                            blk.ref_count += 1
                            if blk.level == SECONDARY:
                                wm.onboard(blk)
                        else:
                            blk = wm.copy_prefix(blk, n, prio, dur)
                            blk.ref_count += 1
                        c.reused_partial += 1
                    if single:
                        blk.prev_in_seq = beam0[-1] if beam0 else None
                        beam0.append(blk)
                        slots0.append(blk.slot)
                    else:
                        wm.append_block(sw, blk)
                if cursor is not None:  # the matched chain is in the tree: storing starts after it
                    sw.store_node, sw.store_depth = cursor
                for d in range(len(wa.entries), wa.num_shared):
                    prio, dur = seq.block_priority(d, tpb)
                    blk = wm.get_free_block(prio, dur)
                    blk.ref_count += 1
                    if single:
                        blk.prev_in_seq = beam0[-1] if beam0 else None
                        beam0.append(blk)
                        slots0.append(blk.slot)
                    else:
                        wm.append_block(sw, blk)
                    if reuse:
                        c.missed += 1
                if wa.num_per_beam:
                    prio, dur = seq.block_priority(wa.num_shared, tpb)
                    for b in range(seq.beam_width):
                        blk = wm.get_free_block(prio, dur)
                        blk.ref_count += 1
                        wm.append_block(sw, blk, beam=b)
                    if reuse:
                        c.missed += 1
                after = (c.reused_full + c.reused_partial, c.missed, c.alloc_total, c.alloc_new)
                for k in range(4):
                    adm.deltas[k] += after[k] - before[k]
            for blk in held:
                if blk.ref_count == 0:
                    policy.release(blk)
        for adm in admissions:
            adm.seq.prepopulated = adm.prepopulated

    # ------------------------------------------------------------------ growth
    def grow(self, seq: Sequence, index: int) -> None:
        """Allocate block `index`, which the sequence's next token starts (one per beam when
        beams diverge). Capacity is checked in every window before anything is allocated."""
        per_token = seq.beam_width
        for wm in self.windows:
            if wm.num_free_primary < per_token:
                raise OutOfBlocksError(f"window {wm.window}: no free block for request {seq.request_id!r}")
        tpb = self.tokens_per_block
        prio, dur = seq.block_priority(index, tpb)
        for wm in self.windows:
            sw = seq.windows[wm.index]
            if per_token == 1:
                blk = wm.get_free_block(prio, dur)
                blk.ref_count += 1
                wm.append_block(sw, blk)
            else:
                for b in range(per_token):
                    blk = wm.get_free_block(prio, dur)
                    blk.ref_count += 1
                    wm.append_block(sw, blk, beam=b)
            wm.counters.gen_alloc += per_token

    def detach_out_of_window(self, seq: Sequence) -> None:
        """Sliding windows: release front blocks no future query can see."""
        tpb = self.tokens_per_block
        n = seq.num_tokens
        for wm in self.windows:
            if wm.is_swa:
                sw = seq.windows[wm.index]
                while n - sw.num_front_removed * tpb >= wm.window + tpb:
                    wm.detach_front_block(sw)

    # ------------------------------------------------------------------ storing
    def store(self, seq: Sequence, num_tokens: int, allow_partial: bool) -> dict[int, list[Block]]:
        """Store the blocks covering `num_tokens` tokens in every window (largest window first)."""
        out: dict[int, list[Block]] = {}
        if num_tokens <= 0:
            return {wm.window: [] for wm in self.windows}
        for wm in reversed(self.windows):
            out[wm.window] = wm.store(seq, seq.windows[wm.index], num_tokens, allow_partial)
        return out

    def release(self, seq: Sequence) -> None:
        for wm in self.windows:
            wm.release_sequence(seq.windows[wm.index])
