"""Long seeded run of the ledger with a recurrent-state window (a hybrid model's cache) against
a model of what every memory slot holds.

The cache has a full-attention window beside a `RECURRENT_STATES` window (snapshot interval 1,
2 or 3 blocks; tokens per block 1, 2 or 4; tiny pools, with and without a secondary tier; block
reuse on, copy-forward, or off, in place). A driver mixes what an engine does with a hybrid
model: single and batch admission with prefix reuse (scheduler query checked against
admission), chunked prefill with the ledger's chunk ends or arbitrary ones, batched decode
steps, speculative steps (drafts verified in one forward, some rejected with `rewind`),
abandoned steps (a forward whose tokens never materialise), rewinds of generated tokens,
stores, removals, pins and unpins, offload and onboard through eviction, and bad calls.

The model holds, per recurrent slot, a content stamp `(lora, salt, tokens)`: the state after
those tokens, written at each `begin_recurrent_step` to the step's write slot (what the
forward does); per attention slot, one tag per position (tests/ledger/ledger_helpers.py
`SlotModel`). Transfer plans are replayed op by op. Checked:
  * every step reads, from its read slot, exactly the state of its own first `start` tokens
    (or starts at 0 from the zero state), and its write slot is none of: a cached snapshot's
    slot, a slot any live chain holds (its own, unless updating in place with reuse off), a
    pinned block's slot, another request's pending write slot, another row's write slot;
  * every attention position a forward reads holds the request's own KV;
  * after every operation: `verify_integrity()`; block tables show the null slot exactly at
    placeholders and a real block's slot elsewhere (recurrent and attention rows the same
    length); every real block of a chain holds a state of the request's own tokens at its
    position (snapshots exactly at their block boundary); every cached block (either tier)
    holds what its tree path spells; pinned blocks keep what they held; the KV-event stream,
    read as a router reads it, mirrors the tree per window;
  * bad calls and out-of-blocks refusals leave `snapshot()` unchanged.

    python benchmarks/hybrid_longrun.py --ops 200000      # the long run
"""
from __future__ import annotations

import argparse
import pathlib
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "ledger"))

from ledger_helpers import SlotModel, tag  # noqa: E402

from kvjax import (  # noqa: E402
    CacheConfig,
    InvalidRequestError,
    KVCacheError,
    KVCacheManager,
    OutOfBlocksError,
    Request,
    TransferKind,  # noqa: E402
)
from kvjax.config import RECURRENT_STATES  # noqa: E402
from kvjax.ledger import PLACEHOLDER_BLOCK_ID, CreatedData, RemovedData, StoredData, UpdatedData, cache_salt_id  # noqa: E402

R = RECURRENT_STATES


class Violation(AssertionError):
    """The ledger served, kept or reported something wrong."""


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Violation(what)


@dataclass
class Live:
    rid: str
    tokens: list
    prompt_len: int
    drafts: int
    lora: int | None
    salt: str | None
    kv: int  # positions whose KV a forward wrote (and no rewind dropped)
    prefilled: bool = False
    redo: bool = False  # its last forward was lost: the next one recomputes it (no drafts)
    ctx: int = 0  # the context position the ledger was told (during the prompt)

    @property
    def salt_id(self):
        return cache_salt_id(self.salt)


def hybrid_config(tpb: int, interval_blocks: int, secondary: bool, reuse: bool, primary: tuple[int, int]) -> CacheConfig:
    """Two recurrent layers and one full-attention layer; max_seq_len 12 blocks."""
    L = 12 * tpb
    return CacheConfig(
        tokens_per_block=tpb,
        num_layers=3,
        num_kv_heads=1,
        head_dim=8,
        max_seq_len=L,
        attention_windows=(R, L, R),
        recurrent_state_bytes=64,
        snapshot_interval=interval_blocks * tpb,
        primary_blocks={R: primary[0], L: primary[1]},
        secondary_blocks={R: 3, L: 4} if secondary else 0,
        enable_block_reuse=reuse,
        event_buffer_max_size=1_000_000,
    )


