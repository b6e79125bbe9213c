"""kvjax's layering, checked on its source: no import circles between modules, no module reading
another module's private (underscore) attributes, one exception base, and a ledger without JAX.

The import graph is built from the AST of every module under kvjax/, counting every import
statement wherever it stands: at the top, inside a function (a lazy import still makes the two
modules depend on each other at run time) and under `if TYPE_CHECKING:` (an annotation naming
the facade is a dependency of the design even if Python never runs it: a circle through it is
the circle this test exists to catch). `from pkg import name` is an edge to the submodule
`pkg.name` when there is one, else to `pkg`. Importing `a.b.c` also runs `a/__init__` and
`a/b/__init__`; those implicit edges are left out (every module would otherwise sit in a circle
with its package's `__init__`, which re-exports it).
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pathlib
import pkgutil
from collections import defaultdict

import kvjax
from kvjax.errors import KVCacheError

ROOT = pathlib.Path(kvjax.__file__).resolve().parent
PREFIX = "kvjax"

# `obj._name` reads allowed although `_name` is not defined in the reading module:
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}  # public despite the underscore
ALLOWED_PRIVATE_READS: set[tuple[str, str]] = {
    # (reading module, attribute): each with why the owner offers no public way
    # jax.experimental.transfer has no public way to end a pull that will never complete: the
    # P/D transport ends its own stuck pulls at kvjax's deadlines with the connection's poison
    ("kvjax.disagg.consumer", "_poison_connection"),
    ("kvjax.disagg.producer", "_poison_connection"),
    # kvjax/cli.py lists every subcommand's flags: argparse has no public way to reach them
    ("kvjax.cli", "_SubParsersAction"),
    ("kvjax.cli", "_option_string_actions"),
}
# import edges left out of the circle check, each with the module that owns the fix:
ALLOWED_IMPORT_EDGES: set[tuple[str, str]] = {
    # kvjax/kv_store/url.py loads the Redis store lazily by URL scheme, and the store imports
    # `redact` from it back; `redact` belongs in a module below both
    ("kvjax.kv_store.url", "kvjax.kv_store.redis_store"),
}


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def sources() -> dict[str, tuple[pathlib.Path, ast.Module]]:
    """Every module under kvjax/ by dotted name, parsed (once per test session)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        out[module_name(path)] = (path, ast.parse(path.read_text(), str(path)))
    return out


