"""docs/device.md's python blocks run, in order, in one namespace: the documented scan
pattern, step inputs and checked mode are real code."""
import os
import re

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "device.md")


def test_device_doc_examples_run(capsys):
    text = open(DOC).read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 4
    ns: dict = {}
    for block in blocks:
        exec(compile(block, DOC, "exec"), ns)  # noqa: S102 - our own documentation
    out = capsys.readouterr().out
    assert "(2, 2, 4)" in out and "[-1  4 20 21]" in out and "reported: gather_kv" in out and "True" in out
    assert ns["y"].shape == (2, 2, ns["D"])
