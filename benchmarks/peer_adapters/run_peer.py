"""Runs one peer's driver in the peer venv, wave by wave as `benchmarks/ledger_bench.py` asks.

    <peer venv>/bin/python benchmarks/peer_adapters/run_peer.py PEER PARAMS_JSON DIGEST

PEER is `vllm` or `sglang`. PARAMS_JSON holds the trace and cache parameters; the trace is
rebuilt from them with `benchmarks/ledger_trace.py` and its digest must equal DIGEST, or
nothing runs. Then, over a private pipe (stdout; whatever the libraries print goes to stderr),
one command per line, one answer per line:

    new        a fresh driver (fresh cache), not timed      -> ok
    wave K     replay wave K (the driver times its phases)  -> ok
    result     the driver's result                          -> one JSON line
    quit       exit

A failure answers `error <message>` and exits non-zero.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from ledger_trace import make_trace, trace_digest, waves  # noqa: E402


def driver_class(peer: str):
    if peer == "vllm":
        from vllm_adapter import VllmDriver

        return VllmDriver
    if peer == "sglang":
        from sglang_adapter import SglangDriver

        return SglangDriver
    raise ValueError(f"unknown peer {peer!r} (vllm or sglang)")


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints must not reach the protocol pipe
    sys.stdout = sys.stderr

    def say(line: str) -> None:
        proto.write(line + "\n")
        proto.flush()

    try:
        peer, params, digest = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
        a = argparse.Namespace(**params)
        trace = make_trace(a)
        ours = trace_digest(trace)
        if ours != digest:
            say(f"error trace digest {ours} differs from the benchmark's {digest}: not the same trace")
            return 2
        wave_list = list(waves(trace, a.concurrency))
        clock = {"cpu": time.thread_time, "wall": time.perf_counter}[a.clock]
        import torch

        # The peers' tensor ops here are tiny (a few to a few thousand elements): one intra-op
        # thread is their fastest setting, and keeps idle worker threads spinning on a small,
        # shared machine from slowing the other sides.
        torch.set_num_threads(1)
        cls = driver_class(peer)
        driver = cls(a)  # imports the peer now, so a broken venv fails before `ready`
        say(f"ready {ours}")
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "new":
                driver = None
                gc.enable()
                gc.collect()
                driver = cls(a)
                if not a.gc:
                    gc.disable()
                say("ok")
            elif cmd[0] == "wave":
                start, wave = wave_list[int(cmd[1])]
                driver.wave(start, wave, clock)
                say("ok")
            elif cmd[0] == "result":
                r = driver.result()
                r["hits"] = driver.hits
                say(json.dumps(r))
            elif cmd[0] == "quit":
                return 0
            else:
                say(f"error unknown command {line.strip()!r}")
                return 2
        return 0
    except Exception as e:  # the benchmark shows the message; the traceback goes to stderr
        traceback.print_exc()
        say(f"error {type(e).__name__}: {e}".replace("\n", " "))
        return 1


if __name__ == "__main__":
    sys.exit(main())
