"""vLLM's `--kv-transfer-config` for kvjax's `JaxTransferConnector`, and `kv_transfer_params`.

The top-level keys are vLLM's `KVTransferConfig` (`kv_connector`, `kv_role`, `engine_id`,
`kv_load_failure_policy`, `kv_connector_extra_config`); kvjax's own settings live in
`kv_connector_extra_config`. Every key is checked: an unknown or unsupported one is refused by
name rather than ignored, because a typo in a port or a lease would otherwise fail far away.

`kv_transfer_params` is the per-request hand-off of vLLM's P/D proxies: the prefill request
carries `{"do_remote_decode": true}`, the prefill response carries `RemotePrefillParams` and the
proxy copies them into the decode request.
"""
from __future__ import annotations

import dataclasses
import json
import math
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from kvjax.disagg.errors import TransferConfigError
from kvjax.validation import check_int, check_real

CONNECTOR_NAME = "JaxTransferConnector"
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
FailurePolicy = Literal["recompute", "fail"]
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")
#: kvjax follows vLLM here: a failed remote load fails the request unless told to recompute.
DEFAULT_FAILURE_POLICY: FailurePolicy = "fail"
#: Transfer ids go through JSON (a proxy may parse them as doubles): keep them below 2**53.
MAX_TRANSFER_ID = 2**53 - 1

_TOP_KEYS = ("kv_connector", "kv_role", "engine_id", "kv_load_failure_policy", "kv_connector_extra_config")
# vLLM keys that mean something to other connectors only: refused with a reason.
_UNSUPPORTED_TOP = {
    "kv_connector_module_path": "kvjax has no out-of-tree connectors",
    "kv_buffer_device": "the transfer server pulls into the pools' own devices",
    "kv_buffer_size": "kvjax sizes no send buffer (offers are gathered copies)",
    "kv_ip": "use kv_connector_extra_config.side_channel_host",
    "kv_port": "use kv_connector_extra_config.side_channel_port",
    "kv_rank": "use kv_connector_extra_config.tp_rank",
    "kv_parallel_size": "use kv_connector_extra_config.tp_size",
}


def _err(msg: str) -> TransferConfigError:
    return TransferConfigError(msg)


def _str(name: str, v: object) -> str:
    if not isinstance(v, str) or not v:
        raise _err(f"{name} must be a non-empty string, got {v!r}")
    return v


def _real(name: str, v: object, lo: float, hi: float = math.inf) -> float:
    r = check_real(name, v, lo, hi, error=TransferConfigError)
    if r <= 0:
        raise _err(f"{name} must be > 0, got {v!r}")
    return r


