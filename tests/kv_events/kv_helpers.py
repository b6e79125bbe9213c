"""Helpers of the KV-events tests: the ledger's own view of what it caches (walked from its
tree), the same view rebuilt from wire events, and a seeded random serving driver that makes a
ledger store, reuse, evict, offload and onboard blocks (partial ones too)."""
from __future__ import annotations

import collections
import random

from kvjax import CacheConfig, KVCacheManager, Request, RetentionConfig, TokenRangeRetention
from kvjax.kv_events import MEDIUM_CPU, MEDIUM_GPU
from kvjax.router import PrefixIndex

MEDIA = (MEDIUM_GPU, MEDIUM_CPU)


def small_config(**overrides) -> CacheConfig:
    base = dict(tokens_per_block=4, num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=96,
                primary_blocks=24, secondary_blocks=12, event_buffer_max_size=4096)
    base.update(overrides)
    return CacheConfig(**base)


def ledger_view(ledger: KVCacheManager) -> dict[tuple[int, str], set]:
    """(group, medium) -> hashes of the FULL blocks attached to the ledger's tree (the wire
    announces full blocks only). Walks the tree: the ledger's ground truth, not its events."""
    tpb = ledger.tokens_per_block
    group = {w: i for i, w in enumerate(ledger.windows)}
    out: dict[tuple[int, str], set] = collections.defaultdict(set)
    inspector = ledger.inspector
    for window in ledger.windows:
        w = window if len(ledger.windows) > 1 else None
        for bid in inspector.cached_block_ids(w):
            blk = ledger.block(bid, w)
            if blk.key.num_tokens != tpb:
                continue
            out[(group[window], MEDIA[blk.level])].add(inspector.block_hash(bid, w))
    return dict(out)


def index_view(index: PrefixIndex, replica, num_groups: int) -> dict[tuple[int, str], set]:
    out = {}
    for g in range(num_groups):
        for m in MEDIA:
            hashes = index.blocks(replica, m, group=g)
            if hashes:
                out[(g, m)] = hashes
    return out


class RandomDriver:
    """Requests over a few shared prefixes with random suffixes, LoRA ids and salts, some with
    retention priorities (so blocks offload to the secondary tier and come back)."""

    def __init__(self, ledger: KVCacheManager, seed: int, vocab: int = 50) -> None:
        self.ledger = ledger
        self.rng = random.Random(seed)
        self.vocab = vocab
        tpb = ledger.tokens_per_block
        self.prefixes = [[self.rng.randrange(1, vocab) for _ in range(self.rng.randrange(tpb, 6 * tpb))] for _ in range(4)]
        self.live: dict[str, int] = {}  # request id -> tokens still to generate
        self.n = 0

    def _request(self) -> Request:
        rng = self.rng
        prompt = list(rng.choice(self.prefixes)) + [rng.randrange(1, self.vocab) for _ in range(rng.randrange(1, 9))]
        self.n += 1
        retention = None
        if rng.random() < 0.5:
            retention = RetentionConfig((TokenRangeRetention(0, len(prompt), rng.choice([20, 80])),), decode_priority=20)
        return Request(f"r{self.n}", prompt, max_new_tokens=rng.randrange(0, 9), lora_task_id=rng.choice([None, None, 3]),
                       cache_salt=rng.choice([None, None, "t1"]), retention=retention)

    def step(self) -> None:
        """One serving iteration: maybe admit, grow every live request, finish some."""
        led, rng = self.ledger, self.rng
        if len(self.live) < 4 and rng.random() < 0.8:
            req = self._request()
            try:
                led.add_sequence(req)
            except Exception as e:  # OutOfBlocksError: the ledger is full, try later
                assert type(e).__name__ == "OutOfBlocksError", e
            else:
                led.store_context_blocks(req.request_id)
                self.live[req.request_id] = req.max_new_tokens
        for rid in list(self.live):
            if self.live[rid] == 0 or rng.random() < 0.05:
                led.remove_sequence(rid)
                del self.live[rid]
                continue
            try:
                led.add_token(rid, rng.randrange(1, self.vocab))
            except Exception as e:
                assert type(e).__name__ == "OutOfBlocksError", e
                led.remove_sequence(rid)
                del self.live[rid]
                continue
            led.store_new_block(rid)
            self.live[rid] -= 1
        led.refresh_blocks()
        led.flush_iteration_events()

    def finish_all(self) -> None:
        for rid in list(self.live):
            self.ledger.remove_sequence(rid)
            del self.live[rid]
        self.ledger.flush_iteration_events()
