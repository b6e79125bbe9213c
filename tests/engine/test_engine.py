"""The engine end to end on micro models: greedy tokens equal the dense oracle's with reuse on
and off, through eviction, offload/onboard, partial reuse, pausing and sliding windows; the
prefill accounting matches the ledger; a warmed-up engine never compiles again."""
import dataclasses

import numpy as np
import pytest
from engine_helpers import TIGHT, assert_same_tokens, cache, check_accounting

from kvjax.engine import ChatWorkload, FewShotWorkload, SchedulerPolicy, SharedSystemPromptWorkload, WorkItem
from kvjax.engine.batching import forward_shapes

GNE, MAX_UTIL = SchedulerPolicy.GUARANTEED_NO_EVICT, SchedulerPolicy.MAX_UTILIZATION

CHAT = ChatWorkload(
    users=4, turns=3, system_prompts=2, system_prompt_tokens=(36, 44), user_tokens=(4, 20),
    max_new_tokens=(4, 10), arrival_interval=1, think_steps=1, priority=80, seed=5,
)


@pytest.fixture(scope="module")
def chat_runs(micro):
    """The chat workload with reuse on, then off, on roomy pools."""
    items = CHAT.build(micro.model.spec.vocab_size)
    engine = micro.engine()
    on = engine.run(items, cache(micro.model, reuse=True), label="on")
    off = engine.run(items, cache(micro.model, reuse=False), label="off")
    return items, on, off


def test_chat_reuse_on_off_and_dense_agree(micro, chat_runs):
    items, on, off = chat_runs
    assert len(on.outputs) == len(items) == 12
    assert_same_tokens(on.outputs, off.outputs)
    assert_same_tokens(on.outputs, micro.dense(on))
    assert on.prompts == off.prompts
    # follow-up turns carry the whole conversation: prompt(t) = prompt(t-1) + answer(t-1) + message
    for it in items:
        if it.parent is not None:
            parent = on.prompts[it.parent] + on.outputs[it.parent]
            assert on.prompts[it.request_id] == parent + list(it.tokens)
    assert len({tuple(v) for v in on.outputs.values()}) > 1  # outputs depend on the context


def test_chat_accounting(chat_runs):
    _, on, off = chat_runs
    for res in (on, off):
        check_accounting(res)
    s_on, s_off = on.metrics.summary(), off.metrics.summary()
    assert s_off["prefill_reused_tokens"] == 0 and s_off["block_hit_rate"] == 0.0
    assert s_on["prefill_reused_tokens"] > 0.5 * s_on["prompt_tokens"]  # turns reuse the conversation
    # reuse saves exactly the reused tokens (no pauses under GNE: nothing is recomputed)
    assert s_off["prefill_computed_tokens"] - s_on["prefill_computed_tokens"] == s_on["prefill_reused_tokens"]
    assert s_on["pauses"] == s_off["pauses"] == 0
    assert s_on["blocks_reused_partially"] > 0  # answers end mid-block: the next turn reuses them partially


def test_no_recompiles_in_steady_state(micro, chat_runs):
    items, _, _ = chat_runs
    engine = micro.engine()
    shapes = set(micro.runner.shapes)
    again = engine.run(items, cache(micro.model, reuse=True))
    assert again.metrics.compilations == 0
    assert again.metrics.compile_s == 0.0  # no jit at all compiled: forwards, transfers, sampling
    assert micro.runner.shapes == shapes
    # bucketed shapes only: decode rows 0 / 4, prefill 0 or one row of 16 / 32 / 64 tokens, one table width
    for bd, bp, t, mb in shapes:
        assert mb == 32 and bd in (0, 4) and (bp, t) in ((0, 0), (1, 16), (1, 32), (1, 64)) and bd + bp > 0
    assert shapes <= set(forward_shapes(engine.config, cache(micro.model)))


def test_eviction_offload_onboard_with_tiny_pools(micro):
    items = dataclasses.replace(CHAT, users=6, seed=7).build(micro.model.spec.vocab_size)
    engine = micro.engine()
    on = engine.run(items, cache(micro.model, primary=TIGHT, reuse=True))
    off = engine.run(items, cache(micro.model, primary=TIGHT, reuse=False))
    s = on.metrics.summary()
    assert s["blocks_offloaded"] > 0 and s["blocks_onboarded"] > 0
    assert s["peak_blocks_in_use"] <= TIGHT
    assert_same_tokens(on.outputs, off.outputs)
    assert_same_tokens(on.outputs, micro.dense(on))
    check_accounting(on)
    check_accounting(off)


