"""The router's P/D mode without servers: its configuration, flags and the two steps' bodies
(the flow itself runs end to end in tests/server/test_pd_serving.py)."""
import json

import pytest

from kvjax.disagg import parse_prefill_request
from kvjax.router.config import RouterConfig
from kvjax.router.pd_flow import decode_body, prefill_body


def test_pd_config_needs_both_sides_and_replaces_replicas():
    cfg = RouterConfig((), prefill_replicas=("http://p:1/",), decode_replicas=("http://d:1", "http://d:2"))
    assert cfg.disaggregated and cfg.replicas == ("http://p:1", "http://d:1", "http://d:2")
    assert cfg.prefill_replicas == ("http://p:1",)
    with pytest.raises(ValueError, match="both --prefill-replica and --decode-replica"):
        RouterConfig((), prefill_replicas=("http://p:1",))
    with pytest.raises(ValueError, match="not both"):
        RouterConfig(("http://a:1",), prefill_replicas=("http://p:1",), decode_replicas=("http://d:1",))
    with pytest.raises(ValueError, match="distinct"):
        RouterConfig((), prefill_replicas=("http://p:1",), decode_replicas=("http://p:1",))
    assert not RouterConfig(("http://a:1",)).disaggregated


def test_the_two_bodies():
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50,
              "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    first = json.loads(prefill_body(client))
    assert first["max_tokens"] == 1 and first["max_completion_tokens"] == 1 and first["stream"] is False
    assert "stream_options" not in first and first["messages"] == client["messages"]
    assert parse_prefill_request(first["kv_transfer_params"]) is True  # what a producer accepts
    params = {"do_remote_prefill": True, "transfer_id": 5}
    second = json.loads(decode_body(client, params))
    assert second == {**client, "kv_transfer_params": params}  # the client's body, unchanged otherwise
    assert json.loads(decode_body(client, None)) == client  # no offer: a plain request


def test_cli_router_pd_flags(monkeypatch, capsys):
    import kvjax.router.launch
    from kvjax.cli import main

    seen = {}
    monkeypatch.setattr(kvjax.router.launch, "serve_router", lambda config, **kw: seen.update(config=config))
    assert main(["router", "--prefill-replica", "http://127.0.0.1:8001", "--decode-replica", "http://127.0.0.1:8002",
                 "--decode-replica", "http://127.0.0.1:8003"]) == 0
    cfg = seen["config"]
    assert cfg.prefill_replicas == ("http://127.0.0.1:8001",) and len(cfg.decode_replicas) == 2
    assert "prefill 1 + decode 2 replicas" in capsys.readouterr().err
    assert main(["router", "--decode-replica", "http://127.0.0.1:8002"]) == 2
    assert "--prefill-replica" in capsys.readouterr().err