def import_nodes(tree: ast.AST, runtime_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree`; with `runtime_only`, not those under `if TYPE_CHECKING:`."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif runtime_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_edges(mods: dict[str, tuple[pathlib.Path, ast.Module]], runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the kvjax modules it imports (see the module docstring for what counts)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, (path, tree) in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in import_nodes(tree, runtime_only):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # `import kvjax.a.b` of a name inside a module
                    t = t.rpartition(".")[0]
                if t.startswith(PREFIX) and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [m0, m1, ..., m0], or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle_between_kvjax_modules():
    mods = sources()
    graph = import_edges(mods)
    assert graph["kvjax.ledger.kv_cache_manager"]  # the graph is really built
    for src, dst in ALLOWED_IMPORT_EDGES:
        assert dst in graph[src], f"allowed edge {src} -> {dst} is gone: drop it from the list"
        graph[src].discard(dst)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_find_cycle_reports_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def defined_private_names(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, attributes it assigns (on any
    object), class-body names, `__slots__` entries and module-level names."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            out.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def private_reads(mods: dict[str, tuple[pathlib.Path, ast.Module]]) -> list[tuple[str, int, str]]:
    """(module, line, `obj._name`) for every read of an underscore attribute on anything but
    `self`/`cls` whose name the reading module does not define itself (so a class reading its
    own attribute of another instance, `other._x`, passes)."""
    out = []
    for name, (_path, tree) in mods.items():
        own = defined_private_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
                continue
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr in own or attr in NAMEDTUPLE_API:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if (name, attr) in ALLOWED_PRIVATE_READS:
                continue
            out.append((name, node.lineno, f"{ast.unparse(node.value)}.{attr}"))
    return out


def test_no_module_reads_another_modules_private_attributes():
    bad = private_reads(sources())
    assert not bad, "\n".join(f"{m}:{line}: {expr}" for m, line, expr in bad)


def private_imports(mods: dict[str, tuple[pathlib.Path, ast.Module]]) -> list[tuple[str, int, str]]:
    """(module, line, `from m import _name`) for every underscore name imported from another kvjax
    module; a package's private helper module (`kvjax.device._checks`) may be imported inside
    its own package."""
    out = []
    for name, (_path, tree) in mods.items():
        package = name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(PREFIX):
                continue
            for alias in node.names:
                if not alias.name.startswith("_") or alias.name.startswith("__"):
                    continue
                if f"{node.module}.{alias.name}" in mods and node.module == package:  # a private submodule, same package
                    continue
                out.append((name, node.lineno, f"from {node.module} import {alias.name}"))
    return out


def test_no_module_imports_another_modules_private_names():
    bad = private_imports(sources())
    assert not bad, "\n".join(f"{m}:{line}: {expr}" for m, line, expr in bad)


def test_private_import_check_catches_an_import():
    mods = {
        "kvjax.p.a": (pathlib.Path("a.py"), ast.parse("def _f():\n    pass\n")),
        "kvjax.p._h": (pathlib.Path("_h.py"), ast.parse("")),
        "kvjax.q.b": (pathlib.Path("b.py"), ast.parse("from kvjax.p.a import _f\nfrom kvjax.p import _h\n")),
        "kvjax.p.c": (pathlib.Path("c.py"), ast.parse("from kvjax.p import _h\n")),
    }
    assert private_imports(mods) == [("kvjax.q.b", 1, "from kvjax.p.a import _f"), ("kvjax.q.b", 2, "from kvjax.p import _h")]


def test_private_read_check_catches_a_read():
    mods = {
        "kvjax.a": (pathlib.Path("a.py"), ast.parse("class A:\n    def __init__(self):\n        self._x = 1\n")),
        "kvjax.b": (pathlib.Path("b.py"), ast.parse("def f(a):\n    return a._x, a.y\n")),
    }
    assert private_reads(mods) == [("kvjax.b", 2, "a._x")]


def test_every_kvjax_exception_derives_from_kvcacheerror():
    """Import every module of kvjax and check every exception class it defines, so `except
    KVCacheError` catches whatever kvjax raises on purpose. Warning categories are left out:
    they are issued with `warnings.warn`, never raised as errors, and derive from `Warning`."""
    outside = []
    checked = 0
    for info in pkgutil.walk_packages(kvjax.__path__, "kvjax."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException) and not issubclass(cls, Warning):
                checked += 1
                if not issubclass(cls, KVCacheError):
                    outside.append(f"{info.name}.{cls.__qualname__}{tuple(b.__name__ for b in cls.__bases__)}")
    assert checked > 12  # the walk really reached the modules
    assert not outside, outside


def test_ledger_never_imports_jax_even_lazily():
    """No module under kvjax/ledger imports jax, flax or the device side, at any depth of its
    source that runs (annotations under `TYPE_CHECKING` may name device types; they never
    load). tests/ledger/test_no_jax.py runs a request cycle and checks sys.modules."""
    mods = sources()
    graph = import_edges(mods, runtime_only=True)
    ledger = [m for m in mods if m == "kvjax.ledger" or m.startswith("kvjax.ledger.")]
    seen, todo = set(ledger), list(ledger)
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    assert not [m for m in seen if m.startswith(("kvjax.device", "kvjax.models", "kvjax.engine"))], sorted(seen)
    for m in seen:
        for node in import_nodes(mods[m][1], runtime_only=True):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("jax", "jaxlib", "flax", "chex") for n in names), (m, names)



def block_list_writes(mods: dict[str, tuple[pathlib.Path, ast.Module]]) -> list[tuple[str, int, str]]:
    """(module, line, code) of every direct write to a sequence window's block lists
    (`x.blocks[beam].append(...)`, `x.blocks[beam][pos] = ...`, `x.blocks = ...`...). A heuristic:
    a write through an alias (`beam = sw.blocks[0]; beam.pop()`) escapes it, so the writers keep
    to the methods."""
    mutators = {"append", "extend", "pop", "frombytes", "insert", "remove", "reverse", "fromlist", "byteswap"}

    def on_blocks(node: ast.AST) -> bool:  # `x.blocks` or `x.blocks[...]`
        while isinstance(node, ast.Subscript):
            node = node.value
        return isinstance(node, ast.Attribute) and node.attr == "blocks"

    out = []
    for name, (_path, tree) in mods.items():
        for node in ast.walk(tree):
            hit = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators:
                if isinstance(node.func.value, ast.Subscript) and on_blocks(node.func.value):
                    hit = node
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                if any(on_blocks(t) and not (isinstance(t, ast.Attribute) and name == "kvjax.ledger.sequence") for t in targets):
                    hit = node
            if hit is not None:
                out.append((name, hit.lineno, ast.unparse(hit)))
    return out


def test_one_writer_of_a_sequences_block_lists():
    """Only `SequenceWindow`'s own methods (kvjax/ledger/sequence.py) write its block lists."""
    ledger = {m: v for m, v in sources().items() if m.startswith("kvjax.ledger.")}
    bad = [w for w in block_list_writes(ledger) if w[0] != "kvjax.ledger.sequence"]
    assert not bad, "\n".join(f"{m}:{line}: {code}" for m, line, code in bad)
    mods = {"kvjax.x": (pathlib.Path("x.py"), ast.parse("sw.blocks[0].append(1)\nsw.blocks[0][2] = 3\nn = len(sw.blocks[0])\n"))}
    assert sorted(line for _, line, _ in block_list_writes(mods)) == [1, 2]


def test_nothing_below_the_facade_imports_it():
    """`KVCacheManager` is the top of the ledger: the modules it hands work to take the owners
    they need (`BlockManager`, `LiveSequences`...), never the facade, not even for annotations."""
    graph = import_edges(sources())
    below = [m for m, deps in graph.items() if m.startswith("kvjax.ledger.") and "kvjax.ledger.kv_cache_manager" in deps]
    assert not below, below
