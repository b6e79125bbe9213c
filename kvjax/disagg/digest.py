"""`KVGeometry`: everything two engines must share for one's KV bytes to be usable by the other.

Built from a `CacheConfig` plus the model's identity and the tensor-parallel layout. The digest
is a SHA-256 over a canonical JSON of the fields, so it is stable across processes, Python
versions and machines; the fields themselves travel in the handshake so that a mismatch can be
refused with the names of the fields that differ instead of two opaque hashes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kvjax.config import CacheConfig
from kvjax.disagg.errors import GeometryMismatchError, TransferConfigError
from kvjax.validation import check_int

#: Bumped whenever the meaning of the offered arrays changes (their order, their axes).
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVGeometry:
    """The KV geometry that a transfer depends on.

    `model` names the weights (a Hugging Face id or path, plus a revision if the caller has one):
    same shapes from different weights would give wrong tokens, not an error. `pools` lists each
    pool's (window, kv heads, head dim, layers), i.e. the order and shape of the offered arrays.
    """

    model: str
    dtype: str
    tokens_per_block: int
    layout: str
    kv_factor: int
    num_layers: int
    kv_heads_per_layer: tuple[int, ...]
    head_dim_per_layer: tuple[int, ...]
    layer_windows: tuple[int, ...]
    pools: tuple[tuple[int, int, int, tuple[int, ...]], ...]
    tp_size: int = 1
    tp_rank: int = 0
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TransferConfigError(f"model must be a non-empty string, got {self.model!r}")
        check_int("tp_size", self.tp_size, 1, error=TransferConfigError)
        check_int("tp_rank", self.tp_rank, 0, self.tp_size - 1, error=TransferConfigError)

    @classmethod
    def from_cache_config(cls, config: CacheConfig, *, model: str, tp_size: int = 1, tp_rank: int = 0) -> KVGeometry:
        if not isinstance(config, CacheConfig):
            raise TransferConfigError(f"expected a CacheConfig, got {type(config).__name__}")
        return cls(
            model=model,
            dtype=config.dtype,
            tokens_per_block=config.tokens_per_block,
            layout=config.layout,
            kv_factor=config.kv_factor,
            num_layers=config.num_layers,
            kv_heads_per_layer=tuple(config.kv_heads_per_layer),
            head_dim_per_layer=tuple(config.head_dim_per_layer),
            layer_windows=tuple(config.layer_windows),
            pools=tuple((p.window, p.num_kv_heads, p.head_dim, tuple(p.layers)) for p in config.pools),
            tp_size=tp_size,
            tp_rank=tp_rank,
        )

    def fields(self) -> dict[str, Any]:
        """The fields as plain JSON values (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @property
    def digest(self) -> str:
        """Hex SHA-256 of the canonical JSON of `fields()`."""
        blob = json.dumps(self.fields(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def diff(self, remote_fields: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ: name -> (local, remote); a missing field counts."""
        mine = self.fields()
        names = sorted(set(mine) | set(remote_fields))
        return {n: (mine.get(n), remote_fields.get(n)) for n in names if mine.get(n) != remote_fields.get(n)}

    def check_compatible(self, remote_fields: Mapping[str, Any], remote_digest: str | None = None) -> None:
        """Raise `GeometryMismatchError` naming the differing fields; None when they all match.

        With `remote_digest`, the remote fields must also hash to it (a peer that sent fields
        and a digest that disagree is refused too)."""
        diff = self.diff(remote_fields)
        if diff:
            parts = ", ".join(f"{n}: local {a!r} vs remote {b!r}" for n, b_a in diff.items() for a, b in [b_a])
            raise GeometryMismatchError(f"KV geometry mismatch, refusing the transfer ({parts})", diff)
        if remote_digest is not None and remote_digest != self.digest:
            raise GeometryMismatchError(
                f"KV geometry digest mismatch: local {self.digest} vs remote {remote_digest} with equal fields "
                "(a different kvjax digest version?)", {"digest": (self.digest, remote_digest)})
