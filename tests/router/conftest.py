"""The router's tests share the KV-events tests' helpers (ledger and index views, the seeded
serving driver): make `kv_helpers` importable from tests/kv_events."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv_events"))
