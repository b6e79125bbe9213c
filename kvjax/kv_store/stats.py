"""`StoreStats`: counters every built-in store keeps (read them for metrics; not locked
separately: each store updates them under its own lock)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StoreStats:
    puts: int = 0
    put_failures: int = 0
    hits: int = 0
    misses: int = 0
    size_mismatches: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
