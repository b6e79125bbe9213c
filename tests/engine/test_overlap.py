"""Host/device overlap (`EngineConfig.async_scheduling`, kvjax/engine/overlap.py) never changes
what a request gets: seeded randomized serving runs of the micro model, served serially and
overlapped, give the same tokens, finish reasons and stop reasons, through stop tokens,
`max_new_tokens`, aborts, n > 1 (held completions), sampling with temperature, preemption
(MAX_UTILIZATION on tight pools), prefix reuse and reuse off; stop strings through `LLMEngine`.
Each run ends with an idle, consistent ledger (`verify_idle`, `verify_integrity` on the way),
a request that stopped wasted at most one row, and every step with work ran one forward (the
one-forward-per-step engine's guarantee holds overlapped)."""
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import ROOMY, TIGHT, cache, engine_config

from kvjax import SamplingParams, Tokenizer
from kvjax.engine import Engine, LLMEngine, SchedulerPolicy, WorkItem, padding_step
from kvjax.engine.batching import TOK_ID, StepShape, TokenFeed
from kvjax.engine.runner import _feed_tokens
from kvjax.errors import InvalidArgumentError

GNE, MAX_UTIL = SchedulerPolicy.GUARANTEED_NO_EVICT, SchedulerPolicy.MAX_UTILIZATION
SHARED = np.random.default_rng(99).integers(1, 500, 40).tolist()  # prefixes the requests share


def _core(micro, overlap, policy, primary, reuse=True):
    cfg = dataclasses.replace(engine_config(policy), async_scheduling=overlap)
    return Engine(micro.model, cfg, runner=micro.runner).core(cache(micro.model, primary=primary, reuse=reuse))


def _plan(seed, n=7):
    """Requests: (id, prompt, max_new, temperature, arrival call, abort after k tokens or None,
    completions). Prompts start with a shared prefix of 0, 16 or 33 tokens (whole and partial
    blocks of reuse)."""
    rng = np.random.default_rng(seed)
    plan = []
    for i in range(n):
        share = int(rng.choice([0, 16, 33]))
        prompt = SHARED[:share] + rng.integers(1, 500, int(rng.integers(3, 20))).tolist()
        temp = float(rng.choice([0.0, 0.0, 0.8]))
        abort = int(rng.integers(1, 4)) if i % 3 == 1 else None  # (these draw no stop token)
        max_new = int(rng.integers(1, 9)) if abort is None else abort + 3
        plan.append((f"r{i}", prompt, max_new, temp, int(rng.integers(0, 6)), abort, 2 if i % 4 == 2 else 1))
    return plan


def _serve(micro, overlap, plan, stops, policy=GNE, primary=ROOMY, reuse=True):
    """Serve `plan` on a fresh core; per completion (tokens, finish reason, stop reason), and the core."""
    core = _core(micro, overlap, policy, primary, reuse)
    got: dict[str, list[int]] = {}
    live = {}
    call = 0
    todo = sorted(plan, key=lambda p: p[4])
    while todo or core.has_unfinished_requests():
        while todo and todo[0][4] <= call:
            rid, prompt, max_new, temp, _, abort, n = todo.pop(0)
            parent = None
            for c in range(n):
                cid = rid if c == 0 else f"{rid}.{c}"
                item = WorkItem(cid, tuple(prompt), max_new, sampling=SamplingParams(temperature=temp, max_tokens=max_new))
                r = core.add_request(item, prompt, seed=7 * len(live) + 1, stop_token_ids=stops.get(cid, frozenset()),
                                     after=parent)
                parent = parent or r
                live[cid] = (r, abort)
                got[cid] = []
        before, shapes = micro.runner.num_forwards, set(micro.runner.shapes)
        outs = core.step()
        last = core.last_step  # one forward for a step with work (the dispatched one, overlapped), of a listed shape
        assert micro.runner.num_forwards - before == (1 if last.decode_rows or last.prefill_tokens else 0)
        assert micro.runner.shapes - shapes <= set(core.forward_shapes)
        for out in outs:
            assert not got[out.request_id] or not out.new_token_ids or live[out.request_id][0].finish_reason is None \
                or out.finished
            got[out.request_id] += out.new_token_ids
        for cid, (r, abort) in live.items():  # an abort once it has k tokens (same point in both modes)
            if abort is not None and r.finish_reason is None and len(r.output) >= abort:
                assert core.abort_request(cid) is not None
        if call % 3 == 0:
            core.ledger.verify_integrity()
        call += 1
    core.verify_idle()
    for cid, (r, _) in live.items():
        assert got[cid] == r.output
        assert r.wasted_rows <= 1, f"{cid} wasted {r.wasted_rows} rows"
        if r.finish_reason == "length":
            assert r.wasted_rows == 0  # its last token was known to be its last: never scheduled again
    return {cid: (r.output, r.finish_reason, r.stop_reason) for cid, (r, _) in live.items()}, core


