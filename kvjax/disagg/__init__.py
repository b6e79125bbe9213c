"""Disaggregated prefill/decode transport: vLLM's connector contract over `jax.experimental.transfer`.

A prefill engine (`KVProducer`) offers a request's gathered KV blocks under a one-shot transfer
id and a lease; a decode engine (`KVConsumer`) handshakes over a ZeroMQ side channel (geometry
digest, offer shapes), pulls the blocks under its own deadline and reports "pulled". See
docs/disaggregation.md.
"""
from kvjax.disagg.config import (
    CONNECTOR_NAME,
    DEFAULT_FAILURE_POLICY,
    JaxTransferSettings,
    KVTransferConfig,
    RemotePrefillParams,
    parse_prefill_request,
)
from kvjax.disagg.consumer import KVConsumer, PullResult
from kvjax.disagg.digest import KVGeometry
from kvjax.disagg.errors import (
    CapacityError,
    GeometryMismatchError,
    PeerError,
    PullTimeoutError,
    RoleError,
    SideChannelError,
    TransferConfigError,
)
from kvjax.disagg.producer import KVProducer, gather_blocks, scatter_blocks

__all__ = [
    "CONNECTOR_NAME", "DEFAULT_FAILURE_POLICY", "JaxTransferSettings", "KVTransferConfig", "RemotePrefillParams",
    "parse_prefill_request", "KVConsumer", "PullResult", "KVGeometry", "CapacityError", "GeometryMismatchError",
    "PeerError", "PullTimeoutError", "RoleError", "SideChannelError", "TransferConfigError", "KVProducer",
    "gather_blocks", "scatter_blocks",
]
