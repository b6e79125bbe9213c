"""Ledger throughput on a deterministic shared-system-prompt trace, against the floor and the peers.

Trace (`ledger_trace.py`): N requests, each = one of P system prompts (S tokens, uniform or Zipf
popularity) + U unique tokens, then G generated tokens; block size B; requests served in waves
of C: admit (`add_sequence` + `store_context_blocks`), G decode steps of `add_token` over the
wave, finish (`remove_sequence`). kvjax runs with retention priorities on (system prompts 80,
decode blocks 20). The same waves drive, in the same run:
  floor   `ledger_floor.py`, a dict + LRU prefix cache with no features (always);
  peers   with --peers, vLLM v1's `KVCacheManager` and SGLang's `RadixCache`, each in a
          subprocess of a Python 3.11 venv that has them (benchmarks/peer_adapters/; create it
          with `bash benchmarks/peer_adapters/setup_peer_venv.sh`), each driven as its own
          scheduler drives it.
All sides advance wave by wave in lockstep, the order rotating each wave, so load on a shared
machine hits every side alike. Ratios are kvjax's requests/s over each side's.

    python benchmarks/ledger_bench.py                 # kvjax and floor, writes results/ledger_bench.json
    python benchmarks/ledger_bench.py --peers         # + vLLM and SGLang from .venv-peers/bin/python
    python benchmarks/ledger_bench.py --requests 2000 --zipf 1.1 --events
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(HERE)]

from ledger_floor import FloorDriver  # noqa: E402
from ledger_trace import TRACE_PARAMS, ideal_hit_rate, make_trace, trace_digest, waves  # noqa: E402

from kvjax import CacheConfig, KVCacheManager, Request, RetentionConfig, TokenRangeRetention  # noqa: E402
from kvjax.ledger import BlockHasher, BlockKey, StoredData  # noqa: E402

PEERS = {"vllm": "vLLM v1 KVCacheManager", "sglang": "SGLang RadixCache"}
PEER_RUNNER = HERE / "peer_adapters" / "run_peer.py"
DEFAULT_PEER_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
PEER_SETUP_HINT = ("create it with `bash benchmarks/peer_adapters/setup_peer_venv.sh` (Python 3.11, CPU torch, "
                   "vLLM and SGLang without their CUDA dependency trees), then pass --peers "
                   "[--peer-python PATH]; see docs/benchmarks.md")
TARGET_VS_PEERS, TARGET_VS_FLOOR = 5.0, 0.5


class KvjaxDriver:
    """Drives `KVCacheManager` through the trace, wave by wave, timing each phase."""

    name = "kvjax"

    def __init__(self, a):
        cfg = CacheConfig(
            tokens_per_block=a.block_size,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            max_seq_len=a.system_tokens + a.unique_tokens + a.gen_tokens + a.block_size,
            primary_blocks=a.num_blocks,
            secondary_blocks=a.secondary_blocks,
            event_buffer_max_size=100_000 if a.events else 0,
        )
        self.a = a
        self.m = KVCacheManager(cfg)
        # "features on": system prompts retained at high priority, decode blocks low
        self.retention = RetentionConfig([TokenRangeRetention(0, a.system_tokens, 80)], decode_priority=20)
        self.t = dict(admit=0.0, decode=0.0, finish=0.0)
        self.ops = self.hit_tokens = self.prompt_tokens = self.stored_blocks = 0
        self.hits: list[int] = []  # cached prefix length of each request, in trace order

    def wave(self, start, wave, clock):
        a, m = self.a, self.m
        ids = list(range(start, start + len(wave)))
        t0 = clock()
        for rid, (_, prompt, _) in zip(ids, wave, strict=True):
            hit = m.add_sequence(Request(rid, prompt, max_new_tokens=a.gen_tokens, retention=self.retention))
            m.store_context_blocks(rid)
            self.hits.append(hit)
            self.hit_tokens += hit
            self.prompt_tokens += len(prompt)
        t1 = clock()
        for step in range(a.gen_tokens):
            for rid, (_, _, gen) in zip(ids, wave, strict=True):
                m.add_token(rid, gen[step])
        t2 = clock()
        for rid in ids:
            m.remove_sequence(rid)
        m.refresh_blocks()
        m.iteration_stats()
        m.take_transfers()
        if a.events:
            m.flush_iteration_events()
            for e in m.get_latest_events():
                if isinstance(e.data, StoredData):
                    self.stored_blocks += e.data.num_blocks
        t3 = clock()
        self.t["admit"] += t1 - t0
        self.t["decode"] += t2 - t1
        self.t["finish"] += t3 - t2
        self.ops += 2 * len(wave) + a.gen_tokens * len(wave) + len(wave)

    def result(self):
        self.m.verify_integrity()
        s = self.m.stats()
        return dict(
            admit_s=self.t["admit"], decode_s=self.t["decode"], finish_s=self.t["finish"], ops=self.ops,
            hit_rate=self.hit_tokens / self.prompt_tokens, evicted=s.evicted_blocks, offloaded=s.offloaded_blocks,
            onboarded=s.onboarded_blocks, block_hit_rate=s.cache_hit_rate, stored_blocks=self.stored_blocks,
            hits=self.hits,
        )


class PeerError(RuntimeError):
    """A peer subprocess could not start, refused the trace, or failed mid-run."""


class PeerProcess:
    """One peer's driver in a subprocess of the peer venv (`peer_adapters/run_peer.py`), stepped
    wave by wave over a pipe. The subprocess times its own phases, so the pipe's round trip is
    outside every timed region."""

    def __init__(self, peer: str, python: str, a, digest: str, start_timeout_s: float = 600.0):
        self.name = PEERS[peer]
        self.peer = peer
        params = {k: getattr(a, k) for k in TRACE_PARAMS}
        params.update(block_size=a.block_size, concurrency=a.concurrency, num_blocks=a.num_blocks,
                      events=a.events, gc=a.gc, clock=a.clock)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [python, str(PEER_RUNNER), peer, json.dumps(params), digest],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
        )
        ready = self._read()
        if ready != f"ready {digest}":
            raise PeerError(f"{peer}: expected 'ready {digest}', got {ready!r}")

    def _read(self) -> str:
        line = self.proc.stdout.readline().strip()
        if not line or line.startswith("error"):
            self.proc.wait(timeout=60)
            self.log.seek(0)
            tail = "".join(self.log.readlines()[-15:])
            raise PeerError(f"{self.peer}: {line or f'exited with status {self.proc.returncode}'}\n{tail}")
        return line

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def new(self):
        if self.ask("new") != "ok":
            raise PeerError(f"{self.peer}: 'new' not acknowledged")
        return _PeerRun(self)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class _PeerRun:
    """A fresh peer cache for one repeat, with the drivers' wave/result interface."""

    def __init__(self, process: PeerProcess):
        self.p = process
        self.name = process.name
        self.wave_index = 0

    def wave(self, start, wave, clock):
        if self.p.ask(f"wave {self.wave_index}") != "ok":
            raise PeerError(f"{self.p.peer}: wave {self.wave_index} not acknowledged")
        self.wave_index += 1

    def result(self):
        return json.loads(self.p.ask("result"))


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def run_lockstep(trace, a, drivers) -> list[dict]:
    """Replay the trace through every driver, wave by wave, rotating which goes first each wave
    (each also evicts the others' working set from the CPU caches, as a model forward between
    ledger calls would). `--mode sequential` runs each driver alone, one after the other."""
    clock = CLOCKS[a.clock]
    if a.mode == "sequential":
        for d in drivers:
            for start, wave in waves(trace, a.concurrency):
                d.wave(start, wave, clock)
    else:
        n = len(drivers)
        for k, (start, wave) in enumerate(waves(trace, a.concurrency)):
            for j in range(n):
                drivers[(k + j) % n].wave(start, wave, clock)
    return [d.result() for d in drivers]