@pytest.mark.parametrize("model, policy, primary, reuse, seed", [
    ("micro", GNE, ROOMY, True, 1),
    ("micro", MAX_UTIL, TIGHT, True, 2),  # pauses and resumes
    ("micro", GNE, ROOMY, False, 3),
    ("micro_swa", GNE, ROOMY, True, 4),  # a sliding window: pending positions next to detaches
])
def test_overlap_matches_serial(request, model, policy, primary, reuse, seed):
    micro = request.getfixturevalue(model)
    plan = _plan(seed)
    free, _ = _serve(micro, False, plan, {}, policy, primary, reuse)
    # stop tokens the model does generate: each drawn completion stops at one of its own tokens
    rng = np.random.default_rng(seed)
    aborted = {p[0] for p in plan if p[5] is not None}
    stops = {cid: frozenset({out[int(rng.integers(0, len(out)))]}) for cid, (out, *_) in free.items()
             if len(out) > 1 and rng.random() < 0.6 and cid.split(".")[0] not in aborted}
    serial, sc = _serve(micro, False, plan, stops, policy, primary, reuse)
    overlapped, oc = _serve(micro, True, plan, stops, policy, primary, reuse)
    assert serial == overlapped
    reasons = {v[1] for v in serial.values()}
    assert {"stop", "length", "abort"} <= reasons, reasons
    assert sc.counters.overlapped_steps == 0 and oc.counters.overlapped_steps > 5
    assert oc.counters.wasted_rows > 0  # some stops happened with a row in flight
    assert sc.counters.generated_tokens == oc.counters.generated_tokens
    assert oc.counters.finished == sc.counters.finished