def test_eviction_below_the_offload_priority(micro):
    """Victims below `secondary_offload_min_priority` are dropped, not offloaded."""
    items = dataclasses.replace(CHAT, users=6, seed=7).build(micro.model.spec.vocab_size)
    res = micro.engine().run(items, cache(micro.model, primary=TIGHT, secondary_offload_min_priority=101))
    s = res.metrics.summary()
    assert s["blocks_evicted"] > 0 and s["blocks_offloaded"] == 0
    assert_same_tokens(res.outputs, micro.dense(res))
    check_accounting(res)


def test_partial_reuse_copies(micro):
    """Few-shot prompts nest (k examples of one task), so a prompt often matches part of a block
    that a longer prompt extended: the block is not a leaf and is copied."""
    wl = FewShotWorkload(requests=12, tasks=2, instruction_tokens=12, example_tokens=(6, 14), shots=(1, 4),
                         query_tokens=(3, 8), max_new_tokens=(3, 6), arrival_interval=2, seed=3)
    items = wl.build(micro.model.spec.vocab_size)
    engine = micro.engine()
    on = engine.run(items, cache(micro.model))
    off = engine.run(items, cache(micro.model, reuse=False))
    s = on.metrics.summary()
    assert s["blocks_copied"] > 0 and s["blocks_reused_partially"] > 0
    assert_same_tokens(on.outputs, off.outputs)
    assert_same_tokens(on.outputs, micro.dense(on))
    check_accounting(on)


def test_max_utilization_pauses_and_resumes(micro):
    """Max-utilisation admits on next-step needs; decode growth runs the tiny pool dry, the
    newest generating request is paused (blocks stored) and resumed with reuse."""
    wl = SharedSystemPromptWorkload(requests=8, system_prompts=2, system_prompt_tokens=(40, 40), user_tokens=(4, 12),
                                    max_new_tokens=(20, 28), arrival_interval=0, seed=11)
    items = wl.build(micro.model.spec.vocab_size)
    mu = micro.engine(MAX_UTIL).run(items, cache(micro.model, primary=TIGHT))
    gne = micro.engine(GNE).run(items, cache(micro.model, primary=TIGHT))
    s_mu, s_gne = mu.metrics.summary(), gne.metrics.summary()
    assert s_mu["pauses"] > 0 and s_gne["pauses"] == 0
    assert any(r.pauses for r in mu.metrics.requests)
    # resumed requests recompute only what was evicted meanwhile
    resumed = [r for r in mu.metrics.requests if r.pauses]
    assert sum(r.reused_tokens for r in resumed) > 0
    assert s_mu["admitted_prompt_tokens"] > s_mu["prompt_tokens"]
    assert_same_tokens(mu.outputs, gne.outputs)
    assert_same_tokens(mu.outputs, micro.dense(mu))
    check_accounting(mu)
    check_accounting(gne)


def test_sliding_window_model(micro_swa):
    """Layer 0 sees 32 tokens: conversations outgrow it, front blocks become placeholders, and
    reuse needs a safe prefix; tokens still equal the dense oracle's."""
    items = dataclasses.replace(CHAT, users=3, seed=9).build(micro_swa.model.spec.vocab_size)
    engine = micro_swa.engine()
    on = engine.run(items, cache(micro_swa.model))
    off = engine.run(items, cache(micro_swa.model, reuse=False))
    assert on.ledger.windows == (32, 256)
    assert max(len(p) for p in on.prompts.values()) > 64
    assert_same_tokens(on.outputs, off.outputs)
    assert_same_tokens(on.outputs, micro_swa.dense(on))
    assert on.metrics.summary()["prefill_reused_tokens"] > 0
    check_accounting(on)
    check_accounting(off)


