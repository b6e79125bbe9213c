"""`BlockManager`: the window managers, the shared radix tree, events and the transfer recorder,
and the multi-window algorithms that span them (admission with reuse, token growth, storing,
release).

Admission plans before it commits, so that it is atomic and batch-aware: `plan_sequence`
walks the tree (read-only) for every request and window and fixes the prepopulated length
(the minimum over windows, shortened until every sliding window is safe); `check_capacity`
decides in-place versus copy for partial matches and counts what the batch takes
(`window_need`, the count the scheduler queries share); only then does `commit_admission`
claim, copy, onboard and allocate. A failed check raises before anything changed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from kvjax.config import DEFAULT_PRIORITY, CacheConfig
from kvjax.errors import OutOfBlocksError
from kvjax.ledger.block import PRIMARY, SECONDARY, Block
from kvjax.ledger.block_key import BlockHasher, BlockKey
from kvjax.ledger.events import KVCacheEventManager
from kvjax.ledger.radix_tree import UnifiedBlockTree
from kvjax.ledger.sequence import Sequence
from kvjax.ledger.transfer_plan import TransferRecorder
from kvjax.ledger.window_manager import WindowBlockManager



@dataclasses.dataclass
class WindowAdmission:
    """What admission will do for one request in one window.

    `matched` holds the fully matched blocks from position 0 (None: a position a sliding
    window does not need, left as a placeholder); `partial` the (block, tokens) matched in the
    next position, if any; the remaining shared positions and per-beam blocks are allocated.
    """

    matched: list[Block | None]
    partial: tuple[Block, int] | None
    num_shared: int  # context blocks shared by all beams
    num_per_beam: int = 0  # 1 when the last context block is allocated once per beam
    gap_ends: list[int] = dataclasses.field(default_factory=list)  # sliding window: end of each missing position
    coverage: int = 0  # tokens matched

    @property
    def num_matched_positions(self) -> int:
        return len(self.matched) + (self.partial is not None)


class WindowNeed(NamedTuple):
    """Free primary blocks an admission takes from one window, phase by phase.

    `held`: free matched primary blocks taken out of the queues first (copy sources included);
    `claims`: blocks phase A allocates (onboard targets, partial copies); `released`: held
    copy sources that go back to the queues after phase A; `fresh`: blocks phase B allocates.
    """

    held: int
    claims: int
    released: int
    fresh: int
    in_place: dict

    @property
    def required(self) -> int:
        """Free primary blocks the window must have: phase A draws on the unheld ones, phase B
        on what is left plus the released copy sources."""
        return self.held + max(self.claims, self.claims + self.fresh - self.released)

    @property
    def taken(self) -> int:
        """How far `num_free_blocks` drops once the admission is committed."""
        return self.held - self.released + self.claims + self.fresh


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
        self.tree = UnifiedBlockTree(config.tokens_per_block, BlockHasher(config.event_hash))
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
        """One read-only tree walk matching the sequence's first `usable` tokens in one window."""
        tpb = self.tokens_per_block
        w = wm.window
        node = self.tree.root
        matched: list[Block | None] = []
        gaps: list[int] = []
        tokens = seq.tokens
        plain = seq.extra_ids is None and not seq.mm_items  # key = tokens + lora + salt only
        lora, salt = seq.lora_task_id, seq.salt_id
        swa = wm.is_swa
        n_full = min(usable // tpb, num_shared)
        sig = (lora, salt)
        d = 0
        while d < n_full:
            start = d * tpb
            # a plain tuple equals (and hashes like) the BlockKey it mirrors: no key object needed
            key = (tuple(tokens[start : start + tpb]), None, lora, salt, ()) if plain else seq.key(start, start + tpb)
            child = node.children.get(key)
            if child is None:
                break
            blk = child.blocks.get(w)
            if blk is None:
                if not swa:
                    break
                gaps.append(start + tpb)  # a gap a sliding window may not need
            matched.append(blk)
            node = child
            d += 1
            run = child.run
            if run is not None and plain and not swa and run.sig == sig and d < n_full:
                node, d = self._follow_run(node, run, tokens, d, n_full, w, matched)
        while matched and matched[-1] is None:  # a walk cannot end on a gap
            matched.pop()
            gaps.pop()
        node_at = matched[-1].node if matched else self.tree.root
        partial = None
        d = len(matched)
        start = d * tpb
        end = min(start + tpb, usable)
        if d < num_shared and end > start and self.config.enable_partial_reuse:
            key = BlockKey._make((tuple(tokens[start:end]), None, lora, salt, ())) if plain else seq.key(start, end)
            cand, n = self.tree.best_partial_child(node_at, key, w, not self.config.copy_on_partial_reuse)
            if cand is not None:
                partial = (cand.blocks[w], n)
        coverage = len(matched) * tpb + (partial[1] if partial else 0)
        return WindowAdmission(matched, partial, num_shared, 0, gaps, coverage)

    def _follow_run(self, node, run, tokens: list[int], d: int, n_full: int, window: int, matched: list) -> tuple:
        """Extend a match along the nodes one earlier `store` created, following `next_in_run`
        links while they are alive and hold a block of this window. One slice comparison of the
        rest of the prompt against that store's tokens usually proves the whole stretch equal;
        otherwise each block is compared as it is followed."""
        tpb = self.tokens_per_block
        rt = run.tokens
        off = d * tpb - run.base  # our next block starts here inside the run
        k = min((len(rt) - off) // tpb, n_full - d)
        if k <= 0:
            return node, d
        start = d * tpb
        verify = tuple(tokens[start : start + k * tpb]) != rt[off : off + k * tpb]
        first = len(matched)
        for _ in range(k):  # only full blocks: k counts whole blocks of the run's tokens
            nxt = node.next_in_run
            if nxt is None or not nxt.attached:
                break
            if verify and tuple(tokens[start : start + tpb]) != nxt.key.tokens:
                break
            blk = nxt.blocks.get(window)
            if blk is None:
                break
            matched.append(blk)
            node = nxt
            start += tpb
        return node, d + len(matched) - first

    def _safe(self, wm: WindowBlockManager, wa: WindowAdmission, length: int) -> bool:
        """Can `length` prepopulated tokens be reused in this window? A sliding window needs
        every position inside the window before the reuse point to be real."""
        if length > wa.coverage:
            return False
        if not wm.is_swa:
            return True
        last_gap = 0
        for end in wa.gap_ends:
            if end - self.tokens_per_block < length:
                last_gap = end
        return last_gap == 0 or length >= last_gap + wm.window

    def plan_sequence(self, seq: Sequence) -> Admission:
        tpb = self.tokens_per_block
        n_ctx = -(-seq.prompt_len // tpb)
        beam = seq.beam_width
        admission = Admission(seq, [])
        if self.is_cross:
            admission.windows = [WindowAdmission([], None, n_ctx) for _ in self.windows]
            return admission
        if not self.reuse:
            shared = n_ctx if beam == 1 or seq.prompt_len % tpb == 0 else n_ctx - 1
            admission.windows = [WindowAdmission([], None, shared, int(shared < n_ctx)) for _ in self.windows]
            return admission
        shared = n_ctx if beam == 1 else n_ctx - 1
        usable = seq.prompt_len - 1  # the last prompt token is always recomputed (its logits)
        was = [self.walk(wm, seq, usable, shared) for wm in self.windows]
        length = min(wa.coverage for wa in was)
        while length > 0 and not all(self._safe(wm, wa, length) for wm, wa in zip(self.windows, was)):
            length = (length - 1) // tpb * tpb
        for wm, wa in zip(self.windows, was):
            wa.num_per_beam = int(shared < n_ctx)
            if length < wa.coverage or wm.is_swa:
                self._truncate(wm, wa, length)
        admission.windows = was
        admission.prepopulated = length
        return admission

    def _truncate(self, wm: WindowBlockManager, wa: WindowAdmission, length: int) -> None:
        """Keep the matches inside the first `length` tokens (a straddled full block becomes a
        partial match); a sliding window leaves positions it will never read as placeholders."""
        tpb = self.tokens_per_block
        full, rest = divmod(length, tpb)
        if full < len(wa.matched):
            blk = wa.matched[full]
            wa.partial = (blk, rest) if rest and blk is not None else None
            del wa.matched[full:]
        elif wa.partial is not None and rest < wa.partial[1]:
            wa.partial = (wa.partial[0], rest) if rest else None
        if wm.is_swa:
            needed_from = length - wm.window + 1  # first key position the first new query sees
            for d in range(len(wa.matched)):
                if (d + 1) * tpb <= needed_from:
                    wa.matched[d] = None
        wa.coverage = length

    def window_need(self, wm: WindowBlockManager, admissions: list[Admission]) -> WindowNeed:
        """What committing `admissions` takes from `wm`'s free primary blocks, phase by phase
        (see `commit_admission`): the one count both admission and the scheduler queries use."""
        idx = wm.index
        fresh = 0
        partial: dict[Block, list[int]] = {}
        for i, adm in enumerate(admissions):
            wa = adm.windows[idx]
            if wa.partial is not None:
                partial.setdefault(wa.partial[0], []).append(i)
            fresh += wa.num_shared - wa.num_matched_positions + wa.num_per_beam * adm.seq.beam_width
        # Matched blocks that are free leave the free pool: primary ones are held, secondary
        # ones need an onboard target (referenced blocks are always primary).
        if len(admissions) == 1:
            free_matched = [b for b in admissions[0].windows[idx].matched if b is not None and not b.ref_count]
        else:
            free_matched = list(
                dict.fromkeys(b for adm in admissions for b in adm.windows[idx].matched if b is not None and not b.ref_count)
            )
        held = sum(1 for b in free_matched if b.level == PRIMARY)
        claims = len(free_matched) - held  # onboard targets
        released = 0
        in_place: dict[Block, int | None] = {}
        if partial:
            full = {b for adm in admissions for b in adm.windows[idx].matched} if len(admissions) > 1 else ()
            for blk, claimers in partial.items():
                ok = blk not in full and blk.ref_count == 0 and wm.is_leaf(blk)
                in_place[blk] = claimers[-1] if ok else None
                claims += len(claimers) - ok  # copies
                claims += ok and blk.level == SECONDARY  # onboard target
                free_source = blk not in full and not blk.ref_count and blk.level == PRIMARY
                held += free_source
                released += free_source and not ok  # a copy source only: free again once copied
        return WindowNeed(held, claims, released, fresh, in_place)

    def check_capacity(self, admissions: list[Admission]) -> dict[int, dict[Block, int | None]]:
        """Raise `OutOfBlocksError` unless every window can serve the whole batch; returns, per
        window, each partially matched block -> index of the request reusing it in place."""
        in_place_by_window: dict[int, dict[Block, int | None]] = {}
        for wm in self.windows:
            need = self.window_need(wm, admissions)
            free = wm.num_free_primary
            if need.required > free:
                raise OutOfBlocksError(
                    f"window {wm.window}: admission needs {need.required} free primary blocks, {free} available"
                )
            in_place_by_window[wm.index] = need.in_place
        return in_place_by_window

    # ------------------------------------------------------------------ admission: commit
    def commit_admission(self, admissions: list[Admission], in_place_by_window: dict) -> None:
        """Per window, in two phases over the whole batch: (A) claim every match, onboard
        secondary ones, copy or claim partial matches; then copy sources nobody claimed go
        back to the free queues, their content read by the copies the plan already holds;
        (B) allocate every fresh block. So a copy source may be recycled by the same batch,
        and what a batch takes is what `window_need` counted."""
        tpb = self.tokens_per_block
        reuse = self.reuse
        for wm in self.windows:
            widx = wm.index
            in_place = in_place_by_window[widx]
            c = wm.counters
            policy = wm.policy
            take = policy.take
            # Take every matched free block out of the queues first, so no allocation (an
            # onboard target, a copy, a fresh block, another request's) can evict a block the
            # batch is about to reuse or copy.
            held: list[Block] = []
            for adm in admissions:
                wa = adm.windows[widx]
                for blk in wa.matched:
                    if blk is not None and blk.free_level >= 0:
                        take(blk)
                        held.append(blk)
                if wa.partial is not None and wa.partial[0].free_level >= 0:
                    take(wa.partial[0])
                    held.append(wa.partial[0])
            for i, adm in enumerate(admissions):  # phase A: matches
                seq = adm.seq
                wa = adm.windows[widx]
                sw = seq.windows[widx]
                before = (c.reused_full + c.reused_partial, c.missed, c.alloc_total, c.alloc_new)
                matched = wa.matched
                # full matches: claim (keeping a cached block's priority unless the request
                # states one), onboard secondary ones, then append to every beam
                gaps = 0
                for blk in matched:
                    if blk is None:
                        gaps += 1
                        continue
                    blk.ref_count += 1
                    blk.duration = None
                    if blk.level:
                        wm.onboard(blk)
                if seq.retention is not None and matched:
                    seq.block_priority(0, tpb)  # builds the per-block retention table
                    for blk, (prio, dur) in zip(matched, seq.context_retention):
                        if blk is not None:
                            blk.duration = dur
                            if prio is not None and prio != blk.priority:
                                wm.set_priority(blk, prio)
                c.reused_full += len(matched) - gaps
                if gaps:
                    ph = wm.placeholder
                    matched = [ph if b is None else b for b in matched]
                    sw.num_front_removed = max(d + 1 for d, b in enumerate(wa.matched) if b is None)
                wm.extend_blocks(sw, matched)
                if matched and matched[-1].node is not None:  # storing resumes after the matched chain
                    sw.store_node, sw.store_depth = matched[-1].node, len(matched)
                if wa.partial is not None:
                    blk, n = wa.partial
                    prio, dur = seq.block_priority(len(matched), tpb)
                    if in_place.get(blk) == i:
                        wm.drop_cached(blk, evicted=False)
                        if prio is not None:  # else the block keeps its own, as a full match does
                            blk.priority = prio
                        blk.duration = dur
                        blk.ref_count += 1
                        if blk.level:
                            wm.onboard(blk)
                    else:  # the copy inherits the source's retention unless the request states one
                        blk = wm.copy_prefix(blk, n, blk.priority if prio is None else prio, blk.duration if prio is None else dur)
                        blk.ref_count += 1
                    c.reused_partial += 1
                    wm.extend_blocks(sw, [blk])
                after = (c.reused_full + c.reused_partial, c.missed, c.alloc_total, c.alloc_new)
                for k in range(4):
                    adm.deltas[k] += after[k] - before[k]
            for blk in held:  # copy sources nobody claimed: free again (the copies come first)
                if blk.ref_count == 0 and blk.free_level < 0:
                    policy.release(blk)
            for adm in admissions:  # phase B: fresh blocks
                seq = adm.seq
                wa = adm.windows[widx]
                sw = seq.windows[widx]
                before = (c.reused_full + c.reused_partial, c.missed, c.alloc_total, c.alloc_new)
                first, stop = wa.num_matched_positions, wa.num_shared
                if stop > first:
                    retention = None if seq.retention is None else [seq.block_priority(d, tpb) for d in range(first, stop)]
                    wm.extend_blocks(sw, wm.take_fresh(stop - first, retention))
                if reuse:
                    c.missed += wa.num_shared - wa.num_matched_positions + wa.num_per_beam
                if wa.num_per_beam:
                    prio, dur = seq.block_priority(wa.num_shared, tpb)
                    for b in range(seq.beam_width):
                        blk = wm.get_free_block(prio, dur)
                        blk.ref_count += 1
                        wm.extend_blocks(sw, [blk], beam=b)
                after = (c.reused_full + c.reused_partial, c.missed, c.alloc_total, c.alloc_new)
                for k in range(4):
                    adm.deltas[k] += after[k] - before[k]
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
                sw.beams[0].append(blk)
                sw.slots[0].append(blk.slot)
            else:
                for b in range(per_token):
                    blk = wm.get_free_block(prio, dur)
                    blk.ref_count += 1
                    wm.extend_blocks(sw, [blk], beam=b)
            wm.counters.gen_alloc += per_token

    @staticmethod
    def oldest_query(seq: Sequence) -> int:
        """The oldest position the next forward may compute (so may query): the context
        position during a chunked prefill, else the newest token less the request's draft
        tokens (unverified drafts are computed by the next verify forward too)."""
        if seq.context_position < seq.prompt_len:
            return seq.context_position
        return seq.num_tokens - 1 - seq.num_draft_tokens

    def released_blocks_visible(self, seq: Sequence, query: int) -> list[int]:
        """Windows in which a query at `query` would see a block already released."""
        tpb = self.tokens_per_block
        out = []
        for wm in self.windows:
            nfr = seq.windows[wm.index].num_front_removed
            if nfr and nfr * tpb > query - wm.window + 1:
                out.append(wm.window)
        return out

    def detach_out_of_window(self, seq: Sequence) -> None:
        """Sliding windows: release front blocks that no query of the next forward (the oldest
        one being `oldest_query`) and no later one can see."""
        tpb = self.tokens_per_block
        first_visible = self.oldest_query(seq) + 1  # + 1 - window, per window below
        for wm in self.windows:
            if wm.is_swa:
                sw = seq.windows[wm.index]
                while (sw.num_front_removed + 1) * tpb <= first_visible - wm.window:
                    wm.detach_front_block(sw)

    # ------------------------------------------------------------------ storing
    def store(self, seq: Sequence, num_tokens: int, allow_partial: bool) -> int:
        """Store the blocks covering `num_tokens` tokens in every window (largest window first).
        Returns the number of blocks newly stored."""
        if num_tokens <= 0:
            return 0
        return sum(wm.store(seq, seq.windows[wm.index], num_tokens, allow_partial) for wm in reversed(self.windows))

    def release(self, seq: Sequence) -> None:
        for wm in self.windows:
            wm.release_sequence(seq.windows[wm.index])
