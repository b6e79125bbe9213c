"""Long adversarial run of the ledger against a model of what every memory slot holds.

A seeded driver mixes every ledger operation the way engines use them: single and batch
admission with full and partial reuse, chunked prefill, decode steps (one `add_token` per row,
or one atomic `add_tokens` for the step, often the previous step's rows again), draft tokens verified
in one forward and rejected with `rewind`, beams, retention priorities and durations on a
fake clock, offload and onboard through small secondary tiers, sliding and variable windows,
pins and unpins, removals with and without storing, scheduling dry runs and queries, failed
transfers (whole plans or some ops, reported late enough that later ops read what they lost)
and bad calls that must raise a typed error and change nothing. Configurations rotate per
episode (full attention, one sliding window, a full plus a sliding window, a full plus a
sliding window narrower than a block, two pools per window, no secondary tier, reuse off, no
onboarding, tokens per block 1, 2, 4 or 8, beams) on pools of 8
to 24 blocks, and one busy cache (up to 96 live requests on 640 blocks); now and then the prefix
cache is reset.

The model (tests/ledger/ledger_helpers.py `SlotModel`) holds one tag per token position of
every primary and secondary slot; every transfer plan is replayed op by op (failed ops leave
garbage) and every forward writes its positions' tags through the block table. A position's
tag hashes every token up to it plus the request's isolation keys, so KV of any other prompt
never passes for it. A decode step runs in an engine's order: the forward computes each row's
newest token, a token is sampled and added, blocks are stored (a batched step's half the time
with the step's own id list, as the engine stores, so `store_new_blocks` takes its store-hint
pre-check); the token just added has no KV
until the next step's forward (its position holds an "unwritten" marker meanwhile, so a store
that covered it would put the marker in the tree). Checked:
  * after each admission, every prepopulated position the first new query reads holds the
    request's own tags;
  * after each forward, every position any of its queries reads (per window: from the first
    query's window start to the last query) is a real block (no null slot) holding own tags;
  * every few hundred operations: `verify_integrity()`, every cached block holds the tags its
    tree path spells, pinned blocks kept their content, every live position holds own tags;
  * bad calls raise a `KVCacheError` and leave `snapshot()` unchanged; so do out-of-blocks
    (a batched decode step that runs out changes nothing, then goes row by row).

    python benchmarks/ledger_longrun.py --ops 1000000           # the issue's proof
    python benchmarks/ledger_longrun.py --ops 20000 --memory    # + tracemalloc flatness

Every feature mix is exercised: sliding windows with drafts and rewinds (a verify forward
computes at most `num_draft_tokens + 1` positions, as an engine's does; rejecting this step's
drafts must never be refused), pins with rewind, scheduler queries that must agree with
admission, one token for every beam.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import pathlib
import random
import sys
import time
import tracemalloc
from collections import Counter

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "ledger"))

from ledger_helpers import SlotModel  # noqa: E402  (the slot model shared with the tests)

from kvjax import (  # noqa: E402
    CacheConfig,
    KVCacheError,
    KVCacheManager,
    MultimodalItem,
    OutOfBlocksError,
    Request,
    RetentionConfig,
    TokenRangeRetention,
)
from kvjax.kv_events import MEDIUM_CPU, MEDIUM_GPU, LedgerEventAdapter, decode_batch, encode_batch  # noqa: E402
from kvjax.ledger import PLACEHOLDER_BLOCK_ID, cache_salt_id  # noqa: E402
from kvjax.router import PrefixIndex  # noqa: E402


class Violation(Exception):
    """The ledger served, kept or reported something wrong (counted, then the episode ends)."""


def seq_seed(lora, salt_id) -> int:
    return hash(("kv", lora, salt_id))


def next_tag(prev: int, token: int, extra, mm: tuple | None = None) -> int:
    """Tag of a position: the previous position's tag, this token, its extra id and, inside a
    multimodal item, (the item's hash, the position's offset in the item)."""
    return hash((prev, token, extra)) if mm is None else hash((prev, token, extra, mm))


IMAGE_TOKEN = 9  # the placeholder id at a multimodal item's positions (text tokens are 0..5)
IMAGES = (b"image-a", b"image-b")  # two item hashes: equal tokens with another image must not share KV


@dataclasses.dataclass
class Live:
    rid: int
    beams: list  # token list per beam (beam 0 is what keys are built from)
    tags: list  # tag per position, per beam
    lora: int | None
    salt: str | None
    extra: list | None
    prompt_len: int
    computed: int  # positions whose KV has been written (the same for every beam)
    pinned: bool = False
    drafts: int = 0  # the request's num_draft_tokens
    mm: tuple | None = None  # (hash, start, length) of its multimodal item


    @property
    def n(self) -> int:
        return len(self.beams[0])

    def append(self, b: int, token: int, extra) -> None:
        prev = self.tags[b][-1] if self.tags[b] else seq_seed(self.lora, cache_salt_id(self.salt))
        j = len(self.beams[b])
        mm = None
        if self.mm is not None and self.mm[1] <= j < self.mm[1] + self.mm[2]:
            mm = (self.mm[0], j - self.mm[1])
        self.beams[b].append(token)
        self.tags[b].append(next_tag(prev, token, extra, mm))


@dataclasses.dataclass
class Family:
    name: str
    config: dict
    beams: bool = False
    max_live: int = 5  # live requests at most (admission stops there)
    admit_sizes: tuple[int, ...] = (1, 1, 1, 2, 3)  # requests per admission, drawn
    remove_share: float = 1.0  # of the draws that would remove a request
    decode_rows: int = 4  # rows of a decode step at most

    @property
    def swa(self) -> bool:
        w = self.config.get("attention_windows")
        return w is not None and min(w) < self.config["max_seq_len"]


def families(tpb: int) -> list[Family]:
    L = 16 * tpb
    base = dict(tokens_per_block=tpb, num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=L, event_buffer_max_size=4096)
    return [
        Family("full", {**base, "primary_blocks": 14, "secondary_blocks": 4}),
        # no secondary tier (the default): victims are evicted, claimed in batches
        Family("no-secondary", {**base, "primary_blocks": 12, "secondary_blocks": 0}),
        Family("full-beams", {**base, "primary_blocks": 16, "secondary_blocks": 2, "max_beam_width": 2}, beams=True),
        Family("tight-offload", {**base, "primary_blocks": 9, "secondary_blocks": 6}),
        Family(  # and TensorRT-LLM's 64-bit event hashes
            "two-pools",
            {
                **base, "num_layers": 2, "num_kv_heads": (1, 2), "primary_blocks": 12, "secondary_blocks": 3,
                "event_hash": "trtllm64",
            },
        ),
        Family("no-copy", {**base, "primary_blocks": 12, "secondary_blocks": 2, "copy_on_partial_reuse": False}),
        Family("no-reuse", {**base, "primary_blocks": 10, "secondary_blocks": 2, "enable_block_reuse": False}),
        Family(  # matched blocks in the secondary tier are not onboarded; no partial matches
            "no-onboard",
            {**base, "primary_blocks": 12, "secondary_blocks": 4, "onboard_blocks": False, "enable_partial_reuse": False},
        ),
        Family(
            "low-offload-priority", {**base, "primary_blocks": 12, "secondary_blocks": 4, "secondary_offload_min_priority": 50}
        ),
        Family("swa", {**base, "primary_blocks": 14, "secondary_blocks": 3, "attention_windows": (2 * tpb + 1,)}),
        Family(
            "vswa",
            {
                **base,
                "num_layers": 2,
                "attention_windows": (L, 3 * tpb - 1),
                "primary_blocks": {L: 16, 3 * tpb - 1: 12},
                "secondary_blocks": 2,
            },
        ),
        # a sliding window narrower than a block (one token wide with one token per block): a
        # block leaves it a few tokens after it fills, often before it is stored
        Family(
            "narrow-vswa",
            {
                **base,
                "num_layers": 2,
                "attention_windows": (L, max(1, tpb - 1)),
                "primary_blocks": {L: 16, max(1, tpb - 1): 10},
                "secondary_blocks": 2,
            },
        ),
        # a busy cache: up to 96 live requests of up to 40 blocks, decode steps of up to 96
        # rows (past `add_tokens`' row-by-row threshold of 64), so the slot table's rows and
        # width double several times and the tree grows wide (many siblings per node, partial
        # matching among them)
        Family(
            "many",
            {**base, "max_seq_len": 40 * tpb, "primary_blocks": 640, "secondary_blocks": 32},
            max_live=96,
            admit_sizes=(1, 2, 4, 8),
            remove_share=0.25,
            decode_rows=96,
        ),
    ]


class Episode:
    """One manager, one configuration, a few thousand operations."""

    def __init__(self, run: LongRun, family: Family, seed: int, long_retention: bool = False) -> None:
        self.run = run
        self.long_retention = long_retention  # every request retained for an hour (memory run)
        self.rng = random.Random(seed)
        self.family = family
        self.config = CacheConfig(**family.config)
        self.clock_t = 1000.0
        self.m = KVCacheManager(self.config, clock=lambda: self.clock_t)
        self.model = SlotModel(self.config)
        # the KV-event stream as a router sees it: ledger events -> wire batches (msgpack and
        # back) -> a prefix index, which must hold exactly the full blocks the tree caches
        self.adapter = LedgerEventAdapter(self.config)
        self.index = PrefixIndex()
        self.tpb = self.config.tokens_per_block
        self.L = self.config.max_seq_len
        self.multi = len(self.config.windows) > 1
        self.null = {w: self.config.primary_blocks_for(w) for w in self.config.windows}
        self.live: dict[int, Live] = {}
        self.pins: list = []  # block-id lists (or dicts) to unpin
        self.pinned_content: dict = {}  # (window, block id) -> content when pinned
        self.next_id = 0
        self.last_batch: list[Live] = []  # the rows of the last decode step
        vocab = 6
        self.bases = [[self.rng.randrange(vocab) for _ in range(self.L)] for _ in range(3)]
        self.bases.append(self.bases[0][: 3 * self.tpb] + [self.rng.randrange(vocab) for _ in range(self.L)])

    # ------------------------------------------------------------------ counting calls
    def call(self, name: str, *args, **kwargs):
        self.run.ops += 1
        return getattr(self.m, name)(*args, **kwargs)

    def win(self, w):
        return w if self.multi else None

    # ------------------------------------------------------------------ transfers
    def step(self, extra_calls=None) -> None:
        """Take the plan the calls so far decided, maybe fail some of it, replay it; then
        recompute what failures cut back (after every plan is applied, as an engine would:
        the plans taken after a report may still read what was lost)."""
        results: list = []
        self._step(extra_calls, results)
        for result in results:
            self.recover(result)

    def _step(self, extra_calls, results: list) -> None:
        plan = self.call("take_transfers")
        ops = [tuple(op) for op in plan]
        failed: set[int] = set()
        if ops and self.rng.random() < self.run.fail_rate:
            failed = (
                set(range(len(ops)))
                if self.rng.random() < 0.4
                else set(self.rng.sample(range(len(ops)), self.rng.randrange(1, len(ops) + 1)))
            )
            self.run.failures += 1
            if extra_calls is not None:  # more ledger calls before the report: their ops read what was lost
                extra_calls()
            result = self.call("transfers_failed", plan, None if len(failed) == len(ops) else sorted(failed))
            for i, op in enumerate(ops):
                if i in failed:
                    self.model.lose(op[0], op[1], op[3], op[4])
                else:
                    self.model.apply_op(*op)
            results.append(result)
            self._step(None, results)  # what the extra calls decided since
            return
        if ops and self.rng.random() < 0.5:
            self.call("transfers_applied", plan)
        for op in ops:
            self.model.apply_op(*op)
        if extra_calls is not None:
            extra_calls()
            self._step(None, results)

    def recover(self, result) -> None:
        """What an engine does with `transfers_failed`'s answer."""
        for w, ids in result.lost_pinned_blocks.items():
            for bid in ids:
                self.pinned_content.pop((w, bid), None)  # reported lost: no longer held to it
        for rid, valid in result.recompute_from.items():
            info = self.live.get(rid)
            if info is None:  # readmitted after an earlier failure of the same step
                continue
            if valid >= info.computed:
                raise Violation(f"request {rid}: recompute_from {valid} but only {info.computed} positions were computed")
            if rid in result.readmit:
                self.call("remove_sequence", rid, store_for_reuse=self.rng.random() < 0.5)
                del self.live[rid]
                continue
            self.run.recomputed += info.computed - valid
            self.write(info, range(valid, info.computed))
            self.call("set_context_position", rid, info.computed)

    # ------------------------------------------------------------------ forwards and checks
    def tables(self, info: Live) -> dict:
        """The request's block table per window; one too short for its tokens is a violation
        (a token was taken in without the block it starts)."""
        out = {w: self.call("block_table", [info.rid], self.win(w)) for w in self.config.windows}
        need = -(-info.n // self.tpb)
        for w, table in out.items():
            if table.shape != (len(info.beams), max(table.shape[1], need)):
                raise Violation(
                    f"request {info.rid}: window {w} block table {table.shape} for {len(info.beams)} beams of {info.n} tokens"
                )
        return out

    def write(self, info: Live, positions) -> None:
        tpb = self.tpb
        positions = list(positions)
        for w, table in self.tables(info).items():
            for b in range(len(info.beams)):
                for i in positions:
                    slot = int(table[b, i // tpb])
                    if slot == self.null[w]:
                        raise Violation(f"request {info.rid}: window {w} position {i} has no block to write into")
                    self.model.write(w, slot, i % tpb, info.tags[b][i])

    def check_reads(self, info: Live, first_q: int, last_q: int, what: str) -> None:
        """Every position queries first_q..last_q read, in every window, holds own tags."""
        tpb = self.tpb
        for w, table in self.tables(info).items():
            lo = max(0, first_q - w + 1)
            pools = self.config.window_pools[w]
            for b in range(len(info.beams)):
                for i in range(lo, last_q + 1):
                    slot = int(table[b, i // tpb])
                    if slot == self.null[w]:
                        raise Violation(
                            f"{what}: request {info.rid} window {w} beam {b}: position {i} is a placeholder "
                            f"inside query {first_q}'s window"
                        )
                    got = self.model.primary[pools[0]][slot][i % tpb]
                    if got != info.tags[b][i] or any(self.model.primary[p][slot][i % tpb] != got for p in pools[1:]):
                        raise Violation(f"{what}: request {info.rid} window {w} beam {b} position {i} holds {got!r}")

    def unwritten(self, info: Live) -> None:
        """The newest position has no KV yet (the next forward computes it): mark its slots."""
        i = info.n - 1
        for w, table in self.tables(info).items():
            for b in range(len(info.beams)):
                self.model.write(w, int(table[b, i // self.tpb]), i % self.tpb, ("unwritten", info.rid, b, i))

    def forward(self, info: Live, start: int, stop: int, what: str) -> None:
        """Compute positions [start, stop): write them, then check what their queries read."""
        if stop <= start:
            return
        self.write(info, range(start, stop))
        info.computed = max(info.computed, stop)
        self.check_reads(info, start, stop - 1, what)

    def held(self, w: int, level: int, slot: int, n: int) -> list:
        """The first `n` positions of a slot; every pool of the window must agree on them (the
        rest may differ: a failed op of one pool leaves garbage there)."""
        store = self.model.primary if level == 0 else self.model.secondary
        pools = self.config.window_pools[w]
        content = store[pools[0]][slot][:n]
        for p in pools[1:]:
            if store[p][slot][:n] != content:
                raise Violation(f"pools {pools[0]} and {p} of window {w} disagree at slot {slot}")
        return content

    def drain_events(self) -> None:
        """Publish the iteration's events and feed them through the wire to the index."""
        self.call("flush_iteration_events")
        batch = self.adapter.convert(self.call("get_latest_events"))
        if batch is not None:
            self.index.apply("r", decode_batch(encode_batch(batch)))

    def check_event_mirror(self) -> None:
        """The index rebuilt from the event stream holds exactly the full blocks the tree
        caches, per window and tier, with their hashes (the events' own bookkeeping may not
        stand in for the tree: the tree is walked)."""
        self.drain_events()
        if self.adapter.ledger_gaps:  # the bounded event buffer dropped some: nothing to compare
            self.run.mirror_skipped += 1
            return
        self.run.mirror_checks += 1
        m, tpb = self.m, self.tpb
        inspector = m.inspector
        for g, w in enumerate(self.config.windows):
            for level, medium in enumerate((MEDIUM_GPU, MEDIUM_CPU)):
                want = set()
                for bid in inspector.cached_block_ids(self.win(w)):
                    blk = m.block(bid, self.win(w))
                    if blk.level == level and blk.key.num_tokens == tpb:
                        want.add(inspector.block_hash(bid, self.win(w)))
                got = self.index.blocks("r", medium, group=g)
                if got != want:
                    raise Violation(
                        f"events: window {w} {medium}: the event stream announces {len(got - want)} blocks the tree "
                        f"does not cache and misses {len(want - got)} it does"
                    )

    def deep_check(self) -> None:
        m = self.m
        self.call("verify_integrity")
        self.check_event_mirror()
        tpb = self.tpb
        for info in self.live.values():
            for w in self.config.windows:
                ids = self.call("block_ids", info.rid, self.win(w))
                for b, row in enumerate(ids):
                    for i in range(info.computed):
                        bid = row[i // tpb]
                        if bid == PLACEHOLDER_BLOCK_ID:
                            continue
                        blk = m.block(bid, self.win(w))
                        got = self.held(w, blk.level, blk.slot, i % tpb + 1)[i % tpb]
                        if got != info.tags[b][i]:
                            raise Violation(f"deep: request {info.rid} window {w} position {i} holds {got!r}")
        inspector = m.inspector
        for w in self.config.windows:
            for bid in inspector.cached_block_ids(self.win(w)):
                blk = m.block(bid, self.win(w))
                keys = inspector.cached_path(bid, self.win(w))
                tag = seq_seed(keys[0].lora_task_id, keys[0].cache_salt_id)
                want = []
                for i, key in enumerate(keys):
                    item = key.mm_keys[0] if key.mm_keys else None  # a request has one item at most
                    k = 0
                    for j, t in enumerate(key.tokens):
                        mm = None
                        if item is not None and t == IMAGE_TOKEN:  # the item's positions, in order
                            mm = (item.hash, item.start_offset + k)
                            k += 1
                        tag = next_tag(tag, t, None if key.extra_ids is None else key.extra_ids[j], mm)
                        if i == len(keys) - 1:
                            want.append(tag)
                if self.held(w, blk.level, blk.slot, len(want)) != want:
                    raise Violation(f"deep: cached block {bid} (window {w}) does not hold its tree path")
        for (w, bid), want in list(self.pinned_content.items()):
            blk = m.block(bid, self.win(w))
            if blk.pin_count == 0:
                del self.pinned_content[(w, bid)]
            elif blk.level != 0 or self.held(w, 0, blk.slot, len(want)) != want:
                raise Violation(f"deep: pinned block {bid} (window {w}) changed while pinned")

    def unchanged(self, fn, *args, expect=KVCacheError, **kwargs) -> bool:
        """Call that must fail cleanly; returns False if it succeeded (then state moved on)."""
        before = self.m.snapshot()
        try:
            fn(*args, **kwargs)
        except expect:
            if self.m.snapshot() != before:
                raise Violation(f"{getattr(fn, '__name__', fn)} raised but changed the ledger") from None
            return True
        finally:
            self.run.ops += 1
        return False

    # ------------------------------------------------------------------ requests
    def make_request(self) -> tuple[Request, Live]:
        rng, tpb = self.rng, self.tpb
        self.next_id += 1
        base = rng.choice(self.bases)
        cut = max(1, rng.choice([1, tpb - 1, tpb, tpb + 1, 2 * tpb - 1, 2 * tpb + 1, 3 * tpb, 4 * tpb + 2, 6 * tpb + 1, 9 * tpb]))
        max_new = rng.choice([0, tpb, 2 * tpb, 3 * tpb])
        prompt = (base[:cut] + [rng.randrange(3) for _ in range(rng.randrange(3))])[: self.L - max_new]
        item = None  # a multimodal item: its positions hold the placeholder token
        if len(prompt) > 1 and rng.random() < 0.15:
            start = rng.randrange(len(prompt) - 1)
            length = rng.randrange(1, min(2 * tpb + 2, len(prompt) - start) + 1)
            prompt[start : start + length] = [IMAGE_TOKEN] * length
            item = MultimodalItem(rng.choice(IMAGES), start, length)
        beam = 2 if self.family.beams and rng.random() < 0.4 else 1
        lora = rng.choice([None, None, None, 7])
        salt = rng.choice([None, None, None, "s"])
        extra = None if rng.random() < 0.85 else [rng.choice([0, 1])] * len(prompt)
        retention = None
        if self.long_retention:
            retention = RetentionConfig((TokenRangeRetention(0, None, 60, 3600.0),), 40, 3600.0)
        elif rng.random() < 0.3:
            prio = rng.choice([0, 20, 30, 60, 90])
            end = rng.choice([None, tpb, 3 * tpb])
            retention = RetentionConfig(
                (TokenRangeRetention(0, end, prio, rng.choice([None, 1.0, 5.0, 3600.0])),),
                rng.choice([35, 10, 80]),
                rng.choice([None, 2.0, 3600.0]),
            )
        draft = rng.choice([0, 0, 2, 4])
        req = Request(self.next_id, prompt, max_new_tokens=max_new, beam_width=beam, lora_task_id=lora, cache_salt=salt,
                      extra_ids=extra, retention=retention, num_draft_tokens=draft, mm_items=() if item is None else (item,))
        info = Live(self.next_id, [[] for _ in range(beam)], [[] for _ in range(beam)], lora, salt,
                    None if extra is None else [], len(prompt), 0, drafts=draft,
                    mm=None if item is None else (item.hash, item.start, item.length))
        for b in range(beam):
            for j, t in enumerate(prompt):
                info.append(b, t, None if extra is None else extra[j])
        if extra is not None:
            info.extra = list(extra)
        return req, info

    def admit(self, k: int) -> None:
        pairs = [self.make_request() for _ in range(k)]
        reqs = [r for r, _ in pairs]
        fits = None
        if k == 1 and not self.multi:
            need = self.call("needed_blocks_one_step", reqs[0])
            fits = need <= self.call("num_free_blocks")
        try:
            if k == 1:
                prepop = [self.call("add_sequence", reqs[0])]
            else:
                prepop = self.call("add_sequences", reqs)
        except OutOfBlocksError:
            if fits:
                raise Violation(
                    f"needed_blocks_one_step said request {reqs[0].request_id} fits; admission ran out of blocks"
                ) from None
            return
        for (req, info), p in zip(pairs, prepop, strict=True):
            if not 0 <= p <= max(len(req.prompt) - 1, 0):
                raise Violation(f"prepopulated {p} of a {len(req.prompt)}-token prompt")
            self.live[req.request_id] = info
            info.computed = p
        # a second admission decided before the first plan is reported (its ops read the first's)
        extra = None
        if self.rng.random() < 0.2:
            extra = lambda: self.admit_quiet()  # noqa: E731
        self.step(extra)
        for (req, info), p in zip(pairs, prepop, strict=True):
            if req.request_id not in self.live:
                continue  # readmitted after a failed transfer
            p = info.computed
            if p:
                self.check_reads(info, p, p - 1, "admission")  # the first new query reads the reused prefix
            if self.rng.random() < 0.3 and info.prompt_len - p > 2:
                self.call("set_context_position", req.request_id, p)  # chunked prefill: later
            else:
                self.forward(info, p, info.prompt_len, "prefill")
                # the prompt is one chunk: report it, as an engine does (a failed transfer of
                # this very step may have cut the ledger's context position back)
                self.call("set_context_position", req.request_id, info.prompt_len)
                self.call("store_context_blocks", req.request_id)

    def admit_quiet(self) -> None:
        """An admission whose plan rides along with the previous one (no forward of its own yet)."""
        req, info = self.make_request()
        try:
            p = self.call("add_sequence", req)
        except OutOfBlocksError:
            return
        self.live[req.request_id] = info
        info.computed = p
        self.pending_prefill.append(info)

    def prefill_chunk(self) -> None:
        cands = [i for i in self.live.values() if i.computed < i.prompt_len]
        if not cands:
            return
        info = self.rng.choice(cands)
        stop = min(info.prompt_len, info.computed + self.rng.randrange(1, 2 * self.tpb))
        start = info.computed
        self.forward(info, start, stop, "prefill chunk")
        self.call("set_context_position", info.rid, stop)
        self.call("store_context_blocks", info.rid)

    def decoding(self) -> list[Live]:
        return [i for i in self.live.values() if i.computed >= i.prompt_len and i.n < self.L]

    def next_tokens(self, info: Live) -> tuple[list[int], object]:
        """One sampled token per beam, and the `add_token` argument that says so (one int for
        a single beam or beams that agree, else one int per beam)."""
        toks = [self.rng.randrange(3) for _ in info.beams]
        if len(info.beams) == 1:
            return toks, toks[0]
        if self.rng.random() < 0.3:
            return [toks[0]] * len(info.beams), toks[0]
        return toks, toks

    @staticmethod
    def appended(info: Live, toks: list[int]) -> None:
        for b, t in enumerate(toks):
            info.append(b, t, None if info.extra is None else 0)
        if info.extra is not None:
            info.extra.append(0)

    def add_token(self, info: Live) -> bool:
        toks, arg = self.next_tokens(info)
        try:
            self.call("add_token", info.rid, arg)
        except OutOfBlocksError:
            return False
        self.appended(info, toks)
        return True

    def add_tokens(self, batch: list[Live]) -> list[Live]:
        """The step's tokens in one `add_tokens` call, as the engine's decode step makes it
        (a list, or an int array when every row is one int): all rows or none. Out of blocks,
        it must have changed nothing; then the rows go one by one (the engine's fallback)."""
        drawn = [self.next_tokens(info) for info in batch]
        args = [arg for _, arg in drawn]
        tokens: object = args
        if all(type(a) is int for a in args) and self.rng.random() < 0.5:
            tokens = np.array(args, dtype=self.rng.choice([np.int32, np.int64]))
        before = self.m.snapshot()
        try:
            self.call("add_tokens", [info.rid for info in batch], tokens)
        except OutOfBlocksError:
            if self.m.snapshot() != before:
                raise Violation("add_tokens ran out of blocks but changed the ledger") from None
            self.run.batched_refused += 1
            return [info for info in batch if self.add_token(info)]
        self.run.batched_steps += 1
        for info, (toks, _) in zip(batch, drawn, strict=True):
            self.appended(info, toks)
        return batch

    def decode_step(self) -> None:
        cands = self.decoding()
        last = [info for info in self.last_batch if info.rid in self.live and info.computed >= info.prompt_len]
        if last and len(last) == len(self.last_batch) and all(i.n < self.L for i in last) and self.rng.random() < 0.5:
            batch = last  # the previous step's rows again (`add_tokens` keeps that batch)
        else:
            batch = self.rng.sample(cands, min(self.family.decode_rows, len(cands)))
        # the step's forward computes each row's newest token (its queries read their windows),
        # then the sampled tokens are added and the blocks they complete stored
        self.step()
        batch = [info for info in batch if info.rid in self.live]  # a failed plan may readmit one
        for info in batch:
            self.forward(info, info.computed, info.n, "decode")
        if batch and self.rng.random() < 0.6:
            grown = self.add_tokens(batch)
        else:
            grown = [info for info in batch if self.add_token(info)]
        self.last_batch = batch
        self.step()
        to_store = []
        for info in grown:
            if info.rid in self.live:
                self.unwritten(info)
                if self.rng.random() < 0.5:
                    to_store.append(info.rid)
        if grown is batch and self.rng.random() < 0.5:
            # the engine's store: the step's own id list, so the call takes the store-hint
            # pre-check (the rows it skips are read by nothing)
            to_store = [info.rid for info in batch]
        if to_store and grown is batch:  # a batched step stores in one call, as the engine's does
            self.run.ops += len(to_store) - 1  # counted as the calls it stands for (the same run)
            self.call("store_new_blocks", to_store)
        else:
            for rid in to_store:
                self.call("store_new_block", rid)

    @staticmethod
    def may_rewind(info: Live) -> bool:
        return len(info.beams) == 1

    def speculate(self) -> None:
        # A verify forward computes the newest token (sampled last step, no KV yet) plus the
        # drafts added after it: at most num_draft_tokens + 1 positions, as an engine does;
        # without a sliding window a request may speculate regardless of its declared drafts.
        cands = [i for i in self.decoding() if self.may_rewind(i) and (i.drafts or not self.family.swa)]
        if not cands:
            return
        info = self.rng.choice(cands)
        k = self.rng.randrange(1, (info.drafts if self.family.swa else 4) + 1)  # drafts
        start = info.computed
        added = 0
        for _ in range(k):
            if info.n >= self.L or not self.add_token(info):
                break
            added += 1
        self.step()
        if info.rid not in self.live:
            return
        self.forward(info, start, info.n, "draft verify")  # one forward, a query per draft
        r = self.rng.random()
        if r < 0.3:
            self.call("store_new_block", info.rid)
        elif r < 0.45:
            self.pin(self.call("store_blocks_for_reuse", info.rid, pin=True), info)
        if self.may_rewind(info):
            if self.rng.random() < 0.8:  # reject some of this step's drafts: never refused for a window
                rejectable = min(added, info.drafts) if self.family.swa else added
                self.rewind(info, self.rng.randrange(0, rejectable + 1), rejected_drafts=True)
            else:  # any depth: a sliding window may refuse it
                self.rewind(info, self.rng.randrange(0, info.n - info.prompt_len + 1))

    def rewind(self, info: Live, j: int, rejected_drafts: bool = False) -> None:
        if j == 0:
            return
        try:
            self.call("rewind", info.rid, j)
        except (OutOfBlocksError, KVCacheError) as e:
            if not isinstance(e, OutOfBlocksError) and ("released" not in str(e) or rejected_drafts):
                raise Violation(f"rewind refused: {e}") from None
            return
        for b in range(len(info.beams)):
            del info.beams[b][-j:]
            del info.tags[b][-j:]
        if info.extra is not None:
            del info.extra[-j:]
        info.computed = min(info.computed, info.n)
        self.step()  # a rewind may copy a shared block
        if info.rid not in self.live:
            return  # that copy failed and the request was sent back for readmission
        # the kept tokens' KV is intact: the next query (at n) reads its window of them
        if info.computed >= info.n:
            self.check_reads(info, info.n, info.n - 1, "after rewind")

    def pin(self, ids, info: Live) -> None:
        """Remember what the pinned blocks hold: the positions `info` has computed in them."""
        self.pins.append(ids)
        info.pinned = True
        tpb = self.tpb
        for w in self.config.windows:
            for row in self.call("block_ids", info.rid, self.win(w)):
                for j, bid in enumerate(row):
                    valid = min(tpb, info.computed - j * tpb)
                    if bid == PLACEHOLDER_BLOCK_ID or valid <= 0:
                        continue
                    blk = self.m.block(bid, self.win(w))
                    held = self.held(w, blk.level, blk.slot, valid)
                    old = self.pinned_content.get((w, bid))  # pinned before (and still)
                    if old is not None and held[: len(old)] != old[: len(held)]:
                        raise Violation(f"pinned block {bid} (window {w}) changed while pinned")
                    if old is None or len(old) < valid:
                        self.pinned_content[(w, bid)] = held

    def own_ids(self, info: Live):
        out = {}
        for w in self.config.windows:
            out[w] = sorted(
                {b for row in self.call("block_ids", info.rid, self.win(w)) for b in row if b != PLACEHOLDER_BLOCK_ID}
            )
        return out if self.multi else out[self.config.windows[0]]

    def remove(self) -> None:
        info = self.live[self.rng.choice(list(self.live))]
        pin = self.rng.random() < 0.1
        if pin:
            self.pin(self.own_ids(info), info)
        self.call("remove_sequence", info.rid, store_for_reuse=self.rng.random() < 0.8, pin=pin)
        del self.live[info.rid]

    def pin_or_unpin(self) -> None:
        if self.pins and (not self.live or self.rng.random() < 0.6):
            ids = self.pins.pop(self.rng.randrange(len(self.pins)))
            self.call("unpin_blocks", ids)
            for w, bids in (ids.items() if isinstance(ids, dict) else [(self.config.windows[0], ids)]):
                for bid in bids:
                    if self.m.block(bid, self.win(w)).pin_count == 0:
                        self.pinned_content.pop((w, bid), None)
            return
        if self.live:
            info = self.rng.choice(list(self.live.values()))
            self.call("pin_blocks", info.rid)
            self.pin(self.own_ids(info), info)

    def dry_run(self) -> None:
        before = self.m.snapshot()
        req, _ = self.make_request()
        self.next_id -= 1
        self.call("analyze_prefix_reuse", req)
        for w in (self.config.windows if self.multi else [None]):
            self.call("needed_blocks_one_step", req, window=w)
            self.call("remaining_blocks_to_completion", req, w)
            for rid in list(self.live)[:3]:
                self.call("needed_blocks_one_step", rid, True, w)
                self.call("remaining_blocks_to_completion", rid, w)
        self.call("start_scheduling")
        for rid in list(self.live)[:2]:
            self.call("scheduling_remove_sequence", rid)
        self.call("scheduling_has_free_blocks", 1)
        self.call("stats")
        if self.m.snapshot() != before:
            raise Violation("a scheduler query or dry run changed the ledger")

    def bad_call(self) -> None:
        m, rng = self.m, self.rng
        info = rng.choice(list(self.live.values())) if self.live else None
        choices = [
            lambda: m.add_token(10**9, 1),
            lambda: m.block_table([10**9]),
            lambda: m.add_sequence(Request(1, [1, 2, 3], max_new_tokens=self.L)),
            lambda: m.priority_of_block(10**9),
            lambda: m.transfers_failed(m._transfers.issued + 1),
            lambda: m.unpin_blocks([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
            lambda: m.get_latest_events(float("nan")),
        ]
        if info is not None:
            rid = info.rid
            choices += [
                lambda: m.add_token(rid, rng.choice([-1, 1.5, True, 2**31, "x", None])),
                lambda: m.add_tokens([rid], [rng.choice([-1, 1.5, True, 2**31, "x", None])]),
                lambda: m.add_tokens([rid, rid], [1, 1]),
                lambda: m.add_tokens([rid, 10**9], [1, 1]),
                lambda: m.add_tokens([rid], [1, 1]),
                lambda: m.add_tokens([rid], np.array([[1]])),
                lambda: m.add_tokens([rid], np.array([1.0])),
                lambda: m.rewind(rid, info.n - info.prompt_len + 1),
                lambda: m.set_context_position(rid, info.n + 1),
                lambda: m.add_sequence(Request(rid, [1, 2])),
                lambda: m.add_sequences([Request(10**8, [1, 2]), Request(10**8, [3])]),
                lambda: m.block_table([rid], max_blocks=10**10),
                lambda: m.block_table([rid, rid]),
                lambda: m.remove_sequence(rid, store_for_reuse="yes"),
                lambda: (m.start_scheduling(), m.scheduling_remove_sequence(rid), m.scheduling_remove_sequence(rid)),
                lambda: m.transfers_applied(max(m._transfers.issued - 1, 0)),
            ]
        fn = rng.choice(choices)
        self.run.bad_calls += 1
        if not self.unchanged(fn):
            raise Violation("a bad call was accepted")

    # ------------------------------------------------------------------ the episode
    def run_ops(self, n_ops: int, check_every: int) -> None:
        rng = self.rng
        self.pending_prefill: list[Live] = []
        stop = self.run.ops + n_ops
        next_check = self.run.ops + check_every
        while self.run.ops < stop:
            r = rng.random()
            if self.pending_prefill:
                for info in self.pending_prefill:
                    if info.rid in self.live:
                        if info.computed:
                            self.check_reads(info, info.computed, info.computed - 1, "admission")
                        self.forward(info, info.computed, info.prompt_len, "riding prefill")
                        self.call("set_context_position", info.rid, info.prompt_len)
                        self.call("store_context_blocks", info.rid)
                self.pending_prefill = []
            if r < 0.16 and len(self.live) < self.family.max_live:
                self.admit(rng.choice(self.family.admit_sizes))
            elif r < 0.22:
                self.prefill_chunk()
            elif r < 0.50:
                if self.decoding():
                    self.decode_step()
            elif r < 0.60:
                self.speculate()
            elif r < 0.64:
                cands = [i for i in self.decoding() if self.may_rewind(i) and i.n > i.prompt_len]
                if cands:
                    info = rng.choice(cands)
                    self.rewind(info, rng.randrange(1, info.n - info.prompt_len + 1))
            elif r < 0.76:
                if self.live and rng.random() < self.family.remove_share:
                    self.remove()
            elif r < 0.80:
                self.pin_or_unpin()
            elif r < 0.85:
                self.clock_t += rng.choice([0.5, 1.0, 3.0])
                self.call("refresh_blocks")
                if rng.random() < 0.03:  # an operator drops the prefix cache (live requests keep theirs)
                    self.call("reset_prefix_cache")
                self.drain_events()
                self.call("iteration_stats")
            elif r < 0.90:
                self.dry_run()
            elif r < 0.95:
                self.bad_call()
            else:
                for info in list(self.live.values()):
                    if info.computed < info.prompt_len:
                        continue
                    if rng.random() < 0.5:
                        self.call("store_blocks_for_reuse", info.rid)
            if self.run.ops >= next_check:
                self.deep_check()
                next_check = self.run.ops + check_every
        self.deep_check()


class LongRun:
    def __init__(self, seed: int, fail_rate: float) -> None:
        self.seed = seed
        self.fail_rate = fail_rate
        self.ops = 0
        self.violations: Counter = Counter()
        self.examples: list[str] = []
        self.failures = self.recomputed = self.bad_calls = self.episodes = 0
        self.batched_steps = self.batched_refused = 0  # add_tokens calls that went through / ran out
        self.mirror_checks = self.mirror_skipped = 0  # event-stream mirror compared / not (events dropped)

    def run(self, total_ops: int, episode_ops: int = 3000, check_every: int = 400, on_episode=None) -> None:
        rng = random.Random(self.seed)
        while self.ops < total_ops:
            fams = families(rng.choice([4, 4, 2, 8, 1]))
            fam = fams[self.episodes % len(fams)]
            ep = Episode(self, fam, rng.randrange(2**32))
            self.episodes += 1
            try:
                ep.run_ops(min(episode_ops, total_ops - self.ops), check_every)
            except (Violation, KVCacheError, AssertionError) as v:
                # a KVCacheError here came from a valid call; an AssertionError from the slot
                # model (a plan entry out of range, a forward writing into the null slot)
                what = str(v).split(":")[0] if isinstance(v, Violation) else f"unexpected {type(v).__name__}"
                self.violations[f"{fam.name}: {what}"] += 1
                if len(self.examples) < 20:
                    self.examples.append(f"episode {self.episodes} ({fam.name}): {type(v).__name__}: {v}")
            if on_episode is not None:
                on_episode(self)


def memory_run(seed: int, ops: int) -> tuple[float, float, float]:
    """Steady workload on one manager (every request retained for an hour, so the expiry heap
    would grow by one entry per release): memory held by objects kvjax allocated (tracemalloc,
    MB) after a warm-up of a quarter of `ops`, at the middle and at the end. Bounded memory
    means the last two stay at the first."""
    run = LongRun(seed, fail_rate=0.05)
    ep = Episode(run, families(4)[0], seed, long_retention=True)
    ep.pending_prefill = []
    only_kvjax = [tracemalloc.Filter(True, str(ROOT / "kvjax" / "*"))]
    marks = []
    tracemalloc.start()
    try:
        for share in (4, 4, 2):
            ep.run_ops(ops // share, 400)
            gc.collect()
            traces = tracemalloc.take_snapshot().filter_traces(only_kvjax)
            marks.append(sum(stat.size for stat in traces.statistics("filename")) / 1e6)
    finally:
        tracemalloc.stop()
    if run.violations:
        raise Violation(f"memory run: {run.examples}")
    return tuple(marks)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=1_000_000, help="ledger calls to make")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-rate", type=float, default=0.1, help="share of non-empty plans reported failed")
    p.add_argument("--episode-ops", type=int, default=3000)
    p.add_argument("--memory", action="store_true", help="also check traced memory stays flat on a steady workload")
    a = p.parse_args(argv)
    run = LongRun(a.seed, a.fail_rate)
    t0 = time.perf_counter()
    last = [t0]

    def progress(r: LongRun) -> None:
        now = time.perf_counter()
        if now - last[0] > 30:
            last[0] = now
            print(f"  {r.ops:>9} ops, {sum(r.violations.values())} violations, {r.ops / (now - t0):,.0f} ops/s", flush=True)

    run.run(a.ops, a.episode_ops, on_episode=progress)
    wall = time.perf_counter() - t0
    print(f"operations: {run.ops:,} in {run.episodes} episodes; failed plans reported: {run.failures:,} "
          f"(tokens recomputed: {run.recomputed:,}); bad calls refused: {run.bad_calls:,}; batched decode "
          f"steps: {run.batched_steps:,} (+{run.batched_refused:,} out of blocks, unchanged); event-stream mirror "
          f"checks: {run.mirror_checks:,} ({run.mirror_skipped:,} skipped: events dropped)")
    print(f"violations: {sum(run.violations.values())}")
    for kind, n in sorted(run.violations.items()):
        print(f"  {n:>6}  {kind}")
    for ex in run.examples[:5]:
        print(f"  e.g. {ex}")
    print(f"wall {wall:.1f} s, {run.ops / wall:,.0f} ops/s")
    out = dict(ops=run.ops, violations=dict(run.violations), wall_s=wall, ops_per_s=run.ops / wall)
    if a.memory:
        warm, mid, end = memory_run(a.seed, min(a.ops, 200_000))
        print(f"traced memory on a steady workload: {warm:.2f} MB after warm-up, {mid:.2f} MB, {end:.2f} MB at the end")
        out["memory_mb"] = (warm, mid, end)
    return out


if __name__ == "__main__":
    main()