def random_config(rng: random.Random) -> CacheConfig:
    tpb = rng.choice([1, 2, 4, 4])
    return hybrid_config(
        tpb,
        rng.choice([1, 2, 3]),
        rng.random() < 0.6,
        rng.random() < 0.8,
        (rng.randrange(6, 14), rng.randrange(14, 30)),
    )


class HybridDriver:
    """One manager and its slot model; every operation takes the `random.Random` it draws from
    (the hypothesis machine passes one hypothesis controls)."""

    def __init__(self, config: CacheConfig, seed: int = 0) -> None:
        self.config = config
        self.m = KVCacheManager(config)
        self.tpb = config.tokens_per_block
        self.L = config.max_seq_len
        self.A = next(w for w in config.windows if w != R)
        self.reuse = config.enable_block_reuse
        self.kv = SlotModel(config)
        self.rpool = config.window_pools[R][0]
        spec = config.pools[self.rpool]
        self.state = {0: [None] * spec.num_slots, 1: [None] * max(spec.secondary_blocks, 0)}
        self.null = {w: config.primary_blocks_for(w) for w in config.windows}
        self.live: dict[str, Live] = {}
        self.pending_write: dict[str, int] = {}  # rid -> write slot of its last begun step
        self.pins: list[dict] = []
        self.pinned: dict = {}  # (window, block id) -> content when pinned
        self.router: dict = {}
        self.next_id = 0
        self.stats: Counter = Counter()
        base = random.Random(seed)
        self.bases = [[base.randrange(5) for _ in range(self.L)] for _ in range(2)]
        self.bases.append(self.bases[0][: 3 * self.tpb] + [base.randrange(5) for _ in range(self.L)])

    # ------------------------------------------------------------------ model
    def stamp(self, lora, salt_id, tokens) -> tuple:
        return ("S", lora, salt_id, tuple(tokens))

    def own(self, info: Live, n: int) -> tuple:
        return self.stamp(info.lora, info.salt_id, info.tokens[:n])

    def transfers(self) -> None:
        for op in self.m.take_transfers():
            kind, pool, src, dst, n = int(op.kind), int(op.pool), int(op.src), int(op.dst), int(op.num_tokens)
            if pool != self.rpool:
                self.kv.apply_op(kind, pool, src, dst, n)
                continue
            self.stats[f"recurrent {TransferKind(kind).name.lower()}"] += 1
            k = TransferKind(kind)
            check(n == self.tpb, f"a recurrent transfer moves part of a state block: {op}")
            if k is TransferKind.OFFLOAD:
                self.state[1][dst] = self.state[0][src]
            elif k is TransferKind.ONBOARD:
                self.state[0][dst] = self.state[1][src]
            else:
                check(src != dst, f"copy onto itself: {op}")
                self.state[0][dst] = self.state[0][src]

    def mark_unwritten(self, info: Live, positions) -> None:
        self.transfers()  # (an offload the new block's allocation planned reads the slot first)
        table = self.m.block_table([info.rid], self.A)[0]
        for i in positions:
            self.kv.write(self.A, int(table[i // self.tpb]), i % self.tpb, ("unwritten", info.rid, i))

    def protected_slots(self, rid_in_place: set) -> dict[int, str]:
        """Slots of the recurrent pool no step may write now: what each holds."""
        m, out = self.m, {}
        for b in m.inspector.cached_block_ids(R):
            blk = m.block(b, R)
            if blk.level == 0:
                out[blk.slot] = f"cached snapshot {b}"
        for (w, b) in self.pinned:
            if w == R:
                out[m.block(b, R).slot] = f"pinned block {b}"
        for rid in self.live:
            chain = [b for b in m.block_ids(rid, R)[0] if b != PLACEHOLDER_BLOCK_ID]
            if rid in rid_in_place and chain:
                chain = chain[:-1]  # reuse off: the live block is updated in place
            for b in chain:
                out[m.block(b, R).slot] = f"block {b} of {rid}'s chain"
        return out

    # ------------------------------------------------------------------ forwards
    def forward(self, rids: list[str], ends: list[int] | None = None) -> list[tuple[int, int]]:
        """Begin one step of each row and run the forward: read checks, writes."""
        m = self.m
        s = m.begin_recurrent_step(rids, ends)
        self.transfers()
        in_place = set(rids) if not self.reuse else set()
        protected = self.protected_slots(in_place)
        out = []
        writes = [int(w) for w in s.write_slots]
        check(len(set(writes)) == len(writes), f"rows {rids} share a write slot: {writes}")
        for i, rid in enumerate(rids):
            info = self.live[rid]
            start, end = int(s.starts[i]), int(s.ends[i])
            read, write = int(s.read_slots[i]), writes[i]
            check(0 <= start < end <= len(info.tokens), f"{rid}: step [{start}, {end}) of {len(info.tokens)} tokens")
            check(start <= info.kv, f"{rid}: a step from {start} but KV exists up to {info.kv} only")
            if s.has_initial_state[i]:
                check(read != self.null[R], f"{rid}: initial state from the null slot")
                held = self.state[0][read]
                check(held == self.own(info, start), f"{rid}: step from {start} reads slot {read} holding {held}")
            else:
                check(start == 0 and read == self.null[R], f"{rid}: no initial state but starts at {start} (slot {read})")
            check(write != self.null[R], f"{rid}: writes the null slot")
            check(write not in protected, f"{rid}: step writes slot {write}: {protected.get(write)}")
            for other, slot in self.pending_write.items():
                check(other == rid or slot != write or other not in self.live, f"{rid} writes {other}'s pending slot {write}")
            if self.reuse:
                check(read != write, f"{rid}: copy-forward step reads and writes slot {read}")
            elif start > 0:  # in place, unless the state it reads is pinned
                pinned = protected.get(read, "").startswith("pinned")
                check((read == write) != pinned, f"{rid}: in-place step reads {read}, writes {write} ({protected.get(read)})")
            # the attention layers: KV of [start, end) written, queries read [0, end)
            table = m.block_table([rid], self.A)[0]
            for j in range(start, end):
                slot = int(table[j // self.tpb])
                self.kv.write(self.A, slot, j % self.tpb, tag(info.lora, info.salt_id, info.tokens, j))
            for j in range(end):
                slot = int(table[j // self.tpb])
                check(slot != self.null[self.A], f"{rid}: attention position {j} reads the null slot")
                got = self.kv.primary[self.kv_pool][slot][j % self.tpb]
                check(got == tag(info.lora, info.salt_id, info.tokens, j), f"{rid}: attention position {j} holds {got}")
            self.state[0][write] = self.own(info, end)
            self.pending_write[rid] = write
            info.kv = max(info.kv, end)
            out.append((start, end))
        self.stats["steps"] += 1
        self.stats["rows"] += len(rids)
        return out

    @property
    def kv_pool(self) -> int:
        return self.config.window_pools[self.A][0]

    def add(self, info: Live, token: int) -> None:
        """Add a token (out of blocks: unchanged, then others make room, as a scheduler would)."""
        while self.unchanged(lambda: self.m.add_token(info.rid, token), OutOfBlocksError):
            self.stats["token out of blocks"] += 1
            self.free_one(info)
        info.tokens.append(token)
        self.mark_unwritten(info, [len(info.tokens) - 1])

    # ------------------------------------------------------------------ operations
    def unchanged(self, fn, errors=(KVCacheError,)) -> bool:
        """Call `fn`; a typed error must leave the ledger as it was. True when it raised."""
        before = self.m.snapshot()
        try:
            fn()
        except errors:
            check(self.m.snapshot() == before, f"a refused call changed the ledger ({fn})")
            return True
        return False

    def admit(self, rng: random.Random) -> None:
        n = rng.choice([1, 1, 1, 2])
        reqs, infos = [], []
        for _ in range(n):
            self.next_id += 1
            rid = f"r{self.next_id}"
            base = rng.choice(self.bases)
            cut = rng.randrange(1, 7 * self.tpb)
            prompt = base[:cut] + [rng.randrange(5) for _ in range(rng.choice([0, 0, 1, 2]))]
            prompt = prompt[: self.L - 4]
            drafts = rng.choice([0, 0, 2, 3]) if self.reuse else 0
            lora = rng.choice([None, None, None, 7])
            salt = rng.choice([None, None, None, "s"])
            reqs.append(Request(rid, prompt, max_new_tokens=self.L - len(prompt), num_draft_tokens=drafts,
                                lora_task_id=lora, cache_salt=salt))
            infos.append(Live(rid, list(prompt), len(prompt), drafts, lora, salt, 0))
        if n == 1:
            need = {w: self.m.needed_blocks_one_step(reqs[0], window=w) for w in self.config.windows}
            fits = all(need[w] <= self.m.num_free_blocks(w) for w in self.config.windows)
            if self.unchanged(lambda: self.m.add_sequence(reqs[0]), OutOfBlocksError):
                check(not fits, f"needed_blocks_one_step said {need} fits, admission ran out")
                self.stats["admission out of blocks"] += 1
                self.make_room(rng)
                return
            pre = [self.m.recurrent_state_position(reqs[0].request_id)]
        else:
            got: list = []
            if self.unchanged(lambda: got.extend(self.m.add_sequences(reqs)), OutOfBlocksError):
                self.stats["admission out of blocks"] += 1
                self.make_room(rng)
                return
            pre = list(got)
        self.transfers()
        for info, p in zip(infos, pre, strict=True):
            check(p % self.tpb == 0 and p < info.prompt_len, f"{info.rid}: prepopulated {p} of {info.prompt_len}")
            state_at = self.m.recurrent_state_position(info.rid)
            check(state_at == p, f"{info.rid}: state at {state_at}, prepopulated {p}")
            self.live[info.rid] = info
            info.kv = info.ctx = p
            self.mark_unwritten(info, range(p, info.prompt_len))
            table = self.m.block_table([info.rid], self.A)[0]
            for j in range(p):
                got_tag = self.kv.primary[self.kv_pool][int(table[j // self.tpb])][j % self.tpb]
                check(got_tag == tag(info.lora, info.salt_id, info.tokens, j), f"{info.rid}: reused position {j} holds {got_tag}")
            self.stats["admissions with reuse"] += p > 0
            self.m.set_context_position(info.rid, p)  # the prompt's KV from here on is still to compute
        self.stats["admissions"] += n

    def make_room(self, rng: random.Random) -> None:
        if self.live:
            rid = rng.choice(sorted(self.live))
            self.m.remove_sequence(rid, store_for_reuse=rng.random() < 0.5)
            self.drop(rid)

    def drop(self, rid: str) -> None:
        del self.live[rid]
        self.pending_write.pop(rid, None)

    def prefill_chunk(self, rng: random.Random) -> None:
        cands = [i for i in self.live.values() if not i.prefilled]
        if not cands:
            return
        info = rng.choice(cands)
        pos = self.m.recurrent_state_position(info.rid)
        ends = None
        if rng.random() < 0.3:
            ends = [rng.randrange(pos + 1, info.prompt_len + 1)]
        try:
            ((start, end),) = self.forward([info.rid], ends)
        except OutOfBlocksError:
            self.stats["step out of blocks"] += 1
            self.make_room(rng)
            return
        # the forward is lost (preempted): its tokens never materialise. Copy-forward only: an
        # in-place step (reuse off) has overwritten the state it read, which nothing can undo
        if self.reuse and rng.random() < 0.1:
            self.stats["abandoned steps"] += 1
            info.kv = max(start, self.materialised(info))
            return
        self.m.set_context_position(info.rid, end)
        info.ctx = end
        if end == info.prompt_len:
            info.prefilled = True
            self.add(info, rng.randrange(5))
        self.stats["prefill chunks"] += 1

    def materialised(self, info: Live) -> int:
        """Positions the ledger was told have KV (what an abandoned forward leaves valid)."""
        return len(info.tokens) - 1 if info.prefilled else info.ctx

    def decode(self, rng: random.Random) -> None:
        rows = [i for i in self.live.values() if i.prefilled and len(i.tokens) + i.drafts + 1 < self.L]
        if not rows:
            return
        rows = rng.sample(rows, min(len(rows), rng.randrange(1, 4)))
        drafted = {}
        for info in rows:
            if info.rid in self.live and self.m.recurrent_state_position(info.rid) == len(info.tokens):
                # a rewind left the state covering every token: the engine samples the next
                # token from the logits it kept, then steps over it
                self.add(info, rng.randrange(5))
                self.stats["resampled after a rewind"] += 1
            d = rng.randrange(info.drafts + 1) if info.drafts and not info.redo else 0
            for _ in range(d if info.rid in self.live else 0):
                self.add(info, rng.randrange(5))
            drafted[info.rid] = d
        rows = [i for i in rows if i.rid in self.live]  # (a row removed to make room for another's draft)
        if not rows:
            return
        try:
            self.forward([i.rid for i in rows])
        except OutOfBlocksError:
            self.stats["step out of blocks"] += 1
            for info in rows:  # drop the drafts again (the step never ran)
                if drafted[info.rid] and info.rid in self.live:
                    self.rewind_tokens(info, drafted[info.rid])
            self.make_room(rng)
            return
        if self.reuse and rng.random() < 0.05:
            self.stats["abandoned steps"] += 1
            for info in rows:
                if drafted[info.rid]:
                    self.rewind_tokens(info, drafted[info.rid])
                info.kv = min(info.kv, len(info.tokens) - 1)
                info.redo = True
            return
        for info in rows:
            info.redo = False
            if info.rid not in self.live:  # (a row removed to make room for another's token)
                continue
            d = drafted[info.rid]
            rejected = rng.randrange(d + 1) if d else 0
            if rejected:
                # refused (typed, unchanged) only if the state already covers what would be
                # left; counted, never seen so far
                if self.unchanged(lambda i=info, k=rejected: self.rewind_tokens(i, k), InvalidRequestError):
                    self.stats["draft rejections refused"] += 1
                else:
                    self.stats["drafts rejected"] += 1
        tokens = [rng.randrange(5) for _ in rows]
        rows_left = [i for i in rows if i.rid in self.live]
        tokens = tokens[: len(rows_left)]
        rows = rows_left
        if rng.random() < 0.5:
            for info, t in zip(rows, tokens, strict=True):
                if info.rid in self.live:
                    self.add(info, t)
        elif self.unchanged(lambda: self.m.add_tokens([i.rid for i in rows], tokens), OutOfBlocksError):
            self.stats["batched tokens out of blocks"] += 1
            for info, t in zip(rows, tokens, strict=True):
                if info.rid in self.live:
                    self.add(info, t)
        else:
            for info, t in zip(rows, tokens, strict=True):
                info.tokens.append(t)
                self.mark_unwritten(info, [len(info.tokens) - 1])
        if rng.random() < 0.3:
            self.m.store_new_blocks([i.rid for i in rows if i.rid in self.live])
            self.transfers()

    def free_one(self, info: Live) -> None:
        """Make room for `info`: remove another request, else drop a pin."""
        others = sorted(r for r in self.live if r != info.rid)
        if others:
            rid = others[0]
            self.m.remove_sequence(rid, store_for_reuse=False)
            self.drop(rid)
        elif self.pins:
            self.m.unpin_blocks(self.pins.pop())
        else:
            raise Violation(f"{info.rid}: alone in the cache and out of blocks")

    def rewind_tokens(self, info: Live, n: int) -> None:
        """Drop the last `n` tokens (out of blocks for a shared block's copy: unchanged, then
        others make room, as for a token)."""
        while self.unchanged(lambda: self.m.rewind(info.rid, n), OutOfBlocksError):
            self.stats["rewind out of blocks"] += 1
            self.free_one(info)
        del info.tokens[-n:]
        info.kv = min(info.kv, len(info.tokens))

    def rewind(self, rng: random.Random) -> None:
        cands = [i for i in self.live.values() if i.prefilled and len(i.tokens) > i.prompt_len + 1]
        if not cands:
            return
        info = rng.choice(cands)
        n = rng.randrange(1, len(info.tokens) - info.prompt_len)
        new_n = len(info.tokens) - n
        pos = self.m.recurrent_state_position(info.rid)
        before = self.m.snapshot()
        try:
            self.m.rewind(info.rid, n)
        except (InvalidRequestError, OutOfBlocksError) as e:
            check(self.m.snapshot() == before, "a refused rewind changed the ledger")
            oob = isinstance(e, OutOfBlocksError)
            check(oob or new_n <= pos or not self.reuse, f"{info.rid}: rewind to {new_n} refused with the state at {pos}")
            self.stats["rewinds out of blocks" if oob else "rewinds refused"] += 1
            return
        del info.tokens[new_n:]
        info.kv = min(info.kv, new_n)
        self.stats["rewinds"] += 1

    def store(self, rng: random.Random) -> None:
        cands = [i for i in self.live.values() if i.prefilled]
        if not cands:
            return
        info = rng.choice(cands)
        r = rng.random()
        if r < 0.4:
            self.m.store_new_block(info.rid)
        elif r < 0.6:
            self.m.store_context_blocks(info.rid)
        else:
            pin = rng.random() < 0.4
            ids = self.m.store_blocks_for_reuse(info.rid, pin=pin)
            if pin:
                self.record_pins(ids, info)
        self.transfers()

    def record_pins(self, ids: dict, info: Live) -> None:
        """Hold pinned blocks to what they hold now: a state, or the KV positions written."""
        self.pins.append(ids)
        rows = {w: self.m.block_ids(info.rid, w)[0] for w in ids}
        for w, blocks in ids.items():
            for b in blocks:
                blk = self.m.block(b, w)
                content = self.read(w, blk.level, blk.slot)
                if w != R and b in rows[w]:  # positions not written yet may still fill in
                    k = rows[w].index(b)
                    content = [v if k * self.tpb + j < info.kv else None for j, v in enumerate(content)]
                self.pinned.setdefault((w, b), content)
        self.stats["pins"] += 1

    def read(self, w: int, level: int, slot: int):
        if w == R:
            return self.state[level][slot]
        return list(self.kv.read(w, level, slot))

    def unpin(self, rng: random.Random) -> None:
        if not self.pins:
            return
        ids = self.pins.pop(rng.randrange(len(self.pins)))
        self.m.unpin_blocks(ids)
        for w, blocks in ids.items():
            for b in blocks:
                if self.m.block(b, w).pin_count == 0:
                    self.pinned.pop((w, b), None)

    def remove(self, rng: random.Random) -> None:
        if not self.live:
            return
        rid = rng.choice(sorted(self.live))
        store = rng.random() < 0.8
        if store and rng.random() < 0.2 and self.live[rid].prefilled:
            self.record_pins(self.m.store_blocks_for_reuse(rid, pin=True), self.live[rid])
        self.m.remove_sequence(rid, store_for_reuse=store)
        self.drop(rid)
        self.transfers()

    def bad_call(self, rng: random.Random) -> None:
        m = self.m
        calls = [lambda: m.begin_recurrent_step(["nobody"])]
        if self.live:
            info = rng.choice(list(self.live.values()))
            rid, n = info.rid, len(info.tokens)
            pos = m.recurrent_state_position(rid)
            calls += [
                lambda: m.begin_recurrent_step([rid], [pos]),
                lambda: m.begin_recurrent_step([rid], [n + 1]),
                lambda: m.begin_recurrent_step([rid, rid]),
                lambda: m.begin_recurrent_step([rid], [n, n]),
                lambda: m.begin_recurrent_step([rid, "nobody"]),
                lambda: m.begin_recurrent_step([rid], [True]),
            ]
        check(self.unchanged(rng.choice(calls)), "a bad call was accepted")
        self.stats["bad calls"] += 1

    OPS = (("admit", 14), ("prefill_chunk", 22), ("decode", 30), ("rewind", 5), ("store", 8), ("remove", 9),
           ("unpin", 4), ("bad_call", 4))

    def random_op(self, rng: random.Random) -> None:
        name = rng.choices([o for o, _ in self.OPS], [w for _, w in self.OPS])[0]
        if name == "admit" and len(self.live) >= 6:
            name = "remove"
        getattr(self, name)(rng)

    # ------------------------------------------------------------------ invariants
    def check_all(self) -> None:
        m = self.m
        self.transfers()
        m.verify_integrity()
        rids = sorted(self.live)
        tables = {w: m.block_table(rids, w) for w in self.config.windows}
        for r, rid in enumerate(rids):
            info = self.live[rid]
            ids = {w: m.block_ids(rid, w)[0] for w in self.config.windows}
            check(len(ids[R]) == len(ids[self.A]) == -(-len(info.tokens) // self.tpb),
                  f"{rid}: chain {len(ids[R])}, attention {len(ids[self.A])} blocks for {len(info.tokens)} tokens")
            for w in self.config.windows:
                for k, b in enumerate(ids[w]):
                    slot = int(tables[w][r, k])
                    if b == PLACEHOLDER_BLOCK_ID:
                        check(slot == self.null[w], f"{rid}: placeholder at {k} (window {w}) shown as slot {slot}")
                    else:
                        blk = m.block(b, w)
                        check(blk.level == 0 and slot == blk.slot, f"{rid}: block {b} at {k} (window {w}) shown as {slot}")
                check(bool((tables[w][r, len(ids[w]):] == self.null[w]).all()), f"{rid}: table padding not null")
            real = [(k, b) for k, b in enumerate(ids[R]) if b != PLACEHOLDER_BLOCK_ID]
            for j, (k, b) in enumerate(real):
                held = self.state[0][m.block(b, R).slot]
                check(held is not None and held[:3] == ("S", info.lora, info.salt_id), f"{rid}: chain block {b} holds {held}")
                toks = held[3]
                # in place (reuse off), a step that materialised but is not settled yet has
                # already updated the live block at its old position
                at = (len(toks) - 1) // self.tpb == k or (
                    not self.reuse and j == len(real) - 1 and len(toks) == m.recurrent_state_position(rid)
                )
                check(list(toks) == info.tokens[: len(toks)] and len(toks) > 0 and at,
                      f"{rid}: chain block {b} at {k} holds the state of {toks}")
                if j < len(real) - 1:
                    check(len(toks) == (k + 1) * self.tpb, f"{rid}: snapshot {b} at {k} holds a state after {len(toks)}")
            for j in range(info.kv):
                got = self.kv.primary[self.kv_pool][int(tables[self.A][r, j // self.tpb])][j % self.tpb]
                check(got == tag(info.lora, info.salt_id, info.tokens, j), f"{rid}: attention position {j} holds {got}")
        inspector = m.inspector
        for w in self.config.windows:
            for b in inspector.cached_block_ids(w):
                blk = m.block(b, w)
                keys = inspector.cached_path(b, w)
                toks = [t for key in keys for t in key.tokens]
                key = keys[-1]
                content = self.read(w, blk.level, blk.slot)
                if w == R:
                    want = self.stamp(key.lora_task_id, key.cache_salt_id, toks)
                    check(content == want, f"cached snapshot {b} (level {blk.level}) holds {content}, not {want}")
                else:
                    off = len(toks) - len(key.tokens)
                    for j in range(len(key.tokens)):
                        want = tag(key.lora_task_id, key.cache_salt_id, toks, off + j)
                        check(content[j] == want, f"cached block {b} position {j} holds {content[j]}")
        for (w, b), was in list(self.pinned.items()):
            blk = m.block(b, w)
            if blk.pin_count == 0:
                del self.pinned[(w, b)]
                continue
            now = self.read(w, blk.level, blk.slot)
            if w == R:
                check(now == was, f"pinned state {b} now holds {now}, held {was}")
            else:
                for j, v in enumerate(was):
                    check(v is None or now[j] == v,
                          f"pinned block {b} position {j}: {now[j]} != {v}")
        self.check_events()

    def check_events(self) -> None:
        self.m.flush_iteration_events()
        for e in self.m.get_latest_events():
            d, view = e.data, self.router.setdefault(e.window_size, {})
            if isinstance(d, CreatedData):
                check(view == {}, "Created after blocks were stored")
            elif isinstance(d, StoredData):
                for b in d.blocks:
                    check(b.block_hash not in view, f"window {e.window_size}: Stored twice without Removed: {b}")
                    view[b.block_hash] = b.cache_level
            elif isinstance(d, RemovedData):
                for h in d.block_hashes:
                    check(h in view, f"window {e.window_size}: Removed a hash never stored: {h}")
                    del view[h]
            elif isinstance(d, UpdatedData) and d.cache_level is not None:
                old, new = d.cache_level
                check(view.get(d.block_hash) == old, f"Updated {d} but the mirror has {view.get(d.block_hash)}")
                view[d.block_hash] = new
        inspector = self.m.inspector
        for w in self.config.windows:
            truth = {inspector.block_hash(b, w): self.m.block(b, w).level for b in inspector.cached_block_ids(w)}
            check(self.router.get(w, {}) == truth, f"window {w}: the event mirror differs from the tree")


def run(total_ops: int, seed: int, check_every: int = 1, episode_ops: int = 2000) -> tuple[Counter, Counter, list]:
    """Episodes of `episode_ops` operations on fresh random configurations; returns
    (violations by kind, operation stats, examples)."""
    rng = random.Random(seed)
    violations: Counter = Counter()
    stats: Counter = Counter()
    examples: list = []
    ops = 0
    while ops < total_ops:
        ep_seed = rng.randrange(2**32)
        ops += run_episode(ep_seed, min(episode_ops, total_ops - ops), check_every, violations, stats, examples)
    return violations, stats, examples


def run_episode(ep_seed: int, n_ops: int, check_every: int, violations: Counter, stats: Counter, examples: list) -> int:
    """One manager on a configuration drawn from `ep_seed` (rerun one with --episode SEED);
    returns the operations it made. A violation is counted (by kind) and ends the episode."""
    rng = random.Random(ep_seed)
    config = random_config(rng)
    d = HybridDriver(config, rng.randrange(2**32))
    name = (f"episode {ep_seed}: tpb {config.tokens_per_block}, interval {config.snapshot_interval}, "
            f"reuse {config.enable_block_reuse}")
    ops = 0
    try:
        for i in range(n_ops):
            d.random_op(rng)
            ops += 1
            if i % check_every == 0:
                d.check_all()
        d.check_all()
    except (Violation, KVCacheError, AssertionError) as v:
        what = re.sub(r"\b(r?\d+)\b", "#", str(v))[:70] if isinstance(v, Violation) else f"unexpected {type(v).__name__}"
        violations[what] += 1
        if len(examples) < 10:
            examples.append(f"{name}, op {ops}: {type(v).__name__}: {v}")
        ops = max(ops, 1)
    stats.update(d.stats)
    stats["episodes"] += 1
    return ops


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=200_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-every", type=int, default=1, help="run the full invariant check every N operations")
    p.add_argument("--episode", type=int, help="rerun one episode (its seed, as a violation names it) for --ops operations")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    if a.episode is not None:
        violations, stats, examples = Counter(), Counter(), []
        run_episode(a.episode, a.ops, a.check_every, violations, stats, examples)
    else:
        violations, stats, examples = run(a.ops, a.seed, a.check_every)
    wall = time.perf_counter() - t0
    print(f"operations: {a.ops:,} in {stats['episodes']} episodes, {wall:.1f} s ({a.ops / wall:,.0f} ops/s)")
    print("exercised: " + ", ".join(f"{k} {v:,}" for k, v in sorted(stats.items()) if k != "episodes"))
    print(f"violations: {sum(violations.values())}")
    for kind, n in sorted(violations.items()):
        print(f"  {n:>6}  {kind}")
    for ex in examples[:5]:
        print(f"  e.g. {ex}")
    return dict(ops=a.ops, violations=dict(violations), stats=dict(stats), wall_s=wall)


if __name__ == "__main__":
    main()
