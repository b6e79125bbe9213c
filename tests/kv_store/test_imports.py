"""The store layer is pure Python + numpy: importing it (and using a store) loads no JAX."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_kv_store_does_not_import_jax():
    code = (
        "import sys; import kvjax.kv_store as k; from kvjax.kv_store import RedisStore; "
        "s = k.load_store('memory://?max_bytes=1KiB'); s.batch_put(['a'], [b'1']); "
        "assert not [m for m in sys.modules if m == 'jax' or m.startswith('jax.')], 'jax imported'"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