def _port(name: str, v: object) -> int:
    return check_int(name, v, 0, 65535, error=TransferConfigError)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JaxTransferSettings:
    """`kv_connector_extra_config` of the JaxTransferConnector (all seconds are wall seconds).

    side_channel_host/port: where the producer's ZeroMQ side channel binds (port 0: any free
        port; the bound port goes out in `remote_port`).
    transfer_address: the producer's JAX transfer server bind address (`host:port`, port 0 free).
    kv_lease_duration: how long an offer stays pinned without a consumer heartbeat (vLLM's name
        and default, 30 s).
    heartbeat_interval: how often a consumer extends the lease while it waits or pulls.
    pull_timeout: the consumer's deadline for one pull, handshake included.
    side_channel_timeout: the bound on every side-channel send/receive.
    max_offers: offers one producer holds at once. max_pull_threads: pull threads one consumer
        keeps alive at once, including abandoned ones that have not ended yet.
    tp_size/tp_rank: the tensor-parallel layout of this engine's KV (part of the digest).
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    transfer_address: str = "127.0.0.1:0"
    kv_lease_duration: float = 30.0
    heartbeat_interval: float = 5.0
    pull_timeout: float = 30.0
    side_channel_timeout: float = 5.0
    max_offers: int = 256
    max_pull_threads: int = 16
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        _str("side_channel_host", self.side_channel_host)
        _port("side_channel_port", self.side_channel_port)
        addr = _str("transfer_address", self.transfer_address)
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise _err(f"transfer_address must be 'host:port', got {addr!r}")
        _real("kv_lease_duration", self.kv_lease_duration, 0.0)
        _real("heartbeat_interval", self.heartbeat_interval, 0.0)
        _real("pull_timeout", self.pull_timeout, 0.0)
        _real("side_channel_timeout", self.side_channel_timeout, 0.0)
        if self.heartbeat_interval >= self.kv_lease_duration:
            raise _err(f"heartbeat_interval ({self.heartbeat_interval}) must be shorter than "
                       f"kv_lease_duration ({self.kv_lease_duration}), or a waiting consumer loses its lease")
        check_int("max_offers", self.max_offers, 1, error=TransferConfigError)
        check_int("max_pull_threads", self.max_pull_threads, 1, error=TransferConfigError)
        check_int("tp_size", self.tp_size, 1, error=TransferConfigError)
        check_int("tp_rank", self.tp_rank, 0, self.tp_size - 1, error=TransferConfigError)


_SETTING_KEYS = tuple(f.name for f in dataclasses.fields(JaxTransferSettings))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVTransferConfig:
    """A validated `--kv-transfer-config` (vLLM's `KVTransferConfig`, JaxTransferConnector only)."""

    kv_connector: str = CONNECTOR_NAME
    kv_role: KVRole
    engine_id: str
    kv_load_failure_policy: FailurePolicy = DEFAULT_FAILURE_POLICY
    settings: JaxTransferSettings = dataclasses.field(default_factory=JaxTransferSettings)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, raw: str | Mapping[str, Any]) -> KVTransferConfig:
        """From the JSON string of `--kv-transfer-config` or its decoded dict."""
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise _err(f"--kv-transfer-config is not valid JSON: {e}") from None
        if not isinstance(raw, Mapping):
            raise _err(f"--kv-transfer-config must be a JSON object, got {type(raw).__name__}")
        for key in raw:
            if key in _UNSUPPORTED_TOP:
                raise _err(f"--kv-transfer-config key {key!r} is not supported by {CONNECTOR_NAME}: "
                           f"{_UNSUPPORTED_TOP[key]}")
            if key not in _TOP_KEYS:
                raise _err(f"unknown --kv-transfer-config key {key!r} (known: {', '.join(_TOP_KEYS)})")
        conn = raw.get("kv_connector")
        if conn != CONNECTOR_NAME:
            raise _err(f"kv_connector must be {CONNECTOR_NAME!r}, got {conn!r}")
        role = raw.get("kv_role")
        if role not in ROLES:
            raise _err(f"kv_role must be one of {ROLES}, got {role!r}")
        extra = raw.get("kv_connector_extra_config", {})
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise _err(f"kv_connector_extra_config must be an object, got {type(extra).__name__}")
        extra = dict(extra)
        values: dict[str, Any] = {}
        # engine_id and kv_load_failure_policy are top-level in vLLM; the extra config may carry
        # them too (as some deployments do), but the two places must then agree.
        for key in ("engine_id", "kv_load_failure_policy"):
            top, inner = raw.get(key), extra.pop(key, None)
            if top is not None and inner is not None and top != inner:
                raise _err(f"{key} is {top!r} at the top level but {inner!r} in kv_connector_extra_config")
            values[key] = top if top is not None else inner
        unknown = sorted(set(extra) - set(_SETTING_KEYS))
        if unknown:
            raise _err(f"unknown kv_connector_extra_config key(s) {unknown} (known: {', '.join(_SETTING_KEYS)})")
        policy = values["kv_load_failure_policy"]
        if policy is None:
            policy = DEFAULT_FAILURE_POLICY
        if policy not in FAILURE_POLICIES:
            raise _err(f"kv_load_failure_policy must be one of {FAILURE_POLICIES}, got {policy!r}")
        engine_id = values["engine_id"]
        engine_id = str(uuid.uuid4()) if engine_id is None else _str("engine_id", engine_id)
        try:
            settings = JaxTransferSettings(**extra)
        except TypeError as e:  # pragma: no cover - keys were checked above
            raise _err(str(e)) from None
        return cls(kv_role=role, engine_id=engine_id, kv_load_failure_policy=policy, settings=settings)


# ----------------------------------------------------------------------------- kv_transfer_params
_PREFILL_KEYS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids",
                 "remote_host", "remote_port", "remote_request_id")


