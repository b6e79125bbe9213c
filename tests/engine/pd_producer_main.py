"""A producer engine (P) in its own process for the mid-pull fault tests, built with the public
API on the micro model (seed 0, the tests' geometry). It prefills each prompt of `--prompts`
(a JSON object: request id -> token ids) with do_remote_decode, prints the requests'
`kv_transfer_params` as one JSON line, then keeps stepping (side channel and leases alive) and
prints `released <reason>` as offers end, until killed or `--limit` seconds.

`--stall`: the offers are answered on the side channel but never handed to the transfer server
(its `await_pull` is held back), so a consumer's pull is issued and then waits for bytes that
never come: a deterministic "pull in flight" for the test to kill this process in, or to let
run into the consumer's pull_timeout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_helpers import cache, engine_config  # noqa: E402
from jax.experimental import transfer  # noqa: E402

from kvjax.disagg import KVTransferConfig  # noqa: E402
from kvjax.engine import Engine, LLMEngine, ModelRunner  # noqa: E402
from kvjax.engine.sampling import SamplingParams  # noqa: E402
from kvjax.models import Transformer  # noqa: E402


class _Stalled:
    """A transfer server whose offers are never registered: every pull of them waits."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.held: list = []  # keeps the offered arrays alive, as the real table would

    def await_pull(self, transfer_id, arrays) -> None:
        self.held.append((transfer_id, arrays))

    def __getattr__(self, name):
        return getattr(self._inner, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--stall", action="store_true")
    ap.add_argument("--limit", type=float, default=60.0)
    a = ap.parse_args()
    if a.stall:
        start = transfer.start_transfer_server
        transfer.start_transfer_server = lambda *args, **kw: _Stalled(start(*args, **kw))  # type: ignore[assignment]
    kv = KVTransferConfig.parse({"kv_connector": "JaxTransferConnector", "kv_role": "kv_producer",
                                 "kv_connector_extra_config": {"side_channel_timeout": 1, "kv_lease_duration": 30}})
    model = Transformer.from_spec("micro", seed=0)
    engine = LLMEngine(Engine(model, engine_config(), runner=ModelRunner(model)), cache(model), kv_transfer=kv)
    prompts: dict[str, list[int]] = json.loads(a.prompts)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True})
    params = {}
    end = time.monotonic() + a.limit
    while engine.has_unfinished_requests() and time.monotonic() < end:
        for out in engine.step():
            if out.finished:
                params[out.request_id] = out.kv_transfer_params
    print(json.dumps(params), flush=True)
    released: dict[str, int] = {}
    while time.monotonic() < end:
        engine.step()  # polls the producer: ends leases, unpins released offers
        now = engine.core.remote_kv.counters.released
        for reason, n in now.items():
            for _ in range(n - released.get(reason, 0)):
                print(f"released {reason}", flush=True)
        released = dict(now)
        time.sleep(0.01)
    engine.close()


if __name__ == "__main__":
    main()