def test_a_window_narrower_than_a_block(micro_narrow):
    """Layer 0 sees 5 tokens, fewer than a block holds (8): the ledger releases each of its
    blocks a few tokens after it fills. With reuse on and off the tokens equal the dense
    oracle's."""
    items = dataclasses.replace(CHAT, users=3, seed=9).build(micro_narrow.model.spec.vocab_size)
    engine = micro_narrow.engine()
    on = engine.run(items, cache(micro_narrow.model))
    off = engine.run(items, cache(micro_narrow.model, reuse=False))
    assert on.ledger.windows == (5, 256)
    assert_same_tokens(on.outputs, off.outputs)
    assert_same_tokens(on.outputs, micro_narrow.dense(on))
    assert on.metrics.summary()["prefill_reused_tokens"] > 0
    check_accounting(on)
    check_accounting(off)


def test_eos_and_beam_width_one(micro):
    """A request stops at its EOS token (included); the ledger sees beam width 1 requests."""
    vocab = micro.model.spec.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, n).tolist() for n in (21, 30, 9)]
    free = micro.engine().run([WorkItem(f"p{i}", tuple(p), 12) for i, p in enumerate(prompts)], cache(micro.model))
    eos = free.outputs["p0"][3]  # a token p0 generates: with it as EOS, p0 stops there
    items = [WorkItem(f"p{i}", tuple(p), 12, eos_id=eos) for i, p in enumerate(prompts)]
    res = micro.engine().run(items, cache(micro.model))
    assert res.outputs["p0"] == free.outputs["p0"][: free.outputs["p0"].index(eos) + 1]
    assert_same_tokens(res.outputs, micro.dense(res, eos_id=eos))
    assert res.ledger.config.max_beam_width == 1  # the engine decodes one beam (width 1)
    check_accounting(res)


def test_sampling_is_identical_with_and_without_reuse(micro):
    items = [dataclasses.replace(it, sampling=dataclasses.replace(it.sampling, temperature=0.8, top_p=0.9, seed=4))
             for it in dataclasses.replace(CHAT, users=2).build(micro.model.spec.vocab_size)]
    engine = micro.engine()
    on = engine.run(items, cache(micro.model))
    off = engine.run(items, cache(micro.model, reuse=False))
    assert_same_tokens(on.outputs, off.outputs)
    greedy = micro.dense(on)
    assert any(on.outputs[k] != greedy[k] for k in on.outputs)  # it really sampled


def test_request_too_long_is_rejected(micro):
    too_long = [WorkItem("x", tuple(range(1, 250)), 10)]
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        micro.engine().run(too_long, cache(micro.model))
    wide = [WorkItem("y", tuple(range(1, 200)), 10)]
    with pytest.raises(ValueError, match=f"needs 27 blocks in window 256 but the cache has {TIGHT}"):
        micro.engine().run(wide, cache(micro.model, primary=TIGHT))


def test_a_decode_batch_without_blocks_falls_back_row_by_row(micro, chat_runs, monkeypatch):
    """When the step's batched `add_tokens` finds no block for some row (it changes nothing),
    the engine adds the tokens row by row: same tokens, and the requests' tokens stay in the
    ledger's token store (a per-row `add_token` would move each back to a list, and the next
    batched step move it into the store again)."""
    from kvjax import KVCacheManager
    from kvjax.errors import OutOfBlocksError
    from kvjax.ledger.sequence import TrackedSequence

    items, on, _ = chat_runs
    real_add_tokens, real_to_list = KVCacheManager.add_tokens, TrackedSequence.to_list
    calls, forced, moved_back = [0], [0], []

    def add_tokens(self, request_ids, tokens):
        calls[0] += 1
        if len(request_ids) > 1 and calls[0] % 3 == 0:
            forced[0] += 1
            raise OutOfBlocksError("forced by the test (nothing changed)")
        return real_add_tokens(self, request_ids, tokens)

    def to_list(self):
        moved_back.append(self.request_id)
        return real_to_list(self)

    monkeypatch.setattr(KVCacheManager, "add_tokens", add_tokens)
    monkeypatch.setattr(TrackedSequence, "to_list", to_list)
    res = micro.engine().run(items, cache(micro.model, reuse=True))
    assert forced[0] > 5
    assert_same_tokens(res.outputs, on.outputs)
    assert moved_back == []
    check_accounting(res)
