"""Hypothesis stateful test of the whole ledger on tiny pools (random operation sequences against a model of every slot).

Random operation sequences (add, add batch, chunked prefill, add token, speculative steps with
draft tokens and rejections, rewind, store, remove, pin/unpin, refresh with a fake clock,
take_transfers, scheduler queries) run against pools of 6-12 blocks (tokens_per_block 2 or 4,
0-4 secondary blocks, optionally a sliding window and beam width 2), so eviction, offload,
onboard, partial reuse, copies, sliding-window detach and rewinds happen all the time. The
sliding window sits next to a full-attention one or alone, and is wider than two blocks, one
block wide, or narrower than a block (a block then leaves the window before it is stored).

After every step: `verify_integrity()`, count and table invariants, and a data check. The test
keeps a model of every memory slot's content (one tag per token position, a tag naming the
token and every token before it plus the isolation keys). Every `TransferPlan` is replayed op
by op with the semantics documented in kvjax/transfer_plan.py, and a model forward
writes each sequence's new tokens into the slots its block table names. Forwards run as an
engine runs them: a prefill writes the prompt, whole or in chunks (the ledger is told each
chunk with `set_context_position`); a decode token's KV is written by the next forward; a
speculative verify writes the previous newest token and every draft. A position no forward
has written yet holds an "unwritten" marker, so a store that covered it would leave the
marker in the tree. Then:
  * every live sequence's block table points at slots holding exactly its own tokens, for
    every position a forward wrote (prepopulated positions included), placeholders aside;
  * every block in the radix tree holds the tokens its tree path spells (primary or secondary);
  * pinned blocks (of live or removed sequences) keep every position they held when pinned
    until unpinned, through rewinds too;
  * no sliding window shows a placeholder inside the window of a sequence's newest position,
    and a speculative step's verify forward reads, for every query position (the newest token
    and each draft), only real blocks holding exactly this request's tokens;
  * scheduler queries agree with admission: a probe that `needed_blocks_one_step` says fits
    is admitted (on a copy of the ledger), and the query is exact (docs/semantics.md).
So reuse, partial copy, offload, onboard, rewinds and pins can never serve another request's
KV unnoticed.
"""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from ledger_helpers import FakeClock, SlotModel, make_config, salt, tag

from kvjax import (
    InvalidRequestError,
    KVCacheManager,
    OutOfBlocksError,
    Request,
    RetentionConfig,
    TokenRangeRetention,
)
from kvjax.ledger import PLACEHOLDER_BLOCK_ID, CreatedData, RemovedData, StoredData, UpdatedData, decode_batch

# Shared prefixes: bases 0 and 1 share 8 tokens, so prompts cut from them meet at block
# boundaries (tpb 2 or 4) and diverge inside blocks (partial matches) when suffixes differ.
BASES = [
    list(range(100, 132)),
    list(range(100, 108)) + list(range(200, 224)),
    list(range(300, 332)),
]


@st.composite
def prompts(draw, tpb, max_len):
    base = BASES[draw(st.sampled_from([0, 0, 0, 1, 2]))]
    # cuts around block boundaries: full-block matches, partial matches, the prompt_len % tpb == 1 rule
    cut = draw(st.sampled_from([1, tpb - 1, tpb, tpb + 1, 2 * tpb - 1, 2 * tpb, 2 * tpb + 1, 3 * tpb, 3 * tpb + 2]))
    suffix = draw(st.lists(st.integers(0, 1), max_size=3))
    return (base[:cut] + suffix)[:max_len]


@st.composite
def retentions(draw, tpb):
    if draw(st.integers(0, 3)):  # mostly none
        return None
    prio = draw(st.sampled_from([0, 20, 30, 60, 90]))
    end = draw(st.sampled_from([None, tpb, 2 * tpb, 3 * tpb]))
    dur = draw(st.sampled_from([None, 1.0, 5.0]))
    decode = draw(st.sampled_from([35, 10, 80]))
    return RetentionConfig((TokenRangeRetention(0, end, prio, dur),), decode, draw(st.sampled_from([None, 2.0])))


