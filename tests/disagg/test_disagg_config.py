"""--kv-transfer-config and kv_transfer_params parsing: vLLM's shapes in, typed errors out."""
from __future__ import annotations

import json

import pytest

from kvjax.disagg import (
    DEFAULT_FAILURE_POLICY,
    KVTransferConfig,
    RemotePrefillParams,
    TransferConfigError,
    parse_prefill_request,
)
from kvjax.errors import InvalidArgumentError

BASE = {"kv_connector": "JaxTransferConnector", "kv_role": "kv_producer"}


def test_parses_vllm_json_with_defaults():
    cfg = KVTransferConfig.parse(json.dumps(BASE))
    assert cfg.kv_role == "kv_producer" and cfg.is_producer and not cfg.is_consumer
    assert cfg.kv_load_failure_policy == DEFAULT_FAILURE_POLICY == "fail"
    assert cfg.settings.kv_lease_duration == 30.0 and cfg.settings.side_channel_port == 0
    assert cfg.engine_id  # a fresh id when none is given
    both = KVTransferConfig.parse({**BASE, "kv_role": "kv_both", "engine_id": "p0", "kv_load_failure_policy": "recompute",
                                   "kv_connector_extra_config": {"kv_lease_duration": 12, "side_channel_port": 5600,
                                                                 "pull_timeout": 2.5, "tp_size": 2, "tp_rank": 1}})
    assert both.is_producer and both.is_consumer and both.engine_id == "p0"
    assert both.kv_load_failure_policy == "recompute"
    assert (both.settings.kv_lease_duration, both.settings.side_channel_port, both.settings.tp_rank) == (12.0, 5600, 1)


def test_engine_id_and_policy_may_sit_in_the_extra_config_but_must_agree():
    cfg = KVTransferConfig.parse({**BASE, "kv_connector_extra_config": {"engine_id": "x", "kv_load_failure_policy": "recompute"}})
    assert (cfg.engine_id, cfg.kv_load_failure_policy) == ("x", "recompute")
    with pytest.raises(TransferConfigError, match="engine_id"):
        KVTransferConfig.parse({**BASE, "engine_id": "a", "kv_connector_extra_config": {"engine_id": "b"}})


@pytest.mark.parametrize("raw, match", [
    ("{not json", "not valid JSON"),
    ("[1]", "JSON object"),
    ({**BASE, "kv_connector": "NixlConnector"}, "kv_connector must be"),
    ({**BASE, "kv_role": "prefill"}, "kv_role"),
    ({**BASE, "kv_rolee": "kv_producer"}, "unknown --kv-transfer-config key 'kv_rolee'"),
    ({**BASE, "kv_connector_module_path": "x.y"}, "not supported"),
    ({**BASE, "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
    ({**BASE, "kv_connector_extra_config": {"lease": 3}}, r"unknown kv_connector_extra_config key\(s\) \['lease'\]"),
    ({**BASE, "kv_connector_extra_config": {"kv_lease_duration": 0}}, "kv_lease_duration"),
    ({**BASE, "kv_connector_extra_config": {"kv_lease_duration": float("nan")}}, "kv_lease_duration"),
    ({**BASE, "kv_connector_extra_config": {"side_channel_port": 70000}}, "side_channel_port"),
    ({**BASE, "kv_connector_extra_config": {"side_channel_port": True}}, "side_channel_port"),
    ({**BASE, "kv_connector_extra_config": {"transfer_address": "localhost"}}, "host:port"),
    ({**BASE, "kv_connector_extra_config": {"heartbeat_interval": 30}}, "heartbeat_interval"),
    ({**BASE, "kv_connector_extra_config": {"tp_size": 2, "tp_rank": 2}}, "tp_rank"),
    ({**BASE, "kv_connector_extra_config": {"max_offers": 0}}, "max_offers"),
    ({**BASE, "kv_connector_extra_config": []}, "must be an object"),
])
def test_bad_configs_are_refused_by_name(raw, match):
    with pytest.raises(TransferConfigError, match=match) as e:
        KVTransferConfig.parse(raw)
    assert isinstance(e.value, InvalidArgumentError)


def test_prefill_request_params_follow_the_vllm_proxy():
    assert parse_prefill_request(None) is False
    proxy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
             "remote_host": None, "remote_port": None}
    assert parse_prefill_request(proxy) is True
    for bad, match in [({"do_remote_decode": 1}, "bool"), ({"do_remote_decode": True, "x": 1}, "unknown"),
                       ({"do_remote_decode": True, "remote_host": "h"}, "null"),
                       ({"do_remote_prefill": True}, "decode side"), ([], "object")]:
        with pytest.raises(TransferConfigError, match=match):
            parse_prefill_request(bad)


def _params(**kw):
    base = dict(remote_engine_id="p0", remote_request_id="r1", remote_block_ids=(4, 2), remote_host="127.0.0.1",
                remote_port=5600, transfer_id=123, geometry_digest="ab" * 32, remote_num_tokens=9)
    base.update(kw)
    return RemotePrefillParams(**base)


def test_remote_prefill_params_round_trip_through_json():
    p = _params()
    d = json.loads(json.dumps(p.to_dict()))
    assert d["do_remote_prefill"] is True and d["do_remote_decode"] is False
    assert RemotePrefillParams.from_dict(d) == p


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("transfer_id"), "lack"),
    (lambda d: d.update(extra=1), "unknown"),
    (lambda d: d.update(do_remote_prefill=False), "do_remote_prefill"),
    (lambda d: d.update(remote_port=0), "remote_port"),
    (lambda d: d.update(transfer_id=2**53), "transfer_id"),
    (lambda d: d.update(remote_block_ids=[1, -1]), "remote_block_ids"),
    (lambda d: d.update(remote_block_ids="1,2"), "remote_block_ids"),
    (lambda d: d.update(remote_host=""), "remote_host"),
    (lambda d: d.update(remote_num_tokens=1.0), "remote_num_tokens"),
])
def test_bad_decode_params_are_refused(mutate, match):
    d = _params().to_dict()
    mutate(d)
    with pytest.raises(TransferConfigError, match=match):
        RemotePrefillParams.from_dict(d)
