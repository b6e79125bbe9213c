"""Admission capacity and the scheduler queries that predict it.

* A partially matched free non-leaf block is copied, and the copy source is free again for the
  rest of the same admission (TensorRT-LLM's `NonLeafCopySourceTightPool`): the transfer plan
  orders the copy before anything overwrites the source. Batches follow the same rule.
* `needed_blocks_one_step` runs admission's own plan: if every window's answer fits in
  `num_free_blocks(window)`, admission succeeds (single and batch), and without draft tokens
  the answer is exact up to one block (docs/semantics.md, "Scheduling accounting").
"""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest
from ledger_helpers import SlotModel, make_config, tag

from kvjax import InvalidRequestError, KVCacheManager, OutOfBlocksError, Request
from kvjax.errors import InvalidArgumentError, UnknownRequestError

R = range


def toks(*parts):
    out = []
    for p in parts:
        out.extend([p] if isinstance(p, int) else p)
    return out


class Model:
    """Slot-content model of a single-pool, single-window manager: plans replayed in order,
    each admission's prompt written by a model forward, every position checked on reads."""

    def __init__(self, m: KVCacheManager):
        self.m, self.slots = m, SlotModel(m.config)
        self.tokens: dict = {}

    def admit(self, requests):
        ps = self.m.add_sequences(requests)
        plan = self.m.take_transfers()
        self.slots.apply(plan)
        for r, p in zip(requests, ps, strict=True):
            self.tokens[r.request_id] = list(r.prompt)
            self.check(r.request_id, p)  # reused positions already hold this request's KV
        for r, p in zip(requests, ps, strict=True):
            table = self.m.block_table([r.request_id])[0]
            for i in range(p, len(r.prompt)):
                self.slots.write(64, int(table[i // 4]), i % 4, tag(None, None, r.prompt, i))
        for r in requests:
            self.check(r.request_id, len(r.prompt))
        return ps, [(op.kind.name, op.src, op.dst, op.num_tokens) for op in plan]

    def check(self, rid, upto):
        toks_ = self.tokens[rid]
        for i in range(upto):
            blk = self.m.block(self.m.block_ids(rid)[0][i // 4])
            got = self.slots.read(64, blk.level, blk.slot)[i % 4]
            assert got == tag(None, None, toks_, i), f"{rid} position {i}: {got}"

    def content(self, block_id):
        blk = self.m.block(block_id)
        return list(self.slots.read(64, blk.level, blk.slot))


def _tight_pool(secondary=0):
    """8 free blocks: a stored chain 0 -> 1 -> 2 -> 3 (16 tokens, the last one partial) and 4
    never used."""
    m = KVCacheManager(make_config(primary_blocks=8, secondary_blocks=secondary))
    model = Model(m)
    model.admit([Request("seed", list(R(16)))])
    m.remove_sequence("seed")
    assert m.num_free_blocks() == 8
    return m, model


# --------------------------------------------------------------------------- behaviour 4
@pytest.mark.parametrize("secondary", [0, 2])
def test_non_leaf_copy_source_is_recycled_in_a_tight_pool(secondary):
    """A 31-token prompt (8 blocks) matching block 0 and 2 tokens of block 1, a non-leaf: the
    copy of block 1 plus 6 fresh blocks need block 1 itself once it has been copied."""
    m, model = _tight_pool(secondary)
    old = model.content(1)
    q = Request("q", toks(R(6), R(100, 125)))
    assert m.needed_blocks_one_step(q) == 8 == m.num_free_blocks()
    (p,), ops = model.admit([q])
    assert p == 6 and m.num_free_blocks() == 0
    ids, slots = m.block_ids("q")[0], list(m.block_table(["q"])[0])
    assert ids[0] == 0 and 1 in slots[2:]  # the copy source's slot became one of q's fresh blocks
    assert ops[0] == ("COPY", 1, slots[1], 2)  # read before anything can overwrite slot 1
    assert model.content(ids[1])[:2] == old[:2]  # the copy holds the source's old KV
    if secondary:  # the recycled source's cached content was offloaded, after the copy
        assert any(op[0] == "OFFLOAD" and op[1] == 1 for op in ops[1:])
    m.verify_integrity()


def test_batch_recycles_a_copy_source_after_every_copy():
    m, model = _tight_pool()
    c = Request("c", list(R(200, 224)))  # 6 fresh blocks
    b = Request("b", toks(R(6), 99))  # block 0 matched, 2 tokens of block 1 copied, nothing fresh
    assert m.needed_blocks_one_step(c) + m.needed_blocks_one_step(b) == 6 + 3  # b alone: its copy needs a target
    # together: the copy runs first, block 1 is free again, c's sixth fresh block is block 1
    ps, ops = model.admit([c, b])
    assert ps == [0, 6] and m.num_free_blocks() == 0 and 1 in m.block_ids("c")[0]
    assert ops == [("COPY", 1, m.block_ids("b")[0][1], 2)]
    m.verify_integrity()


def test_a_copy_source_is_never_its_own_target():
    m, model = _tight_pool()
    m.add_sequence(Request("pin", list(R(16))))
    m.remove_sequence("pin", pin=True)
    m.unpin_blocks([3, 0, 1])  # block 2 stays pinned: block 1 keeps a child, a non-leaf
    model.admit([Request("live", list(R(300, 320)))])  # 5 blocks: only 0 and 1 stay free
    assert m.num_free_blocks() == 2
    b = Request("b", toks(R(6), 99))  # block 0 matched, block 1 copied: a target besides 0 and 1
    assert m.needed_blocks_one_step(b) == 3
    before = m.snapshot()
    with pytest.raises(OutOfBlocksError):
        m.add_sequence(b)
    assert m.snapshot() == before


# --------------------------------------------------------------------------- behaviour 5
PREFIXES = [list(R(100, 140)), list(R(100, 108)) + list(R(200, 232)), list(R(300, 340))]


def _random_request(rng, rid, cfg, drafts=True):
    base = rng.choice(PREFIXES)
    cut = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 17, 21])
    prompt = base[:cut] + [rng.randrange(4) for _ in range(rng.randrange(4))]
    prompt = prompt[: cfg.max_seq_len - 4]
    beam = rng.choice([1, 1, 2]) if cfg.max_beam_width > 1 else 1
    return Request(
        rid,
        prompt,
        max_new_tokens=rng.randrange(4),
        beam_width=beam,
        lora_task_id=rng.choice([None, None, None, 5]),
        num_draft_tokens=rng.choice([0, 0, 0, 2]) if drafts and beam == 1 else 0,
    )


def _random_config(rng):
    tpb = rng.choice([2, 4])
    kw = dict(
        tokens_per_block=tpb,
        max_seq_len=16 * tpb,
        primary_blocks=rng.randint(5, 14),
        secondary_blocks=rng.choice([0, 0, 1, 3]),
        max_beam_width=rng.choice([1, 2]),
        **rng.choice(
            [{}, {}, dict(copy_on_partial_reuse=False), dict(enable_partial_reuse=False), dict(enable_block_reuse=False)]
        ),
    )
    shape = rng.choice(["full", "swa", "vswa"])
    if shape == "swa":
        kw.update(attention_windows=(rng.choice([3, 5, 2 * tpb + 1]),))
    elif shape == "vswa":
        w = rng.choice([3, 5, 2 * tpb + 1])
        kw.update(
            num_layers=2, attention_windows=(16 * tpb, w), primary_blocks={16 * tpb: kw["primary_blocks"], w: rng.randint(4, 12)}
        )
    return make_config(**kw)


def _beam_token(m, cfg, rng, rid):
    """A random token for each of the request's beams (one int for a one-beam request)."""
    beams = len(m.block_ids(rid, cfg.windows[0]))
    return rng.randrange(4) if beams == 1 else [rng.randrange(4)] * beams


def _history_step(rng, m, cfg, live, pins, rid):
    """One random operation of ordinary traffic: tokens, stores, removals (stored or not),
    pins and unpins, taking the transfer plan."""
    op = rng.random()
    try:
        if op < 0.4 and live:
            r = rng.choice(live)
            m.add_token(r, _beam_token(m, cfg, rng, r))
        elif op < 0.5 and live:
            m.store_context_blocks(rng.choice(live))
        elif op < 0.8 and live:
            r = live.pop(rng.randrange(len(live)))
            pin = rng.random() < 0.1
            ids = m.store_blocks_for_reuse(r) if pin else None
            m.remove_sequence(r, store_for_reuse=rng.random() < 0.8, pin=pin)
            if pin:
                pins.append(ids)
        elif op < 0.9 and pins:
            m.unpin_blocks(pins.pop(rng.randrange(len(pins))))
        else:
            m.add_sequence(_random_request(rng, rid, cfg))
            live.append(rid)
    except (OutOfBlocksError, InvalidRequestError):  # a full pool or max_seq_len: part of the traffic
        pass
    if rng.random() < 0.3:
        m.take_transfers()


def _draft_blocks(req, cfg):
    p, tpb = len(req.prompt), cfg.tokens_per_block
    return (-(-min(p + req.num_draft_tokens, cfg.max_seq_len) // tpb) - -(-p // tpb)) * req.beam_width


def test_scheduler_queries_agree_with_admission_over_random_states():
    """Seeded random states (reuse, partial copies in place or not, offload, sliding and
    variable windows, beams, pins): "fits" implies admitted, single and batch; without drafts
    the answer is what admission takes (+1 only for a copy with nothing else to allocate), so
    a request said not to fit is never admissible."""
    rng = random.Random(20261130)
    stats = dict(single=0, fits=0, admitted=0, exact=0, plus_one=0, batch=0, batch_fits=0)
    for c in range(70):
        cfg = _random_config(rng)
        m = KVCacheManager(cfg)
        live, pins = [], []
        for step in range(60):
            rid = f"{c}-{step}"
            if rng.random() < 0.55:
                _history_step(rng, m, cfg, live, pins, rid)
                continue
            batch = [_random_request(rng, f"{rid}-{k}", cfg) for k in range(rng.choice([1, 1, 2, 3]))]
            free = {w: m.num_free_blocks(w) for w in cfg.windows}
            need = {w: sum(m.needed_blocks_one_step(r, window=w) for r in batch) for w in cfg.windows}
            fits = all(need[w] <= free[w] for w in cfg.windows)
            try:
                m.add_sequences(batch)
                ok = True
            except OutOfBlocksError:
                ok = False
            if fits:
                assert ok, f"queries said {need} fit in {free}, admission failed: {cfg} {batch}"
            if len(batch) > 1:
                stats["batch"] += 1
                stats["batch_fits"] += fits
            else:
                (probe,) = batch
                stats["single"] += 1
                stats["fits"] += fits
                stats["admitted"] += ok
                if ok:
                    for w in cfg.windows:
                        over = need[w] - _draft_blocks(probe, cfg) - (free[w] - m.num_free_blocks(w))
                        assert over in (0, 1), (need, free, w)
                        stats["exact" if over == 0 else "plus_one"] += 1
                elif not probe.num_draft_tokens:
                    assert not fits
            if ok:
                live.extend(r.request_id for r in batch)
            m.verify_integrity()
    # the random states exercised both sides of the boundary and both exactness cases
    assert stats["fits"] > 150 and stats["single"] - stats["admitted"] > 50 and stats["plus_one"] > 0, stats
    assert stats["batch_fits"] > 50 and stats["batch"] - stats["batch_fits"] > 50, stats


def test_batched_queries_answer_as_the_scalar_ones_over_random_states():
    """`remaining_blocks_to_completion_many` and `needed_blocks_one_step_many` (what a
    scheduler asks of every running request each step) against one scalar query per id, after
    every operation of seeded random traffic: reuse on and off, sliding and variable windows,
    beams, drafts, chunked prefills part-way through, sink tokens and a chunk budget (the
    temporary window), requests holding no block yet, an id asked twice. A bad id list
    changes nothing."""
    rng = random.Random(20261201)
    checked = 0
    for c in range(40):
        cfg = _random_config(rng)
        extra = rng.choice([{}, {}, dict(sink_token_length=3), dict(max_num_tokens=5)])
        if extra:
            cfg = dataclasses.replace(cfg, **extra)
        m = KVCacheManager(cfg)
        live: list = []
        pins: list = []
        for step in range(50):
            rid = f"{c}-{step}"
            _history_step(rng, m, cfg, live, pins, rid)
            if live and rng.random() < 0.2:  # a chunked prefill part-way through
                r = rng.choice(live)
                try:
                    m.set_context_position(r, rng.randrange(6))
                except InvalidRequestError:  # past its tokens, or a chunk whose blocks a sliding window released
                    pass
            ids = list(live)
            rng.shuffle(ids)
            if ids and rng.random() < 0.3:  # a scheduler may ask of one request twice
                ids.append(rng.choice(ids))
            for w in cfg.windows:
                many = m.remaining_blocks_to_completion_many(ids, w)
                assert many.dtype == np.int64 and many.shape == (len(ids),)
                assert many.tolist() == [m.remaining_blocks_to_completion(r, w) for r in ids], (cfg, w)
                for look in (False, True):
                    many = m.needed_blocks_one_step_many(ids, look, w)
                    assert many.tolist() == [m.needed_blocks_one_step(r, look, w) for r in ids], (cfg, w, look)
                checked += len(ids)
        before = m.snapshot()
        with pytest.raises(UnknownRequestError):
            m.remaining_blocks_to_completion_many([*live, "ghost"])
        with pytest.raises(UnknownRequestError):
            m.needed_blocks_one_step_many(["ghost", *live])
        with pytest.raises(InvalidArgumentError):
            m.needed_blocks_one_step_many(live, two_steps_lookahead="yes")
        with pytest.raises(InvalidArgumentError):
            m.remaining_blocks_to_completion_many("ab")
        assert m.snapshot() == before
        m.verify_integrity()
    assert checked > 2000


def _fail_plan(m, ids, plan, some, seen):
    """Report the plan's ops (`some` of them, or all) as failed, as an engine would."""
    if not len(plan.kind):
        return
    failure = m.transfers_failed(plan, some)
    seen["cut"] += len(failure.recompute_from)
    for r in failure.readmit:  # as the failure says (the driver admits it again later)
        m.remove_sequence(r, store_for_reuse=False)
        ids.remove(r)


def test_batched_queries_follow_rewinds_failed_transfers_and_returning_ids():
    """The batched queries against the scalar ones under what moves their inputs: rewinds and
    failed transfer plans (both move context positions and token counts back; a failure also
    sends requests to be admitted again), `set_context_position`, `add_tokens`, removals, and
    ids admitted again right after they left (another sequence, maybe another slot-table row,
    under the same id). The scheduler keeps one id list object for the whole run and edits it
    in place, as an engine does, so the queries see the same list unchanged (cached rows),
    reordered and changed. After every operation the answers agree and `verify_integrity`
    holds. (This driver found the narrow-window store crash in test_store_paths.py.)"""
    rng = random.Random(20261202)
    seen: Counter = Counter()
    for c in range(40):
        cfg = _random_config(rng)
        m = KVCacheManager(cfg)
        ids: list = []  # the scheduler's list: one object, edited in place
        names = [f"{c}-{i}" for i in range(6)]  # few names, so ids come back after removal
        for _ in range(70):
            op = rng.random()
            try:
                if op < 0.2:
                    free = [r for r in names if r not in ids]
                    if free:
                        rid = rng.choice(free)
                        m.add_sequence(_random_request(rng, rid, cfg))
                        ids.append(rid)
                        seen["admit"] += 1
                        if rng.random() < 0.5:  # its copies and onboards fail before the forward
                            _fail_plan(m, ids, m.take_transfers(), None, seen)
                elif op < 0.32 and ids:
                    m.remove_sequence(ids.pop(rng.randrange(len(ids))), store_for_reuse=rng.random() < 0.8)
                    seen["remove"] += 1
                elif op < 0.5 and ids:
                    m.add_tokens(ids, [_beam_token(m, cfg, rng, r) for r in ids])
                    seen["add_tokens"] += 1
                elif op < 0.62 and ids:
                    m.add_token(r := rng.choice(ids), _beam_token(m, cfg, rng, r))
                    if rng.random() < 0.4:  # every token computed (a recompute reported up to the end)
                        m.set_context_position(r, m._seq(r).num_tokens)
                    m.rewind(r, rng.randrange(1, 3))
                    seen["rewind"] += 1
                elif op < 0.66 and ids:  # the scheduler reorders its list in place: no ledger change
                    rng.shuffle(ids)
                elif op < 0.7 and len(ids) >= 2:  # two requests leave and come back before it asks again
                    pair = rng.sample(ids, 2)
                    for r in pair:
                        m.remove_sequence(r, store_for_reuse=rng.random() < 0.5)
                    for r in pair:
                        try:
                            m.add_sequence(_random_request(rng, r, cfg))
                        except (OutOfBlocksError, InvalidRequestError):
                            ids.remove(r)
                    seen["returned"] += 1
                elif op < 0.78 and ids:
                    m.set_context_position(rng.choice(ids), rng.randrange(8))
                    seen["context"] += 1
                elif op < 0.9:
                    plan = m.take_transfers()
                    if len(plan.kind) and rng.random() < 0.8:
                        _fail_plan(m, ids, plan, None if rng.random() < 0.5 else [rng.randrange(len(plan.kind))], seen)
                else:
                    m.store_new_blocks(ids)
            except (OutOfBlocksError, InvalidRequestError):  # a full pool, max_seq_len, a rewind past the drafts
                pass
            for w in cfg.windows:
                assert m.remaining_blocks_to_completion_many(ids, w).tolist() == [
                    m.remaining_blocks_to_completion(r, w) for r in ids
                ], (cfg, w)
                for look in (False, True):
                    assert m.needed_blocks_one_step_many(ids, look, w).tolist() == [
                        m.needed_blocks_one_step(r, look, w) for r in ids
                    ], (cfg, w, look)
            seen["checked"] += len(ids)
            m.verify_integrity()
    # every kind of change happened, failed transfers cut live requests back
    assert min(seen[k] for k in ("admit", "remove", "add_tokens", "rewind", "context", "returned")) > 40, seen
    assert seen["cut"] > 5 and seen["checked"] > 3000, seen
