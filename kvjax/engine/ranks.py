"""Multi-process ranks (`jax.distributed`): one identical, deterministic ledger per process.

Under JAX's multi-controller runtime every process runs the same program: each one holds a
full ledger and makes the same decisions from the same inputs, and the jitted step runs once
over a global mesh whose devices span the processes (weights and KV pools sharded over kv
heads). The ledgers never talk to each other, so two things keep them equal, or stop the
engine when they are not:

- At construction the ranks agree on the cache: block counts per window are the minimum
  over the ranks (TensorRT-LLM all-reduces its block counts the same way, since each rank
  sizes its cache from its own free memory), and every other setting must be equal.
- `RankDigest` is a running hash of what each step decided (scheduled requests and their
  pending tokens, admissions with their reused prefix, pauses, free blocks per window, the
  block tables the forward reads, the transfer plans). Every `interval` steps, before any
  device work of the step, the ranks exchange their digests (a 16-byte all-gather) and a
  difference raises `RankDivergenceError` on every rank, instead of letting them write
  different KV. With `interval = 1` (the default) a divergence is caught before the first
  forward it would change; a longer interval costs fewer collectives but lets divergent
  ranks run (and possibly launch different programs, which can hang) until the next check.

The exchange uses `jax.experimental.multihost_utils.process_allgather`, a collective over the
processes' devices (gloo on CPU, NCCL on GPU).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterable

import numpy as np

from kvjax.config import CacheConfig
from kvjax.errors import KVCacheError

log = logging.getLogger(__name__)


class RankDivergenceError(KVCacheError, RuntimeError):
    """The processes' ledgers (or settings) differ: continuing would serve different KV."""


def process_count() -> int:
    import jax

    return jax.process_count()


def process_index() -> int:
    import jax

    return jax.process_index()


def spans_processes(mesh) -> bool:
    """Does `mesh` hold devices of more than one process?"""
    if mesh is None:
        return False
    return len({d.process_index for d in mesh.devices.flat}) > 1


def _allgather(values: np.ndarray) -> np.ndarray:
    """[processes, *values.shape]: every process's `values`, the same on every process."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values, tiled=False))


def _settings_digest(config: CacheConfig, extra: Iterable = ()) -> np.ndarray:
    """16 bytes (as uint8) over every cache setting except the block counts, plus `extra`."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("primary_blocks", "secondary_blocks", "event_buffer_max_size")}
    text = repr(sorted(fields.items())) + repr(list(extra))
    return np.frombuffer(hashlib.blake2b(text.encode(), digest_size=16).digest(), np.uint8)


def agree_on_cache(config: CacheConfig, extra_settings: Iterable = ()) -> CacheConfig:
    """The cache every rank will use: per window the minimum of the ranks' primary and
    secondary block counts. Raises `RankDivergenceError` if any other cache setting (or
    `extra_settings`, e.g. the engine's) differs between ranks."""
    windows = config.windows
    counts = [config.primary_blocks_for(w) for w in windows] + [config.secondary_blocks_for(w) for w in windows]
    settings = _settings_digest(config, extra_settings)
    everyone = _allgather(np.concatenate([np.asarray(counts, np.int64).view(np.uint8), settings]))
    nb = 8 * len(counts)
    differ = [i for i in range(everyone.shape[0]) if not np.array_equal(everyone[i, nb:], everyone[0, nb:])]
    if differ:
        raise RankDivergenceError(
            f"processes {differ} were started with cache or engine settings other than process 0's "
            "(every rank must get the same model, cache and engine options; only block counts may differ)"
        )
    agreed = np.ascontiguousarray(everyone[:, :nb]).view(np.int64).min(axis=0)  # [2 * windows]
    if list(agreed) == counts:
        return config
    n = len(windows)
    log.info("ranks agree on %s primary / %s secondary blocks per window (this rank had %s / %s)",
             list(agreed[:n]), list(agreed[n:]), counts[:n], counts[n:])
    return dataclasses.replace(
        config,
        primary_blocks={w: int(b) for w, b in zip(windows, agreed[:n], strict=True)},
        secondary_blocks={w: int(b) for w, b in zip(windows, agreed[n:], strict=True)},
    )


class RankDigest:
    """A running 128-bit hash of one rank's ledger decisions, compared across ranks."""

    def __init__(self, interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"the rank check interval must be a positive int, got {interval!r}")
        self.interval = interval
        self._hash = hashlib.blake2b(digest_size=16)
        self.checks = 0

    def update(self, *parts) -> None:
        """Fold `parts` (ints, strings, numpy arrays, nested lists / tuples) into the digest."""
        h = self._hash
        for p in parts:
            if isinstance(p, np.ndarray):
                h.update(b"a%d:" % p.size)
                h.update(np.ascontiguousarray(p, np.int64).tobytes())
            else:
                h.update(repr(p).encode())
            h.update(b";")

    def digest(self) -> bytes:
        return self._hash.copy().digest()

    def check(self, step: int) -> None:
        """Compare digests with every rank if `step` is a check step; raise on a difference."""
        if step % self.interval:
            return
        mine = self.digest()
        everyone = _allgather(np.frombuffer(mine, np.uint8))  # [processes, 16]
        self.checks += 1
        differ = [i for i in range(everyone.shape[0]) if bytes(everyone[i]) != bytes(everyone[0])]
        if differ:
            raise RankDivergenceError(
                f"the ledgers of processes {differ} diverged from process 0's by engine step {step} "
                f"(digest {bytes(everyone[differ[0]]).hex()} vs {bytes(everyone[0]).hex()}): they would write "
                "different KV, so the engine stops. Every process must see the same requests, in the same order, "
                "at the same steps."
            )
