"""benchmarks/ledger_scale.py at toy sizes, so the scale benchmark keeps running: every section
measures, checks its own workload (no eviction in the fill, one partial match per admission,
Stored events published) and reports each figure against its target."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import ledger_scale  # noqa: E402


def test_quick_scale_run_reports_every_target(capsys):
    args = ["--quick", "--blocks", "3000", "--siblings", "300", "--batch", "16", "--event-requests", "4"]
    results = ledger_scale.main(args)
    assert set(results) == set(ledger_scale.SECTIONS)
    mem = results["memory"]
    assert mem["cached_blocks"] > 2000 and mem["free_bytes_per_block"] > 0 and mem["cached_bytes_per_block"] > 0
    assert results["partial"]["siblings"] == 300 and results["events"]["stored_blocks"] > 0
    printed = capsys.readouterr().out
    for key in ledger_scale.TARGETS:
        assert f"target <= {ledger_scale.TARGETS[key]:g}" in printed
