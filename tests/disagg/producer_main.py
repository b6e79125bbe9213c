"""A producer process for the tests: offers deterministic arrays, prints the params as one JSON
line, then serves until the offer is released (prints `released <reason>`) or a hard limit."""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from disagg_helpers import geometry, host_arrays, transfer_config  # noqa: E402

from kvjax.disagg import KVProducer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", default="[[2,2,2,4,8],[3,5]]")
    ap.add_argument("--dtypes", default='["float32","bfloat16"]')
    ap.add_argument("--lease", type=float, default=10.0)
    ap.add_argument("--limit", type=float, default=30.0)
    ap.add_argument("--model", default="tiny-test")
    a = ap.parse_args()
    shapes, dtypes = json.loads(a.shapes), json.loads(a.dtypes)
    released: list[tuple[str, str]] = []
    producer = KVProducer(transfer_config("kv_producer", kv_lease_duration=a.lease, heartbeat_interval=a.lease / 4),
                          geometry(model=a.model), on_release=lambda rid, why: released.append((rid, why)))
    arrays = [jnp.asarray(x) for x in host_arrays(a.seed, shapes, [jnp.dtype(d) for d in dtypes])]
    jax.block_until_ready(arrays)
    params = producer.offer("req-1", arrays, block_ids=[3, 1], num_tokens=7)
    print(json.dumps(params.to_dict()), flush=True)
    end = time.monotonic() + a.limit
    while not released and time.monotonic() < end:
        producer.poll()
        time.sleep(0.01)
    print("released " + (released[0][1] if released else "none"), flush=True)
    producer.close()


if __name__ == "__main__":
    main()
