"""The README's Layout section lists every module of kvjax and pallas_kernels, under its package:
a reader can find any file from the map, and a module added without a line there fails here."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = re.compile(r"^( *)([A-Za-z_]\w*)/(?:\s|$)")
MODULE = re.compile(r"\b([A-Za-z_]\w*)\.py\b")


def layout_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1].splitlines()[1:]


def listed_modules() -> set[str]:
    """`pkg/sub/name.py` for every name under its package header (indentation gives the nesting;
    a line indented like a header but naming no folder belongs to the enclosing package)."""
    out: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder)
    for line in layout_block():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        m = HEADER.match(line)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if m:
            stack.append((indent, m.group(2)))
            rest = line[m.end():]
        else:
            rest = line
        folder = "/".join(f for _, f in stack)
        if folder.split("/")[0] in ("kvjax", "pallas_kernels"):
            out.update(f"{folder}/{name}.py" for name in MODULE.findall(rest) if name != "__init__")
    return out


def package_modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for top in ("kvjax", "pallas_kernels") for p in (ROOT / top).rglob("*.py")
            if p.name != "__init__.py"}


def test_readme_layout_lists_every_module():
    missing = sorted(package_modules() - listed_modules())
    assert not missing, f"README Layout does not list: {missing}"


def test_readme_layout_lists_no_module_that_does_not_exist():
    stale = sorted(listed_modules() - package_modules())
    assert not stale, f"README Layout lists modules that do not exist: {stale}"
