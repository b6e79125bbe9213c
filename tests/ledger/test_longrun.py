"""A short seeded slice of benchmarks/ledger_longrun.py (the issue's long adversarial run):
every configuration family once, failed transfers, bad calls, slot-content checks after every
admission and forward; and its steady-workload memory check."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import ledger_longrun  # noqa: E402


def test_long_run_slice_has_no_violations():
    run = ledger_longrun.LongRun(seed=1, fail_rate=0.1)
    run.run(1000 * len(ledger_longrun.families(4)), episode_ops=1000)
    assert dict(run.violations) == {}, run.examples
    assert run.episodes >= len(ledger_longrun.families(4))  # every configuration family ran
    assert run.failures > 10 and run.bad_calls > 100 and run.recomputed > 0
    assert run.batched_steps > 100 and run.batched_refused > 0  # add_tokens, and its atomic refusal


def test_memory_stays_flat_on_a_steady_workload():
    """What kvjax allocates after a warm-up stays put (was +9 bytes per operation here: the
    expiry heap and the dead tree runs)."""
    warm, mid, end = ledger_longrun.memory_run(seed=1, ops=8000)
    assert mid - warm < 0.032 and end - warm < 0.032, (warm, mid, end)


def test_the_driver_catches_a_wrong_block():
    """The content model is not vacuous: serve one request another's slot and it must notice."""
    run = ledger_longrun.LongRun(seed=2, fail_rate=0.0)
    fam = ledger_longrun.families(4)[0]
    ep = ledger_longrun.Episode(run, fam, seed=3)
    ep.pending_prefill = []
    real = ep.m.block_table
    pair = None
    for _ in range(20):  # two requests whose first blocks differ, one with KV written
        ep.admit(1)
        live = list(ep.live.values())
        pair = next(
            ((a, b) for a in live for b in live if a.computed and real([a.rid])[0, 0] != real([b.rid])[0, 0]), None
        )
        if pair is not None:
            break
    assert pair is not None
    a, b = pair

    def swapped(ids, window=None, **kw):  # b's first block served in a's table
        t = real(ids, window, **kw)
        if list(ids) == [a.rid]:
            t = t.copy()
            t[0, 0] = real([b.rid], window)[0, 0]
        return t

    ep.m.block_table = swapped
    try:
        ep.check_reads(a, a.computed, a.computed - 1, "probe")
    except ledger_longrun.Violation:
        return
    raise AssertionError("a slot holding another request's KV went unnoticed")
