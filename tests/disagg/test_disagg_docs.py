"""docs/disaggregation.md's usage example runs as written."""
from __future__ import annotations

import re

from disagg_helpers import ROOT


def test_usage_example_runs(capsys):
    text = (ROOT / "docs" / "disaggregation.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    exec(compile(code, "docs/disaggregation.md", "exec"), {"__name__": "docs_example"})
    assert "unpin req-1 pulled" in capsys.readouterr().out