def parse_prefill_request(params: object) -> bool:
    """The `kv_transfer_params` of a request sent to a producer: True if it asks for remote
    decode. vLLM's proxies send the remote_* keys too, as nulls; anything else is refused."""
    if params is None:
        return False
    if not isinstance(params, Mapping):
        raise _err(f"kv_transfer_params must be an object, got {type(params).__name__}")
    unknown = sorted(set(params) - set(_PREFILL_KEYS))
    if unknown:
        raise _err(f"unknown kv_transfer_params key(s) {unknown} in a prefill request")
    for key in _PREFILL_KEYS[2:]:
        if params.get(key) is not None:
            raise _err(f"kv_transfer_params.{key} must be null in a prefill request, got {params[key]!r}")
    flags = {}
    for key in ("do_remote_decode", "do_remote_prefill"):
        v = params.get(key, False)
        if not isinstance(v, bool):
            raise _err(f"kv_transfer_params.{key} must be a bool, got {v!r}")
        flags[key] = v
    if flags["do_remote_prefill"]:
        raise _err("a prefill request cannot carry do_remote_prefill=true (that is the decode side's request)")
    return flags["do_remote_decode"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemotePrefillParams:
    """What a producer returns for a `do_remote_decode` request, and a consumer takes back.

    vLLM's NIXL fields plus kvjax's: `transfer_id` (the one-shot id of the offer on the
    producer's transfer server) and `geometry_digest` (checked before anything is pulled).
    `remote_block_ids` are the producer's block ids, in the order of the offered blocks.
    """

    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    remote_host: str
    remote_port: int
    transfer_id: int
    geometry_digest: str
    remote_num_tokens: int

    def __post_init__(self) -> None:
        _str("remote_engine_id", self.remote_engine_id)
        _str("remote_request_id", self.remote_request_id)
        _str("remote_host", self.remote_host)
        _str("geometry_digest", self.geometry_digest)
        if not isinstance(self.remote_block_ids, tuple):
            raise _err(f"remote_block_ids must be a tuple of ints, got {type(self.remote_block_ids).__name__}")
        for b in self.remote_block_ids:
            check_int("remote_block_ids entry", b, 0, error=TransferConfigError)
        check_int("remote_port", self.remote_port, 1, 65535, error=TransferConfigError)
        check_int("transfer_id", self.transfer_id, 1, MAX_TRANSFER_ID, error=TransferConfigError)
        check_int("remote_num_tokens", self.remote_num_tokens, 0, error=TransferConfigError)

    def to_dict(self) -> dict[str, Any]:
        """The response's `kv_transfer_params` (JSON-ready)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_block_ids": list(self.remote_block_ids),
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_num_tokens": self.remote_num_tokens,
            "transfer_id": self.transfer_id,
            "geometry_digest": self.geometry_digest,
        }

    @classmethod
    def from_dict(cls, params: object) -> RemotePrefillParams:
        """A decode request's `kv_transfer_params`, as a producer returned them."""
        if not isinstance(params, Mapping):
            raise _err(f"kv_transfer_params must be an object, got {type(params).__name__}")
        expected = set(cls(**_SAMPLE).to_dict())
        unknown = sorted(set(params) - expected)
        missing = sorted(expected - set(params))
        if unknown:
            raise _err(f"unknown kv_transfer_params key(s) {unknown} in a decode request")
        if missing:
            raise _err(f"kv_transfer_params of a decode request lack {missing}")
        if params["do_remote_prefill"] is not True:
            raise _err(f"a decode request's kv_transfer_params need do_remote_prefill=true, got "
                       f"{params['do_remote_prefill']!r}")
        if params["do_remote_decode"] is not False:
            raise _err(f"a decode request's kv_transfer_params need do_remote_decode=false, got "
                       f"{params['do_remote_decode']!r}")
        blocks = params["remote_block_ids"]
        if not isinstance(blocks, list):
            raise _err(f"remote_block_ids must be a list of ints, got {blocks!r}")
        fields = {k: params[k] for k in expected - {"do_remote_prefill", "do_remote_decode"}}
        fields["remote_block_ids"] = tuple(blocks)
        return cls(**fields)


_SAMPLE: dict[str, Any] = dict(remote_engine_id="e", remote_request_id="r", remote_block_ids=(), remote_host="h",
                               remote_port=1, transfer_id=1, geometry_digest="d", remote_num_tokens=0)
