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


README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_using_it_runs(capsys):
    """README's "Using it" sketch is a complete program: ledger, pools, prefill, decode, reuse."""
    text = open(README).read()
    section = text[text.index("## Using it"):]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    ns: dict = {}
    exec(compile(block, README, "exec"), ns)  # noqa: S102 - our own documentation
    assert capsys.readouterr().out == "r2 reuses 40 of 42 prompt tokens\n"
    assert ns["out"].shape == (1, 1, 4, 64)
    ns["ledger"].verify_integrity()
