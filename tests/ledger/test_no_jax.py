"""The ledger is pure Python + numpy: importing it (or the top-level package, whose device
names load lazily) and running a full request cycle must not import JAX."""
import subprocess
import sys

CODE = """
import sys
import kvjax, kvjax.ledger
from kvjax import CacheConfig, KVCacheManager, Request, TransferPlan
cfg = CacheConfig(tokens_per_block=4, num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=64,
                  primary_blocks=8, secondary_blocks=2, event_buffer_max_size=16)
m = KVCacheManager(cfg)
assert m.add_sequence(Request("a", list(range(9)), max_new_tokens=4)) == 0
m.add_token("a", 42)
m.block_offsets(["a"])
m.remove_sequence("a")
assert isinstance(m.take_transfers(), TransferPlan)
m.verify_integrity()
assert "jax" not in sys.modules, sorted(k for k in sys.modules if k.startswith("jax"))
"""


def test_ledger_never_imports_jax():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_public_names_are_declared_once_and_exist():
    """`kvjax.ledger.__all__` lists what callers may import: every name resolves, none twice."""
    import kvjax.ledger as ledger

    assert len(set(ledger.__all__)) == len(ledger.__all__)
    assert all(hasattr(ledger, name) for name in ledger.__all__)


def test_no_two_kvjax_classes_share_a_name():
    """A class name means one thing across kvjax (the model's layer and the ledger's block were
    both `Block`; the engine and the ledger both had an `Admission`); private helpers aside."""
    import ast
    import collections
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "kvjax"
    where = collections.defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(str(path.relative_to(root)))
    clashes = {name: files for name, files in where.items() if len(files) > 1}
    assert not clashes, clashes
    assert "Sequence" not in where  # collections.abc.Sequence keeps its name