class LedgerMachine(RuleBasedStateMachine):
    # ------------------------------------------------------------------ set-up
    # A family of configurations per TestCase (below), so every family is explored whatever
    # the derandomized draws favour: (tokens_per_block, secondary, sliding window, beams).
    FAMILY = dict(tpb=[4, 2], secondary=[0, 1, 2, 4], swa=[False, True], beams=[False, True], event_hash=["sha256"])

    @initialize(data=st.data(), primary=st.integers(6, 12))
    def init(self, data, primary):
        f = self.FAMILY
        self.setup(
            tpb=data.draw(st.sampled_from(f["tpb"]), label="tpb"),
            primary=primary,
            secondary=data.draw(st.sampled_from(f["secondary"]), label="secondary"),
            swa=data.draw(st.sampled_from(f["swa"]), label="swa"),
            beams=data.draw(st.sampled_from(f["beams"]), label="beams"),
            event_hash=data.draw(st.sampled_from(f.get("event_hash", ["sha256"])), label="event hash"),
            window=data.draw(st.sampled_from(f.get("windows", ["wide"])), label="sliding window"),
            policy=data.draw(
                st.sampled_from(
                    [
                        dict(),
                        dict(copy_on_partial_reuse=False),
                        dict(enable_partial_reuse=False),
                        dict(secondary_offload_min_priority=50),
                    ]
                ),
                label="policy",
            ),
        )

    def setup(self, tpb, primary, secondary, swa, beams, policy, event_hash="sha256", window="wide"):
        self.tpb = tpb
        self.max_seq_len = 8 * tpb
        kw = dict(
            tokens_per_block=tpb,
            max_seq_len=self.max_seq_len,
            primary_blocks=primary,
            secondary_blocks=secondary,
            max_beam_width=2 if beams else 1,
            event_buffer_max_size=100_000,  # never drops: the router mirror below needs every event
            event_hash=event_hash,
            **policy,
        )
        if swa:  # a sliding-window layer beside a full-attention one, or alone ("solo")
            # "wide": two blocks and a token; "narrow": narrower than a block, so a block leaves
            # the window before it is stored; "block": exactly one block
            width = dict(wide=2 * tpb + 1, narrow=tpb - 1, block=tpb, solo=tpb + 1)[window]
            if window == "solo":
                kw.update(attention_windows=(width,))
            else:
                kw.update(num_layers=2, attention_windows=(self.max_seq_len, width))
        elif self.FAMILY.get("two_pools"):  # two pools in one window: one plan entry per pool
            kw.update(num_layers=2, num_kv_heads=(1, 2))
        self.config = make_config(**kw)
        self.clock = FakeClock()
        self.m = KVCacheManager(self.config, clock=self.clock)
        self.model = SlotModel(self.config)
        self.live: dict = {}  # rid -> dict(beams=[token lists], lora, salt, prompt_len)
        self.pins: list = []  # block ids to unpin (list, or dict window -> list)
        self.pinned_content: dict = {}  # (window, block id) -> [content when pinned, ...]
        self.next_id = 0
        self.router: dict = {}  # window -> {block hash: cache level}, rebuilt from events only
        self.multi = len(self.config.windows) > 1
        event(f"config: tpb {tpb}, secondary {secondary}, swa {swa} ({window}), beams {beams}, hash {event_hash}")

    # ------------------------------------------------------------------ model helpers
    def _engine_step(self):
        """Apply the pending transfer plan to the slot model (before any forward writes)."""
        self._apply(self.m.take_transfers())

    def _apply(self, plan):
        for k in set(plan.kind.tolist()):
            event(f"transfer {k}")
        self.model.apply(plan)

    def _rows(self, rid, window):
        return self.m.block_ids(rid, window if self.multi else None)

    def _write(self, rid, positions, oldest_query=None):
        """A forward writes the KV of `positions`. `oldest_query`: the oldest query the ledger
        was told of, when a request speculated more drafts than it declared. A position no
        query from there on can see (before its window, in a sliding window) may then have
        left that window already: its block table entry is the null slot and the write is
        skipped (the device refuses a numpy slot mapping into the null block and drops a
        traced one: docs/device.md)."""
        info = self.live[rid]
        tpb = self.tpb
        for w in self.config.windows:
            table = self.m.block_table([rid], w if self.multi else None)
            gone = -1 if oldest_query is None or w >= self.max_seq_len else oldest_query - w + 1
            null = self.model.null_slot(w)
            for b, toks in enumerate(info["beams"]):
                for i in positions:
                    slot = int(table[b, i // tpb])
                    if slot == null and i < gone:
                        event("speculate: an undeclared draft's write left the window")
                        continue
                    self.model.write(w, slot, i % tpb, tag(info["lora"], info["salt"], toks, i, info["extra"]))

    def _unwritten(self, rid, positions):
        """Mark `positions` as holding no KV yet (tokens a later forward computes)."""
        info = self.live[rid]
        for w in self.config.windows:
            table = self.m.block_table([rid], w if self.multi else None)
            for b in range(len(info["beams"])):
                for i in positions:
                    self.model.write(w, int(table[b, i // self.tpb]), i % self.tpb, ("unwritten", rid, b, i))

    def _written(self, rid):
        """Positions whose KV the forwards so far wrote: the prefilled prompt tokens while
        the prefill runs, then every token but the newest (whose KV the next forward writes)."""
        info = self.live[rid]
        done = info["prefilled"] == info["prompt_len"]
        return len(info["beams"][0]) - 1 if done else info["prefilled"]

    def _decoding(self):
        return sorted(r for r, info in self.live.items() if info["prefilled"] == info["prompt_len"])

    def _prefill(self, data, req, p):
        """The admitted request's prefill from its prepopulated length `p`: the whole prompt,
        or (drawn) a first chunk, the rest left to `prefill_chunk`."""
        rid, n = req.request_id, len(req.prompt)
        end = n
        if n - p > 1 and data.draw(st.booleans(), label="chunked prefill"):
            end = data.draw(st.integers(p, n - 1), label="first chunk end")
        self._write(rid, range(p, end))
        if end < n:
            self._unwritten(rid, range(end, n))
            self.m.set_context_position(rid, end)
        self.live[rid]["prefilled"] = end

    def _check_seq_content(self, rid, upto):
        info = self.live[rid]
        tpb = self.tpb
        for w in self.config.windows:
            ids = self._rows(rid, w)
            for b, toks in enumerate(info["beams"]):
                for i in range(upto):
                    bid = ids[b][i // tpb]
                    if bid == PLACEHOLDER_BLOCK_ID:
                        continue
                    blk = self.m.block(bid, w if self.multi else None)
                    got = self.model.read(w, blk.level, blk.slot)[i % tpb]
                    want = tag(info["lora"], info["salt"], toks, i, info["extra"])
                    assert got == want, f"request {rid} window {w} beam {b} position {i}: slot holds {got}, expected {want}"

    def _make_request(self, data, rid):
        max_new = data.draw(st.integers(0, 2 * self.tpb), label="max_new")
        prompt = data.draw(prompts(self.tpb, self.max_seq_len - max_new), label="prompt")
        beam = data.draw(st.sampled_from([1, 2]), label="beam") if self.config.max_beam_width > 1 else 1
        lora = data.draw(st.sampled_from([None, None, None, 7]), label="lora")
        cache_salt = data.draw(st.sampled_from([None, None, None, "s"]), label="salt")
        ret = data.draw(retentions(self.tpb), label="retention")
        extra = data.draw(st.sampled_from([None, None, None, None, 0, 1]), label="extra ids")
        extra_ids = None if extra is None else [extra] * len(prompt)
        drafts = data.draw(st.sampled_from([0, 0, 1, 3]), label="drafts") if beam == 1 else 0
        return Request(
            rid,
            prompt,
            max_new_tokens=max_new,
            beam_width=beam,
            lora_task_id=lora,
            cache_salt=cache_salt,
            retention=ret,
            extra_ids=extra_ids,
            num_draft_tokens=drafts,
        )

    def _admitted(self, req, prepopulated):
        assert 0 <= prepopulated <= max(len(req.prompt) - 1, 0)
        assert self.m.request_stats(req.request_id).prepopulated_tokens == prepopulated
        self.live[req.request_id] = dict(
            beams=[list(req.prompt) for _ in range(req.beam_width)],
            lora=req.lora_task_id,
            salt=salt(req.cache_salt),
            prompt_len=len(req.prompt),
            extra=None if req.extra_ids is None else list(req.extra_ids),
            drafts=req.num_draft_tokens,
            longest=len(req.prompt),  # most tokens held so far (sliding windows detach against it)
            prefilled=len(req.prompt),  # prompt tokens whose KV is written (`_prefill` sets it)
        )

    def _check_query_windows(self, rid, first, last):
        """Queries at positions first..last read only real blocks in every sliding window (their
        content is checked by `_check_seq_content`)."""
        tpb = self.tpb
        for w in self.config.windows:
            ids = self._rows(rid, w)
            for q in range(first, last + 1):
                for i in range(max(0, q - w + 1), q + 1):
                    for b, beam in enumerate(ids):
                        assert beam[i // tpb] != PLACEHOLDER_BLOCK_ID, (
                            f"request {rid} window {w} beam {b}: query {q} sees a placeholder at position {i}"
                        )

    def _record_pins(self, rid, rows=None):
        """Remember what every pinned block of request `rid` (`rows`: its block ids per window,
        taken before a removal) holds at the positions a forward wrote (`_written`); later
        positions of a slot may hold stale KV of rewound tokens."""
        tpb, n = self.tpb, self._written(rid)
        rows = rows or {w: self._rows(rid, w) for w in self.config.windows}
        for w, beams in rows.items():
            for beam in beams:
                for d, bid in enumerate(beam):
                    blk = None if bid == PLACEHOLDER_BLOCK_ID else self.m.block(bid, w if self.multi else None)
                    if blk is not None and blk.pin_count:
                        valid = max(0, min(tpb, n - d * tpb))
                        content = list(self.model.read(w, blk.level, blk.slot))
                        self.pinned_content.setdefault((w, bid), []).append(content[:valid] + [None] * (tpb - valid))

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _seq_block_ids(self, rid):
        out = {}
        for w in self.config.windows:
            ids = {i for beam in self._rows(rid, w) for i in beam if i != PLACEHOLDER_BLOCK_ID}
            out[w] = sorted(ids)
        return out if self.multi else out[self.config.windows[0]]

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.live) < 4)
    @rule(data=st.data(), k=st.integers(1, 2))
    def add(self, data, k):
        for _ in range(k):
            self._add_one(data)

    def _add_one(self, data):
        req = self._make_request(data, self._new_id())
        before = self.m.snapshot()
        try:
            p = self.m.add_sequence(req)
        except OutOfBlocksError:
            event("add: out of blocks")
            assert self.m.snapshot() == before
            return
        event(f"add: prepopulated {'>0' if p else '0'}")
        self._engine_step()
        self._admitted(req, p)
        self._check_seq_content(req.request_id, p)  # reused KV is this request's own
        self._check_query_windows(req.request_id, p, len(req.prompt) - 1)  # the prefill's queries
        self._prefill(data, req, p)

    @precondition(lambda self: len(self.live) < 3)
    @rule(data=st.data(), n=st.integers(2, 3))
    def add_batch(self, data, n):
        reqs = [self._make_request(data, self._new_id()) for _ in range(n)]
        before = self.m.snapshot()
        try:
            ps = self.m.add_sequences(reqs)
        except OutOfBlocksError:
            event("add_batch: out of blocks")
            assert self.m.snapshot() == before
            return
        event("add_batch: ok")
        self._engine_step()
        for req, p in zip(reqs, ps, strict=True):
            self._admitted(req, p)
            self._check_seq_content(req.request_id, p)
            self._check_query_windows(req.request_id, p, len(req.prompt) - 1)
        for req, p in zip(reqs, ps, strict=True):
            self._prefill(data, req, p)

    @precondition(lambda self: self._decoding())
    @rule(data=st.data())
    def add_token(self, data):
        rid = data.draw(st.sampled_from(self._decoding()), label="rid")
        info = self.live[rid]
        n = len(info["beams"][0])
        if n >= self.max_seq_len:
            return
        toks = [data.draw(st.integers(0, 3), label="token") for _ in info["beams"]]
        if len(toks) > 1 and data.draw(st.booleans(), label="one int for every beam"):
            toks = [toks[0]] * len(toks)
        self._engine_step()
        self._write(rid, [n - 1])  # the forward that sampled this token wrote the newest one's KV
        before = self.m.snapshot()
        try:
            self.m.add_token(rid, toks[0] if len(toks) == 1 or len(set(toks)) == 1 else toks)
        except OutOfBlocksError:
            assert self.m.snapshot() == before
            return
        for beam, t in zip(info["beams"], toks, strict=True):
            beam.append(t)
        info["longest"] = max(info["longest"], n + 1)
        if info["extra"] is not None:
            info["extra"].append(0)  # generated tokens carry extra id 0 (docs/semantics.md)
        self._engine_step()
        self._check_query_windows(rid, n, n)
        self._unwritten(rid, [n])  # its KV comes with the next forward

    @precondition(lambda self: self._decoding())
    @rule(data=st.data(), row_by_row=st.booleans())
    def add_tokens(self, data, row_by_row):
        """One decode step of several requests in one `add_tokens` call; without `row_by_row`
        it takes the batched path whatever the step's size (its requests' tokens move into
        the token store, and a later single `add_token` moves them back)."""
        rids = data.draw(st.lists(st.sampled_from(self._decoding()), min_size=1, max_size=4, unique=True), label="rids")
        rids = [r for r in rids if len(self.live[r]["beams"][0]) < self.max_seq_len]
        if not rids:
            return
        steps = []
        for rid in rids:
            toks = [data.draw(st.integers(0, 3), label="token") for _ in self.live[rid]["beams"]]
            if len(toks) > 1 and data.draw(st.booleans(), label="one int for every beam"):
                toks = [toks[0]] * len(toks)
            steps.append(toks)
        self._engine_step()
        lengths = {rid: len(self.live[rid]["beams"][0]) for rid in rids}
        for rid in rids:
            self._write(rid, [lengths[rid] - 1])
        before = self.m.snapshot()
        args = [t[0] if len(t) == 1 or len(set(t)) == 1 else t for t in steps]
        small = decode_batch.SMALL_BATCH
        decode_batch.SMALL_BATCH = small if row_by_row else 0
        try:
            self.m.add_tokens(rids, args)
        except OutOfBlocksError:
            assert self.m.snapshot() == before
            return
        finally:
            decode_batch.SMALL_BATCH = small
        event("add_tokens " + ("row by row" if row_by_row else "batched"))
        for rid, toks in zip(rids, steps, strict=True):
            info = self.live[rid]
            for beam, t in zip(info["beams"], toks, strict=True):
                beam.append(t)
            info["longest"] = max(info["longest"], lengths[rid] + 1)
            if info["extra"] is not None:
                info["extra"].append(0)
        self._engine_step()
        for rid in rids:
            n = lengths[rid]
            self._check_query_windows(rid, n, n)
            self._unwritten(rid, [n])

    @precondition(lambda self: self._decoding())
    @rule(data=st.data(), store=st.booleans())
    def overlapped_step(self, data, store):
        """An overlapped engine's decode step (kvjax/ledger/pending_tokens.py): the positions of
        tokens still being sampled are reserved (`add_pending_tokens`), stores may run while
        they are pending, then each id arrives (`set_pending_tokens`), or its request stops
        (the position rewound, then removed with its blocks stored), or is removed while its
        token is still unknown. A pending id never reaches the tree: the slot model's content
        checks would see it."""
        rids = data.draw(st.lists(st.sampled_from(self._decoding()), min_size=1, max_size=4, unique=True), label="rids")
        rids = [r for r in rids if len(self.live[r]["beams"]) == 1 and self.live[r]["extra"] is None
                and len(self.live[r]["beams"][0]) < self.max_seq_len]
        if not rids:
            return
        self._engine_step()
        lengths = {rid: len(self.live[rid]["beams"][0]) for rid in rids}
        for rid in rids:
            self._write(rid, [lengths[rid] - 1])
        before = self.m.snapshot()
        try:
            self.m.add_pending_tokens(rids)
        except OutOfBlocksError:
            assert self.m.snapshot() == before
            return
        event("overlapped step")
        assert self.m.pending_tokens() == lengths
        self.m.verify_integrity()
        self._engine_step()  # transfers (an evicted block's offload) before the forward writes
        for rid in rids:  # the next forward writes the pending position's KV
            self._unwritten(rid, [lengths[rid]])
        held = self.m.snapshot()
        with pytest.raises(InvalidRequestError, match="pending"):
            self.m.add_tokens(rids, [0] * len(rids))
        assert self.m.snapshot() == held
        if store:
            self.m.store_new_blocks(rids)
            self.m.verify_integrity()
        fill, toks, finish = [], [], []
        for rid in rids:
            fate = data.draw(st.sampled_from(["token", "token", "stop", "abort", "rewind"]), label="fate")
            if fate == "stop":  # stopped: removed with the wasted row's position never filled
                self.m.remove_sequence(rid, store_for_reuse=True)
                del self.live[rid]
            elif fate == "rewind":
                before = self.m.snapshot()
                try:
                    self.m.rewind(rid, 1)
                except (OutOfBlocksError, InvalidRequestError) as e:  # a copy with no free block, a released window
                    assert isinstance(e, OutOfBlocksError) or "released" in str(e)
                    assert self.m.snapshot() == before
                    fill.append(rid)
                    toks.append(0)
            else:
                fill.append(rid)
                toks.append(data.draw(st.integers(0, 3), label="token"))
                if fate == "abort":  # its id arrived, then it left (an abort, a stop string)
                    finish.append(rid)
        self.m.set_pending_tokens(fill, toks)
        assert self.m.pending_tokens() == {}
        for rid, t in zip(fill, toks, strict=True):
            info = self.live[rid]
            info["beams"][0].append(t)
            info["longest"] = max(info["longest"], lengths[rid] + 1)
        for rid in finish:
            self.m.remove_sequence(rid, store_for_reuse=True)
            del self.live[rid]
        self._engine_step()
        for rid in fill:
            if rid in self.live:
                self._check_query_windows(rid, lengths[rid], lengths[rid])

    @precondition(lambda self: any(i["prefilled"] < i["prompt_len"] for i in self.live.values()))
    @rule(data=st.data(), store=st.booleans())
    def prefill_chunk(self, data, store):
        """The next chunk of a running prefill: its queries checked, its KV written, the
        ledger told (`set_context_position`), maybe its full blocks stored."""
        running = sorted(r for r, i in self.live.items() if i["prefilled"] < i["prompt_len"])
        rid = data.draw(st.sampled_from(running), label="rid")
        info = self.live[rid]
        start = info["prefilled"]
        end = data.draw(st.integers(start + 1, info["prompt_len"]), label="chunk end")
        self._engine_step()
        self._check_seq_content(rid, start)
        self._check_query_windows(rid, start, end - 1)
        self._write(rid, range(start, end))
        self.m.set_context_position(rid, end)
        info["prefilled"] = end
        if store:
            self.m.store_context_blocks(rid)

    @precondition(lambda self: self._decoding())
    @rule(data=st.data())
    def rewind(self, data):
        rid = data.draw(st.sampled_from(self._decoding()), label="rid")
        info = self.live[rid]
        generated = len(info["beams"][0]) - info["prompt_len"]
        if len(info["beams"]) != 1 or generated == 0:
            return
        k = data.draw(st.integers(1, generated), label="k")
        before = self.m.snapshot()
        try:
            self.m.rewind(rid, k)
        except (OutOfBlocksError, InvalidRequestError) as e:
            if isinstance(e, InvalidRequestError):  # only a sliding window's released blocks may refuse,
                # and only below what the request's draft count keeps
                assert "released" in str(e) and len(info["beams"][0]) - k < info["longest"] - info["drafts"]
            assert self.m.snapshot() == before
            return
        del info["beams"][0][-k:]
        if info["extra"] is not None:
            del info["extra"][-k:]

    @precondition(lambda self: self._decoding())
    @rule(data=st.data(), op=st.sampled_from(["none", "new", "reuse", "reuse_pin"]))
    def speculate(self, data, op):
        """One speculative step: up to `num_draft_tokens` drafts (up to three for requests that
        declared none) after the newest token, one verify forward over the newest token and
        the drafts (every query's window checked), maybe a store or pin, then the rejected
        drafts rewound."""
        rid = data.draw(st.sampled_from(self._decoding()), label="rid")
        info = self.live[rid]
        if len(info["beams"]) != 1:
            return
        k = data.draw(st.integers(1, info["drafts"] or 3), label="drafts")
        first = len(info["beams"][0])
        added = 0
        for _ in range(k):
            if len(info["beams"][0]) >= self.max_seq_len:
                break
            t = data.draw(st.integers(0, 3), label="draft token")
            before = self.m.snapshot()
            try:
                self.m.add_token(rid, t)
            except OutOfBlocksError:
                assert self.m.snapshot() == before
                break
            info["beams"][0].append(t)
            info["longest"] = max(info["longest"], len(info["beams"][0]))
            if info["extra"] is not None:
                info["extra"].append(0)
            added += 1
        if not added:
            return
        # the verify forward: queries at the newest token and every draft, KV written. The
        # ledger keeps what the newest token and num_draft_tokens drafts see (a request
        # without drafts that speculates anyway breaks that contract: its step is checked
        # from the newest token back over its declared drafts only)
        self._engine_step()
        self._check_seq_content(rid, first - 1)
        last = first + added - 1
        self._check_query_windows(rid, max(first - 1, last - info["drafts"]), last)
        oldest = last - info["drafts"] if added > info["drafts"] else None  # the ledger's oldest query
        self._write(rid, range(first - 1, first + added), oldest)  # inputs: the newest token and every draft
        if op == "new":
            self.m.store_new_block(rid)
        elif op != "none":
            ids = self.m.store_blocks_for_reuse(rid, pin=op == "reuse_pin")
            if op == "reuse_pin":
                self.pins.append(ids)
                self._record_pins(rid)
        j = data.draw(st.integers(0, added), label="rejected")
        before = self.m.snapshot()
        try:
            self.m.rewind(rid, j)
        except (OutOfBlocksError, InvalidRequestError) as e:
            if isinstance(e, InvalidRequestError):
                # rejecting drafts is refused only past what the request's draft count keeps
                assert "released" in str(e) and len(info["beams"][0]) - j < info["longest"] - info["drafts"]
            assert self.m.snapshot() == before
            return
        if j:
            event("speculate: rewound")
            del info["beams"][0][-j:]
            if info["extra"] is not None:
                del info["extra"][-j:]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), op=st.sampled_from(["context", "chunk", "new", "new_batch", "reuse", "reuse_pin"]))
    def store(self, data, op):
        rid = data.draw(st.sampled_from(sorted(self.live)), label="rid")
        if op == "new_batch":  # a decode step's stores in one call (ids may repeat)
            more = data.draw(st.lists(st.sampled_from(sorted(self.live)), max_size=3), label="more ids")
            self.m.store_new_blocks([rid, *more])
        elif op == "context":
            self.m.store_context_blocks(rid)
        elif op == "chunk":
            # a context position the forwards reached (a prefill may still be running)
            info = self.live[rid]
            top = len(info["beams"][0]) if info["prefilled"] == info["prompt_len"] else info["prefilled"]
            pos = data.draw(st.integers(0, top), label="pos")
            before = self.m.snapshot()
            try:
                self.m.set_context_position(rid, pos)
            except InvalidRequestError as e:  # a chunk that would see released blocks
                assert "released" in str(e) and self.m.snapshot() == before
                return
            self.m.store_context_blocks(rid)
        elif op == "new":
            self.m.store_new_block(rid)
        else:
            ids = self.m.store_blocks_for_reuse(rid, pin=op == "reuse_pin")
            if self.multi:
                assert {w: sorted(v) for w, v in ids.items()} == self._seq_block_ids(rid)
            else:
                assert sorted(ids) == self._seq_block_ids(rid)
            if op == "reuse_pin":
                self.pins.append(ids)
                self._record_pins(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), store=st.booleans(), pin=st.sampled_from([False, False, True]))
    def remove(self, data, store, pin):
        rid = data.draw(st.sampled_from(sorted(self.live)), label="rid")
        ids = self._seq_block_ids(rid)
        rows = {w: self._rows(rid, w) for w in self.config.windows}
        self.m.remove_sequence(rid, store_for_reuse=store, pin=pin)
        if pin:
            self.pins.append(ids)
            self._record_pins(rid, rows)
        del self.live[rid]

    @rule(data=st.data(), k=st.integers(1, 2))
    def churn(self, data, k):
        """The common serving cycle, weighted up: the oldest request finishes (stored for
        reuse) and new ones arrive, often sharing its prefix."""
        if self.live:
            rid = min(self.live)
            self.m.remove_sequence(rid)
            del self.live[rid]
        for _ in range(k):
            self._add_one(data)

    @precondition(lambda self: self.live or self.pins)
    @rule(data=st.data())
    def pin_or_unpin(self, data):
        if self.pins and (not self.live or data.draw(st.booleans(), label="unpin")):
            i = data.draw(st.integers(0, len(self.pins) - 1), label="pin")
            self.m.unpin_blocks(self.pins.pop(i))
            return
        rid = data.draw(st.sampled_from(sorted(self.live)), label="rid")
        self.m.pin_blocks(rid)
        self.pins.append(self._seq_block_ids(rid))
        self._record_pins(rid)

    @rule(op=st.sampled_from(["refresh", "transfers"]), dt=st.sampled_from([0.5, 1.0, 3.0, 10.0]))
    def housekeeping(self, op, dt):
        if op == "refresh":
            self.clock.advance(dt)
            self.m.refresh_blocks()
            return
        plan = self.m.take_transfers()
        for name in ("kind", "pool", "src", "dst", "num_tokens"):
            assert getattr(plan, name).dtype.name == "int32"
        self._apply(plan)

    @rule(data=st.data())
    def scheduler_queries(self, data):
        before = self.m.snapshot()
        req = self._make_request(data, "probe")
        s = self.m.analyze_prefix_reuse(req)
        assert 0 <= s.reusable_blocks_allocated <= s.reusable_blocks_all
        assert 0 <= s.total_matched_tokens <= len(req.prompt) - 1 or s.total_matched_tokens == 0
        windows = self.config.windows if self.multi else [None]
        for w in windows:
            assert self.m.needed_blocks_one_step(req, window=w) >= 0
            assert self.m.remaining_blocks_to_completion(req, window=w) >= 0
            for rid in self.live:
                assert self.m.needed_blocks_one_step(rid, window=w) >= 0
                assert self.m.needed_blocks_one_step(rid, two_steps_lookahead=True, window=w) >= 0
                assert self.m.remaining_blocks_to_completion(rid, window=w) >= 0
        self.m.start_scheduling()
        for rid in list(self.live)[:2]:
            self.m.scheduling_remove_sequence(rid)
        assert self.m.scheduling_has_free_blocks(0)
        self.m.iteration_stats()
        assert self.m.snapshot() == before  # queries and dry runs change nothing
        # the query agrees with admission: "fits" -> admitted; without drafts, exactly
        fits = all(self.m.needed_blocks_one_step(req, window=w) <= self.m.num_free_blocks(w) for w in windows)
        if len(self.live) >= 4:
            return
        req.request_id = self._new_id()
        try:
            p = self.m.add_sequence(req)
        except OutOfBlocksError:
            assert not fits, "needed_blocks_one_step said the request fits, admission failed"
            assert self.m.snapshot() == before
            return
        assert fits or req.num_draft_tokens, "a request the query said does not fit was admitted"
        event("scheduler probe admitted")
        self._engine_step()
        self._admitted(req, p)
        self._check_seq_content(req.request_id, p)
        self._check_query_windows(req.request_id, p, len(req.prompt) - 1)
        self._prefill(data, req, p)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def ledger_invariants(self):
        m = self.m
        m.verify_integrity()
        rids = sorted(self.live)
        rows = sum(len(self.live[r]["beams"]) for r in rids)
        for w in self.config.windows:
            ww = w if self.multi else None
            total = self.config.primary_blocks_for(w)
            assert m.num_free_blocks(ww) + m.num_allocated_blocks(ww) == total
            table = m.block_table(rids, ww)
            width = max((len(m.block_ids(r, ww)[0]) for r in rids), default=0)
            assert table.shape == (rows, width)
            r0 = 0
            for rid in rids:
                ids = m.block_ids(rid, ww)
                assert len(ids) == len(self.live[rid]["beams"])
                for b, beam in enumerate(ids):
                    assert len(beam) == -(-len(self.live[rid]["beams"][0]) // self.tpb)
                    for j, bid in enumerate(beam):
                        if bid == PLACEHOLDER_BLOCK_ID:
                            assert table[r0 + b, j] == total  # the null slot
                            continue
                        blk = m.block(bid, ww)
                        assert blk.level == 0, "a live sequence references a secondary block"
                        assert table[r0 + b, j] == blk.slot
                    assert (table[r0 + b, len(beam) :] == total).all()  # padding: null slot
                r0 += len(ids)

    @invariant()
    def events_mirror_the_tree(self):
        """A router that only reads events knows exactly which blocks are cached, and where."""
        self.m.flush_iteration_events()
        for e in self.m.get_latest_events():
            d, view = e.data, self.router.setdefault(e.window_size, {})
            if isinstance(d, CreatedData):
                assert view == {}
            elif isinstance(d, StoredData):
                assert d.parent_hash is None or d.parent_hash not in (0, self.m.inspector.event_hasher.root)
                for b in d.blocks:
                    assert b.block_hash not in view, f"Stored twice without Removed: {b}"
                    view[b.block_hash] = b.cache_level
            elif isinstance(d, RemovedData):
                for h in d.block_hashes:
                    assert h in view, f"Removed a hash never stored: {h}"
                    del view[h]
            elif isinstance(d, UpdatedData) and d.cache_level is not None:
                old, new = d.cache_level
                assert view.get(d.block_hash) == old, f"Updated {d} but router has {view.get(d.block_hash)}"
                view[d.block_hash] = new
        inspector = self.m.inspector
        for w in self.config.windows:
            ww = w if self.multi else None
            truth = {inspector.block_hash(b, ww): self.m.block(b, ww).level for b in inspector.cached_block_ids(ww)}
            assert self.router.get(w, {}) == truth

    @invariant()
    def slot_contents(self):
        self._engine_step()
        for rid in self.live:
            self._check_seq_content(rid, self._written(rid))
        # every cached block holds what its tree path spells
        inspector = self.m.inspector
        for w in self.config.windows:
            ww = w if self.multi else None
            for bid in inspector.cached_block_ids(ww):
                blk = self.m.block(bid, ww)
                keys = inspector.cached_path(bid, ww)
                key = keys[-1]
                assert blk.key == key
                toks = [t for k in keys for t in k.tokens]
                offset = len(toks) - len(key.tokens)
                content = self.model.read(w, blk.level, blk.slot)
                extra = None
                if key.extra_ids is not None:
                    extra = [e for k in keys for e in k.extra_ids]
                for j in range(len(key.tokens)):
                    want = tag(key.lora_task_id, key.cache_salt_id, toks, offset + j, extra)
                    assert content[j] == want, f"cached block {bid} (window {w}) position {j}: {content[j]} != {want}"
        # pinned blocks keep every position they held when pinned (new positions may fill in)
        for (w, bid), records in list(self.pinned_content.items()):
            blk = self.m.block(bid, w if self.multi else None)
            if blk.pin_count == 0:
                del self.pinned_content[(w, bid)]
                continue
            now = self.model.read(w, 0, blk.slot)
            assert blk.level == 0
            for want in records:
                for j, v in enumerate(want):
                    assert v is None or now[j] == v, f"pinned block {bid} (window {w}) position {j}: {now[j]} != {v}"
        # no sliding window hides a position the newest token's query sees
        for rid, info in self.live.items():
            n = len(info["beams"][0])
            self._check_query_windows(rid, n - 1, n - 1)


class OffloadMachine(LedgerMachine):
    """Secondary memory: offload, onboard, partial onboard copies (events with both hashes)."""

    FAMILY = dict(tpb=[4, 2], secondary=[2, 4, 1], swa=[False], beams=[False], two_pools=True, event_hash=["sha256", "trtllm64"])


class SlidingWindowMachine(LedgerMachine):
    """A sliding window (beside full attention, or alone): detach, placeholders, safe prefixes."""

    FAMILY = dict(tpb=[2, 4], secondary=[0, 2], swa=[True], beams=[False], windows=["wide", "narrow", "block", "solo"])


class BeamMachine(LedgerMachine):
    """Beam width 2 next to single-beam requests."""

    FAMILY = dict(tpb=[4, 2], secondary=[0, 2], swa=[False, True], beams=[True], windows=["wide", "narrow", "solo"])


_settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestOffload = OffloadMachine.TestCase
TestOffload.settings = _settings
TestSlidingWindow = SlidingWindowMachine.TestCase
TestSlidingWindow.settings = _settings
TestBeams = BeamMachine.TestCase
TestBeams.settings = _settings