def test_preemption_with_tokens_in_flight(micro):
    """MAX_UTILIZATION on tight pools with four long requests: requests are paused while their
    token is in flight (it joins their output when it arrives, before their re-admission); the
    tokens equal the serial run's, and no request wastes a row (none stops early)."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 500, 40).tolist() for _ in range(4)]

    def run(overlap):
        core = _core(micro, overlap, MAX_UTIL, TIGHT)
        reqs = [core.add_request(WorkItem(f"p{i}", tuple(p), 30), p, seed=i) for i, p in enumerate(prompts)]
        paused = 0
        while core.has_unfinished_requests():
            core.step()
            paused += core.last_step.paused
            if core.step_index % 4 == 0:
                core.ledger.verify_integrity()
        core.verify_idle()
        return {r.request_id: r.output for r in reqs}, paused, reqs

    serial, serial_pauses, _ = run(False)
    overlapped, pauses, reqs = run(True)
    assert serial == overlapped
    assert serial_pauses > 0 and pauses > 0
    assert all(r.wasted_rows == 0 for r in reqs)


def test_stop_strings_and_n_through_llm_engine(micro):
    """Stop strings (found by LLMEngine one step late in overlap: the request is aborted with its
    row of the next step in flight), n = 2 sampled completions, logprobs and prompt logprobs
    (read with the tokens, a step late): same texts, tokens and logprobs."""
    tok = Tokenizer.builtin(micro.model.spec.vocab_size)

    def run(overlap, stop):
        cfg = dataclasses.replace(engine_config(), async_scheduling=overlap)
        eng = LLMEngine(Engine(micro.model, cfg, runner=micro.runner), cache(micro.model), tokenizer=tok)
        rng = np.random.default_rng(5)
        for i in range(4):
            p = SHARED[: 8 * i] + rng.integers(1, 500, 6).tolist()
            eng.add_request(f"g{i}", p, SamplingParams(max_tokens=14, stop=stop.get(f"g{i}", ())))
        eng.add_request("n2", SHARED[:20], SamplingParams(max_tokens=9, n=2, temperature=1.0, seed=3))
        eng.add_request("lp", SHARED[:12], SamplingParams(max_tokens=5, logprobs=2, prompt_logprobs=1))
        final = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                final[out.request_id] = [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs)
                                         for o in out.outputs] + [out.prompt_logprobs]
        eng.core.verify_idle()
        return final, eng.core

    free, _ = run(False, {})
    stop = {}
    for rid in ("g0", "g1", "g2"):
        text = free[rid][0][1]
        j = next((j for j in range(2, len(text) - 3) if "\ufffd" not in text[j : j + 2]), None)
        if j is not None:
            stop[rid] = (text[j : j + 2],)
    assert len(stop) >= 2
    serial, _ = run(False, stop)
    overlapped, core = run(True, stop)
    assert serial == overlapped
    assert sum(out[0][2] == "stop" and isinstance(out[0][3], str) for out in serial.values()) >= 2
    assert core.counters.overlapped_steps > 5
    assert len(serial["n2"]) == 3 and serial["n2"][0][0] != serial["n2"][1][0]
    assert len(serial["lp"][0][4]) == 5 and serial["lp"][1] is not None  # logprobs and prompt logprobs came


def test_penalties_fall_back_to_synchronous_steps(micro):
    """A live request with penalties needs every earlier token on the host: while it lives the
    steps are synchronous (no step dispatched before the previous one was read), before and
    after it they overlap again; tokens equal the serial run's."""

    def run(overlap):
        core = _core(micro, overlap, GNE, ROOMY)
        rng = np.random.default_rng(8)
        reqs = [core.add_request(WorkItem(f"a{i}", tuple(p), 12), p, seed=i)
                for i, p in enumerate(rng.integers(1, 500, (2, 9)).tolist())]
        trace = []
        for _ in range(6):
            core.step()
            trace.append(core.counters.overlapped_steps)
        pen = SamplingParams(max_tokens=5, presence_penalty=1.5, repetition_penalty=1.3)
        p = rng.integers(1, 500, 7).tolist()
        reqs.append(core.add_request(WorkItem("pen", tuple(p), 5, sampling=pen), p, seed=9))
        while core.has_unfinished_requests():
            core.step()
            trace.append(core.counters.overlapped_steps)
        core.verify_idle()
        return {r.request_id: r.output for r in reqs}, trace, reqs[-1]

    serial, _, _ = run(False)
    overlapped, trace, pen = run(True)
    assert serial == overlapped
    assert trace[5] > 0  # overlapped before the penalized request came
    # from its arrival (a drain, then synchronous steps) to its finish: no overlapped step
    assert trace[6] == trace[5] and trace[6 + pen.finish_step - pen.arrival_step - 1] == trace[5]


@pytest.mark.parametrize("jit", [False, True])
def test_feed_tokens_writes_the_decode_rows_ids(jit):
    """`_feed_tokens`: a fed decode row's `TOK_ID` comes from the earlier step's device tokens;
    other decode rows, every prefill token and every other column keep theirs."""
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(6, 4)  # [N, 2 + W]: Bd = 3 decode tokens, then a prefill row
    prev = jnp.array([100, 101, 102, 103, 104], jnp.int32)  # [R']: an earlier step's tokens, padding included
    index = jnp.array([4, -1, 0], jnp.int32)  # [Bd]
    fn = jax.jit(_feed_tokens) if jit else _feed_tokens
    out = fn(tokens, prev, index)
    chex.assert_shape(out, (6, 4))
    want = np.arange(24, dtype=np.int32).reshape(6, 4)
    want[0, TOK_ID], want[2, TOK_ID] = 104, 100
    chex.assert_trees_all_close(out, jnp.asarray(want))


