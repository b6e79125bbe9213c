"""Code, tests and docs cite only what users have: no issue numbers of a tracker they cannot see,
no sections of design notes that are not in the repository."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATTERN = re.compile(r"\bissue \d+|SPEC §|\btrtllm\.md\b|\bvllm_sglang\.md\b|\.\./shared\b|shared/reference")


def test_no_references_to_documents_users_do_not_have():
    hits = []
    for top in ("kvjax", "pallas_kernels", "tests", "benchmarks", "docs", "README.md"):
        paths = [ROOT / top] if top.endswith(".md") else sorted((ROOT / top).rglob("*"))
        for p in paths:
            if p.suffix not in (".py", ".md", ".sh", ".toml") or p == Path(__file__):
                continue
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if PATTERN.search(line):
                    hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)