def run_decode_step(a, batch: int = 256, steps: int = 64) -> float:
    """Milliseconds of ledger bookkeeping per decode step of a `batch`-request batch: one
    add_token each, the padded block table and the transfer plan the engine would upload."""
    rng = random.Random(a.seed + 1)
    ctx = a.system_tokens + a.unique_tokens
    tpb = a.block_size
    blocks_per_seq = -(-(ctx + steps) // tpb)
    cfg = CacheConfig(
        tokens_per_block=tpb, num_layers=1, num_kv_heads=1, head_dim=1,
        max_seq_len=ctx + steps + tpb, primary_blocks=batch * blocks_per_seq + 16,
    )
    m = KVCacheManager(cfg)
    ids = list(range(batch))
    for i in ids:
        m.add_sequence(Request(i, [rng.randrange(a.vocab) for _ in range(ctx)], max_new_tokens=steps))
    width = 1 << (blocks_per_seq - 1).bit_length()
    t0 = time.perf_counter()
    for step in range(steps):
        for i in ids:
            m.add_token(i, step)
        m.block_table(ids, max_blocks=width)
        m.take_transfers()
    dt = (time.perf_counter() - t0) / steps
    m.verify_integrity()
    return dt * 1e3


def run_hash_cost(trace, a, max_blocks: int = 20_000) -> dict[str, float]:
    """Microseconds per stored block of each event-hash formula (`CacheConfig.event_hash`),
    chaining the trace's own prompt blocks as the ledger does when it publishes Stored events."""
    B = a.block_size
    chains = []
    n = 0
    for _, prompt, _ in trace:
        keys = [BlockKey(tuple(prompt[i : i + B])) for i in range(0, len(prompt) - B + 1, B)]
        chains.append(keys)
        n += len(keys)
        if n >= max_blocks:
            break
    out = {}
    for algorithm in ("sha256", "trtllm64"):
        hasher = BlockHasher(algorithm)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for keys in chains:
                h = hasher.root
                for k in keys:
                    h = hasher.hash(k, h)
            best = min(best, time.perf_counter() - t0)
        out[algorithm] = best / n * 1e6
    return out


def summarise(r, n):
    total = r["admit_s"] + r["decode_s"] + r["finish_s"]
    r["total_s"] = total
    r["requests_per_s"] = n / total
    r["us_per_request"] = {k: 1e6 * r[f"{k}_s"] / n for k in ("admit", "decode", "finish")}
    if "ops" in r:
        r["ops_per_s"] = r["ops"] / total
    return r


def compare_hits(ours, others, block_size):
    """Per side: how many requests found a different number of whole cached blocks than kvjax;
    and (requests, tokens) kvjax reused beyond whole blocks (its partial-block reuse)."""
    whole = [h // block_size for h in ours]
    same = {name: sum(1 for w, h in zip(whole, hits, strict=True) if w != h // block_size) for name, hits in others.items()}
    extra = [h % block_size for h in ours]
    return same, (sum(1 for e in extra if e), sum(extra))


def resolve_peer_python(a):
    """The peer venv's interpreter, or None (with the reason printed) when --peers cannot run."""
    if not a.peers:
        return None
    path = pathlib.Path(a.peer_python) if a.peer_python else DEFAULT_PEER_PYTHON
    if not path.exists():
        print(f"peers not measured: no peer venv at {path}; {PEER_SETUP_HINT}")
        return None
    return str(path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--unique-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--secondary-blocks", type=int, default=0, help="host tier blocks (offload on when > 0; kvjax only)")
    p.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of prompt popularity (0 = uniform)")
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--events", action="store_true",
                   help="KV events on for every side that has them (kvjax, vLLM, SGLang; not the floor)")
    p.add_argument("--peers", action="store_true", help="also run vLLM's and SGLang's managers (peer venv)")
    p.add_argument("--peer-python", default=None,
                   help=f"the peer venv's python (default: {DEFAULT_PEER_PYTHON.relative_to(ROOT)})")
    p.add_argument("--only-peers", default="vllm,sglang", help="with --peers, which of vllm,sglang to run")
    p.add_argument("--gc", action="store_true",
                   help="leave Python's cyclic GC on during the replay (default: off on every side alike)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                   help="time each side's calls in CPU time of its thread (default: what other jobs on the "
                        "machine take is not counted) or wall time")
    p.add_argument("--repeats", type=int, default=1, help="replay this many times with fresh caches, report each side's best")
    p.add_argument("--mode", choices=("interleaved", "sequential"), default="interleaved")
    p.add_argument("--no-extras", action="store_true", help="skip the decode-step and event-hash measurements")
    p.add_argument("--out", default=str(ROOT / "results" / "ledger_bench.json"))
    return p.parse_args(argv)


def measure(a, trace, peer_python=None):
    """Replay the trace `a.repeats` times through kvjax, the floor and (given the peer venv's
    python) the peers; each side's best repeat by total time, keyed by side name."""
    digest = trace_digest(trace)
    procs = []
    try:
        if peer_python:
            for peer in a.only_peers.split(","):
                try:
                    procs.append(PeerProcess(peer.strip(), peer_python, a, digest))
                except PeerError as e:
                    print(f"peer {peer} not measured: {e}")
        best: dict[str, dict] = {}
        for _ in range(a.repeats):
            drivers = [KvjaxDriver(a), FloorDriver(a)] + [p.new() for p in procs]
            names = ["kvjax", "floor"] + [p.name for p in procs]
            if not a.gc:
                gc.collect()
                gc.disable()  # every side alike (the peers do the same in their processes)
            try:
                results = run_lockstep(trace, a, drivers)
            finally:
                gc.enable()
            for name, r in zip(names, results, strict=True):
                r = summarise(r, a.requests)
                if name not in best or r["total_s"] < best[name]["total_s"]:
                    best[name] = r
        return best, digest
    finally:
        for p in procs:
            p.close()


def main(argv=None):
    a = parse_args(argv)
    trace = make_trace(a)
    ideal = ideal_hit_rate(trace, a)
    peer_python = resolve_peer_python(a)
    best, digest = measure(a, trace, peer_python)
    ours, floor = best["kvjax"], best["floor"]
    peers = {name: r for name, r in best.items() if name in PEERS.values()}

    print(f"trace: N={a.requests} P={a.num_prompts} S={a.system_tokens} U={a.unique_tokens} G={a.gen_tokens} "
          f"B={a.block_size} C={a.concurrency} blocks={a.num_blocks}+{a.secondary_blocks} zipf={a.zipf} "
          f"events={a.events} gc={'on' if a.gc else 'off'} clock={a.clock} mode={a.mode} repeats={a.repeats} "
          f"digest={digest[:16]}")
    print(f"{'':26}{'req/s':>9}{'admit us':>10}{'decode us':>11}{'finish us':>11}{'hit rate':>10}{'kvjax x':>9}")
    rows = [("kvjax (priorities on)", ours), ("floor (dict+LRU)", floor)] + list(peers.items())
    for name, r in rows:
        us = r["us_per_request"]
        ratio = ours["requests_per_s"] / r["requests_per_s"]
        print(f"{name:26}{r['requests_per_s']:>9.0f}{us['admit']:>10.1f}{us['decode']:>11.1f}{us['finish']:>11.1f}"
              f"{r['hit_rate']:>10.4f}{ratio:>9.2f}")
    same, partial = compare_hits(ours["hits"], {name: r["hits"] for name, r in rows[1:]}, a.block_size)
    print(f"ideal hit rate {ideal:.4f}; kvjax reaches {ours['hit_rate'] / ideal:.3f} of it "
          f"(evicted {ours['evicted']}, offloaded {ours['offloaded']}, onboarded {ours['onboarded']} blocks)")
    print("whole blocks of cached prefix, request by request, the same as kvjax's: "
          + ", ".join(f"{n} {'yes' if k == 0 else f'NO ({k} requests differ)'}" for n, k in same.items())
          + f"; kvjax also reused {partial[1]} tokens of partial blocks on {partial[0]} requests "
          "(the others reuse only whole blocks)")

    result = dict(args=vars(a), trace_digest=digest, ideal_hit_rate=ideal, kvjax=ours, floor=floor,
                  peers=peers, requests_with_other_whole_block_hits=same,
                  kvjax_partial_block_hits=dict(requests=partial[0], tokens=partial[1]))
    result["ratio_to_floor"] = ours["requests_per_s"] / floor["requests_per_s"]
    print(f"kvjax / floor: {result['ratio_to_floor']:.2f}x (target >= {TARGET_VS_FLOOR}x)")
    if peers:
        best_name = max(peers, key=lambda n: peers[n]["requests_per_s"])
        ratio = ours["requests_per_s"] / peers[best_name]["requests_per_s"]
        result.update(best_peer=best_name, ratio_to_best_peer=ratio,
                      ratio_to_peer={n: ours["requests_per_s"] / r["requests_per_s"] for n, r in peers.items()})
        print(f"kvjax / best peer ({best_name}): {ratio:.2f}x (target >= {TARGET_VS_PEERS}x)")
    elif not a.peers:
        print(f"peers (vLLM, SGLang) not run: add --peers; without a peer venv, {PEER_SETUP_HINT}")

    if not a.no_extras:
        gc.disable()
        step_ms = run_decode_step(a)
        hash_us = run_hash_cost(trace, a) if a.events else None
        gc.enable()
        result["decode_step_ms_256"] = step_ms
        print(f"per-step bookkeeping of a 256-request decode batch (add_token x256 + block table + plan): {step_ms:.3f} ms")
        if hash_us is not None:
            stored = ours["stored_blocks"]
            share = {k: stored * us * 1e-6 / ours["total_s"] for k, us in hash_us.items()}
            print(f"event block hash per stored block: sha256 {hash_us['sha256']:.2f} us (default), trtllm64 "
                  f"{hash_us['trtllm64']:.2f} us; {stored} blocks stored in this run: sha256 is "
                  f"{100 * share['sha256']:.1f}% of kvjax's time (trtllm64 would be {100 * share['trtllm64']:.1f}%)")
            result["event_hash_us_per_block"] = hash_us
            result["event_hash_share_of_time"] = share
    for r in [ours, floor, *peers.values()]:
        r.pop("hits", None)  # per-request lists stay out of the JSON
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