def test_feed_compiles_once_per_shape():
    fn = jax.jit(chex.assert_max_traces(_feed_tokens, n=1))
    tokens = jnp.zeros((6, 3), jnp.int32)  # [N, 2 + W]
    for k in range(3):
        out = fn(tokens, jnp.full((5,), k + 1, jnp.int32), jnp.array([0, 1, -1, 2], jnp.int32))
        chex.assert_trees_all_close(out[:4, TOK_ID], jnp.array([k + 1, k + 1, 0, k + 1], jnp.int32))


def test_feed_index_pads_to_the_decode_group(micro):
    """`TokenFeed.device_index`: the real decode rows' places, -1 for the bucket's padding rows;
    more fed rows than the batch has decode rows is refused."""
    batch = padding_step(StepShape(4, 1, 16, 8), cache(micro.model))
    batch = dataclasses.replace(batch, num_decode=3)
    feed = TokenFeed(None, np.array([5, -1, 2], np.int32))
    np.testing.assert_array_equal(feed.device_index(batch), [5, -1, 2, -1])
    with pytest.raises(InvalidArgumentError, match="feed"):
        TokenFeed(None, np.arange(4, dtype=np.int32)).device_index(batch)


def test_overlap_keeps_one_forward_per_step_and_never_recompiles(micro):
    """Served overlapped twice: one forward per step with work (as `_serve` checks), and the
    second run, whose decode rows take their tokens from the device (`num_feeds`), compiles no
    step program: the feed is its own small op, the step program the synchronous one."""
    plan = _plan(1)
    _serve(micro, True, plan, {})
    traces, feeds = micro.runner.num_traces, micro.runner.num_feeds
    _serve(micro, True, plan, {})
    assert micro.runner.num_traces == traces
    assert micro.runner.num_feeds > feeds


def test_switch_validation():
    from kvjax.engine import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=1)  # type: ignore[arg-type]
    assert EngineConfig.from_dict({"async_scheduling": True}).async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig.from_dict({"async_scheduling": "yes"})


@pytest.mark.parametrize("overlap", [False, True])
def test_an_unread_chunk_is_never_cached(micro, overlap):
    """A request aborted while its first prefill chunk is dispatched but not read (overlap)
    leaves nothing of that chunk in the cache; served serially the chunk was read, and cached."""
    from kvjax import Request

    core = _core(micro, overlap, GNE, ROOMY)
    prompt = np.random.default_rng(6).integers(1, 500, 100).tolist()  # chunks of 64 + 36 tokens
    core.add_request(WorkItem("long", tuple(prompt), 4), prompt, seed=1)
    core.step()
    assert core.running["long"].context_pos == 64
    core.abort_request("long")
    while core.has_unfinished_requests():
        core.step()
    core.verify_idle()
    cached = core.ledger.analyze_prefix_reuse(Request("probe", prompt, 4)).total_matched_tokens
    assert cached == (0 if overlap else 64)


def test_reset_prefix_cache_after_the_last_request(micro):
    """With overlap the last step's wasted rows may still be in flight when the last request
    finished: a prefix-cache reset reads and drops them instead of refusing."""
    core = _core(micro, True, GNE, ROOMY)
    prompt = SHARED[:30]
    core.add_request(WorkItem("a", tuple(prompt), 3), prompt, seed=1, stop_token_ids=frozenset(range(512)))
    while core.has_unfinished_requests() and not core.counters.finished["stop"]:
        core.step()
    assert core.has_unfinished_requests() and not core.num_running  # the wasted row is in flight
    assert core.reset_prefix_cache() > 0
    core.verify_idle()
    assert core.counters.wasted_rows == 1
