"""A decode block stored by `RadixTree.extend_leaf` (the shortcut a decode step's store takes)
must leave the ledger exactly as the full walk (`RadixTree.insert`) leaves it: twin ledgers,
one with the shortcut switched off, driven by the same seeded engine-like run (shared
prefixes, so some stores find their key cached already; speculative tokens and rewinds; pins;
requests that finish, storing or not; evictions in a small pool), compared op by op."""
from __future__ import annotations

import random

import pytest

from kvjax import CacheConfig, KVCacheManager, Request
from kvjax.errors import KVCacheError, OutOfBlocksError
from kvjax.ledger import radix_tree
from kvjax.ledger.radix_tree import RadixTree
from kvjax.request import RetentionConfig, TokenRangeRetention

TPB = 4


def _config(windows: tuple[int, ...] | None) -> CacheConfig:
    return CacheConfig(
        tokens_per_block=TPB, num_layers=1 if windows is None else len(windows), num_kv_heads=1, head_dim=8,
        max_seq_len=96, primary_blocks=48, event_buffer_max_size=100_000, attention_windows=windows,
    )  # fmt: skip


class _Spy:
    """Counts what `extend_leaf` answered (and answers False when `off`: the full walk)."""

    def __init__(self, off: bool) -> None:
        self.off = off
        self.taken = self.refused = 0

    def install(self, tree: RadixTree, monkeypatch_obj) -> None:
        real = tree.extend_leaf

        def extend_leaf(*args):
            if self.off:
                return False
            ok = real(*args)
            self.taken += ok
            self.refused += not ok
            return ok

        monkeypatch_obj.setattr(tree, "extend_leaf", extend_leaf)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("windows", [None, (96, 12)])
@pytest.mark.parametrize("run_limit", [6, radix_tree.RUN_LIMIT])
def test_extend_leaf_leaves_the_ledger_as_the_walk_does(seed, windows, run_limit, monkeypatch):
    """(`run_limit`: how long a leaf run may grow in place; 6 makes runs fill up, so the
    shortcut must refuse a full one as `insert` starts a new node there.)"""
    monkeypatch.setattr(radix_tree, "RUN_LIMIT", run_limit)
    rng = random.Random(seed)
    fast, walk = KVCacheManager(_config(windows)), KVCacheManager(_config(windows))
    spy = _Spy(off=False)
    spy.install(fast._bm.tree, monkeypatch)
    _Spy(off=True).install(walk._bm.tree, monkeypatch)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice((3, 8, 13)))] for _ in range(3)]
    retention = RetentionConfig([TokenRangeRetention(0, 8, 70)], decode_priority=30)
    live: dict[int, int] = {}  # request id -> draft tokens it may rewind
    next_id = 0

    def both(op: str, *args, **kwargs) -> None:
        """The same call on both ledgers: the same answer (or refusal) and the same state."""
        results = []
        for m in (fast, walk):
            try:
                results.append(("ok", getattr(m, op)(*args, **kwargs)))
            except KVCacheError as e:  # out of blocks, a rewind too deep: refused alike
                results.append((type(e).__name__, str(e)))
        assert results[0] == results[1], (op, args)
        assert fast.snapshot() == walk.snapshot(), (op, args)

    for step in range(400):
        r = rng.random()
        if (r < 0.12 or not live) and len(live) < 6:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            drafts = rng.choice((0, 0, 2))
            ret = retention if rng.random() < 0.3 else None
            req = [Request(next_id, prompt, max_new_tokens=40, num_draft_tokens=drafts, retention=ret) for _ in range(2)]
            results = []
            for m, q in zip((fast, walk), req, strict=True):
                try:
                    results.append(m.add_sequence(q))
                    m.store_context_blocks(next_id)
                except OutOfBlocksError:
                    results.append(None)
            assert results[0] == results[1]
            assert fast.snapshot() == walk.snapshot()
            if results[0] is not None:
                live[next_id] = drafts
            next_id += 1
        elif r < 0.2:
            rid = rng.choice(list(live))
            both("remove_sequence", rid, store_for_reuse=rng.random() < 0.8)
            del live[rid]
        elif r < 0.25:
            rid = rng.choice(list(live))
            if live[rid]:  # rejected draft tokens
                both("rewind", rid, rng.randrange(1, live[rid] + 1))
        elif r < 0.28:
            both("store_blocks_for_reuse", rng.choice(list(live)), pin=rng.random() < 0.3)
        else:
            for rid in list(live):
                # a repeated token run makes later requests' decode blocks match earlier ones
                tok = rng.randrange(4) if rng.random() < 0.5 else rng.randrange(50)
                both("add_token", rid, tok)
                both("store_new_block", rid)
        if step % 50 == 0:
            fast.verify_integrity()
            walk.verify_integrity()
    for m in (fast, walk):
        m.flush_iteration_events()
        m.verify_integrity()
    assert fast.get_latest_events() == walk.get_latest_events()
    assert spy.taken > 20 and spy.refused > 0  # both of the shortcut's answers were exercised
