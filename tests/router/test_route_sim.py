"""A short seeded route simulation: KV-aware routing keeps conversations where their prefix is
cached (hit rate above round-robin and least-loaded, near a single replica holding all the
cache) without piling load on one replica; the router's index ends equal to every ledger."""
import numpy as np
import pytest
from kv_helpers import index_view, ledger_view, small_config

from kvjax.cli import main
from kvjax.engine.scheduler import SchedulerConfig
from kvjax.engine.workloads import ChatWorkload
from kvjax.router import make_policy
from kvjax.router.sim import TimeModel, TimeModelRunner, format_table, scaled, simulate, simulated_tokens

VOCAB = 512


@pytest.fixture(scope="module")
def setup():
    wl = ChatWorkload(users=18, turns=3, system_prompts=3, system_prompt_tokens=(48, 96), user_tokens=(8, 24),
                      max_new_tokens=(8, 16), arrival_interval=1, think_steps=4, tenants=2, seed=3)
    cfg = small_config(tokens_per_block=8, max_seq_len=512, primary_blocks=48, secondary_blocks=16)
    sched = SchedulerConfig(max_batch_size=4, max_num_tokens=128)
    return wl.build(VOCAB), cfg, sched


def run(setup, policy, replicas=3, inspect=None):
    items, cfg, sched = setup
    return simulate(items, replicas=replicas, policy=make_policy(policy), cache_config=cfg, scheduler=sched,
                    tick_s=0.01, vocab_size=VOCAB, inspect=inspect)


def test_kv_aware_beats_load_only_policies(setup):
    def same_as_ledgers(reps, router):
        for rep in reps:
            assert index_view(router.index, rep.rid, 1) == ledger_view(rep.ledger)
        assert all(load == 0 for load in router.loads.values())

    kv = run(setup, "kv-aware", inspect=same_as_ledgers)
    rr = run(setup, "round-robin")
    ll = run(setup, "least-loaded")
    items, cfg, sched = setup
    c1, s1, t1 = scaled(cfg, sched, TimeModel(), 3)
    ref = simulate(items, replicas=1, policy=make_policy("round-robin"), cache_config=c1, scheduler=s1, time_model=t1,
                   tick_s=0.01, vocab_size=VOCAB, label="single")
    print(format_table([kv, rr, ll], ref))
    assert kv.requests == rr.requests == len(items) == 54 and sum(kv.routed) == 54
    assert kv.hit_rate > rr.hit_rate + 0.1 and kv.hit_rate > ll.hit_rate + 0.1
    assert kv.hit_rate >= 0.85 * ref.hit_rate
    assert kv.imbalance < 1.5 and max(kv.routed) <= 2 * min(kv.routed)
    assert kv.wire_batches > 0 and kv.predicted_tokens > 0
    assert all(t > 0 for t in kv.ttft_s) and kv.ttft_p99_s >= kv.ttft_p50_s
    assert rr.routed == (18, 18, 18)
    assert ref.replicas == 1 and ref.routed == (54,)


def test_deterministic(setup):
    a, b = run(setup, "kv-aware"), run(setup, "kv-aware")
    assert a.summary() == b.summary()


def test_simulated_tokens_are_seeded_and_avoid_eos():
    seeds, idx = np.full(200, 7), np.arange(200)
    toks = simulated_tokens(seeds, idx, 8, avoid=(3,))
    assert len(toks) == 200 and 3 not in toks and all(1 <= t < 8 for t in toks)
    assert len(set(toks.tolist())) == 6  # every other token of [1, 8) appears
    assert (toks == simulated_tokens(seeds, idx, 8, avoid=(3,))).all()
    assert (toks != simulated_tokens(seeds + 1, idx, 8, avoid=(3,))).any()
    # a token depends on its request and index only, not on the batch it is drawn in
    assert simulated_tokens([7], [5], 8, (3,))[0] == toks[5]


def test_replicas_are_engine_cores_over_a_time_model(setup):
    def inside(reps, router):
        for rep in reps:
            assert isinstance(rep.core.engine.runner, TimeModelRunner) and rep.core.pools is None
            assert rep.core.engine.runner.forwards > 0 and rep.core.step_index >= rep.steps > 0

    run(setup, "kv-aware", inspect=inside)


def test_bad_arguments(setup):
    items, cfg, sched = setup
    with pytest.raises(ValueError, match="replicas"):
        simulate(items, replicas=0, policy=make_policy("kv-aware"), cache_config=cfg, scheduler=sched, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="TimeModel"):
        TimeModel(step_s=-1)


def test_cli_route_sim(tmp_path, capsys):
    code = main(["route-sim", "--workload", "chat", "--replicas", "2", "--set", "users=3", "--set", "turns=2",
                 "--set", "max_new_tokens=4", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "kv-aware" in out and "round-robin" in out and "least-loaded" in out and "single x2" in out
    assert (tmp_path / "route-sim-chat.json").is_file() and (tmp_path / "route-sim-chat.png").is_file()
    assert main(["route-sim", "--workload", "chat", "--policies", "random"]) == 2
    assert "--policies must name" in capsys.readouterr().err
    assert main(["route-sim", "--workload", "chat", "--tick-s", "0"]) == 2
