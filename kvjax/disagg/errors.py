"""Typed errors of the disaggregated prefill/decode transport (all are `KVCacheError`s)."""
from __future__ import annotations

from kvjax.errors import InvalidArgumentError, KVCacheError


class TransferConfigError(InvalidArgumentError):
    """A `--kv-transfer-config` or a `kv_transfer_params` dict kvjax cannot use (names the key)."""


class GeometryMismatchError(KVCacheError):
    """The two sides' KV geometries differ, so the producer's bytes would be garbage here.

    `fields` maps each differing field to `(local, remote)`."""

    def __init__(self, message: str, fields: dict[str, tuple[object, object]] | None = None) -> None:
        super().__init__(message)
        self.fields = dict(fields or {})


class CapacityError(KVCacheError):
    """Too many offers (producer) or pull threads (consumer) in flight; nothing was started."""


class SideChannelError(KVCacheError):
    """A side-channel exchange failed: timeout, a peer that is gone, or a malformed reply."""


class PeerError(KVCacheError):
    """The peer answered with an error (an unknown transfer, an expired offer, a refusal)."""

    def __init__(self, code: str, message: str, detail: dict | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = dict(detail or {})


class PullTimeoutError(KVCacheError):
    """A pull did not finish by its deadline; its destination buffers are not usable."""


class RoleError(KVCacheError):
    """An operation the configured `kv_role` does not allow (e.g. offering as a consumer)."""
