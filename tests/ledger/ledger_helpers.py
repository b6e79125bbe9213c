"""Shared helpers of the ledger tests: tiny configs, a fake clock, queue/tree inspection and
a slot-content model that replays `TransferPlan`s op by op.

Only public API plus the documented inspection views (`KVCacheManager.block(id, window)` and
`KVCacheManager.inspector`) is used to read results; free-queue order comes from the
inspector because docs/semantics.md pins it ("never-used before released, release to the
back, last block first") and no scheduling query exposes it.
"""
from __future__ import annotations

from kvjax import CacheConfig, KVCacheManager, TransferKind
from kvjax.ledger import cache_salt_id

TPB = 4


def make_config(**overrides) -> CacheConfig:
    """One window, one layer, one pool: tokens_per_block 4, 8 primary blocks, max_seq_len 64."""
    base = dict(
        tokens_per_block=TPB,
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        max_seq_len=64,
        primary_blocks=8,
    )
    base.update(overrides)
    return CacheConfig(**base)


def make_manager(clock=None, **overrides) -> KVCacheManager:
    cfg = make_config(**overrides)
    return KVCacheManager(cfg) if clock is None else KVCacheManager(cfg, clock=clock)


class FakeClock:
    """Injectable monotonic clock (seconds)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def free_order(m: KVCacheManager, window: int | None = None, level: int = 0) -> list[int]:
    """Ids of the free blocks of `level` in eviction order (lowest priority first, LRU first)."""
    return m.inspector.free_order(window, level)


def free_queue(m: KVCacheManager, priority: int, window: int | None = None, level: int = 0) -> list[int]:
    return m.inspector.free_queue(priority, window, level)


def cached_ids(m: KVCacheManager, window: int | None = None) -> set[int]:
    """Ids of the blocks of `window` attached to the radix tree."""
    return m.inspector.cached_block_ids(window)


def cached_tokens(m: KVCacheManager, block_id: int, window: int | None = None) -> tuple[int, ...] | None:
    """The full token path (prefix + own key tokens) a cached block stands for."""
    keys = m.inspector.cached_path(block_id, window)
    if keys is None:
        return None
    return tuple(t for key in keys for t in key.tokens)


def plan_ops(m: KVCacheManager) -> list[tuple[str, int, int, int, int]]:
    """`take_transfers()` as readable tuples (kind name, pool, src, dst, num_tokens)."""
    return [(TransferKind(op.kind).name, op.pool, op.src, op.dst, op.num_tokens) for op in m.take_transfers()]


# --------------------------------------------------------------------------- slot-content model
def tag(lora, salt_id, tokens, i, extra=None):
    """What position i of a sequence's KV depends on: every earlier token and the isolation keys."""
    return (lora, salt_id, tuple(tokens[: i + 1]), None if extra is None else tuple(extra[: i + 1]))


class SlotModel:
    """Per pool, the content of every primary and secondary slot: one tag per token position
    (None = never written / undefined). `apply` replays a `TransferPlan` with the semantics of
    kvjax/transfer_plan.py; `write` is what a model forward does to the slot table."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.tpb = config.tokens_per_block
        self.primary = {p.index: [[None] * self.tpb for _ in range(p.num_slots)] for p in config.pools}
        self.secondary = {p.index: [[None] * self.tpb for _ in range(max(p.secondary_blocks, 0))] for p in config.pools}

    def apply(self, plan) -> None:
        for op in plan:
            self.apply_op(op.kind, op.pool, op.src, op.dst, op.num_tokens)

    def apply_op(self, kind: int, pool: int, src: int, dst: int, n: int) -> None:
        """One plan entry (`apply` is these in order)."""
        tpb, op = self.tpb, (kind, pool, src, dst, n)
        kind = TransferKind(kind)
        pspec = self.config.pools[pool]
        assert 1 <= n <= tpb, op
        if kind is TransferKind.OFFLOAD:
            assert n == tpb, op
            assert 0 <= src < pspec.primary_blocks and 0 <= dst < pspec.secondary_blocks, op
            self.secondary[pool][dst] = list(self.primary[pool][src])
        elif kind is TransferKind.ONBOARD:
            assert 0 <= src < pspec.secondary_blocks and 0 <= dst < pspec.primary_blocks, op
            self.primary[pool][dst] = list(self.secondary[pool][src][:n]) + [None] * (tpb - n)
        else:
            assert 0 <= src < pspec.primary_blocks and 0 <= dst < pspec.primary_blocks and src != dst, op
            self.primary[pool][dst] = list(self.primary[pool][src][:n]) + [None] * (tpb - n)

    def lose(self, kind: int, pool: int, dst: int, n: int, garbage=("lost",)) -> None:
        """A failed plan entry: its destination's first `n` positions hold garbage."""
        store = self.secondary if TransferKind(kind) is TransferKind.OFFLOAD else self.primary
        store[pool][dst] = [garbage] * n + list(store[pool][dst][n:])

    def null_slot(self, window: int) -> int:
        """The window's null slot (every pool of a window has the same)."""
        return next(p.null_slot for p in self.config.pools if p.window == window)

    def write(self, window: int, slot: int, offset: int, value) -> None:
        for p in self.config.pools:
            if p.window == window:
                assert slot != p.null_slot, "a forward would write into the null slot"
                self.primary[p.index][slot][offset] = value

    def read(self, window: int, level: int, slot: int) -> list:
        """A slot's content; every pool of the window must agree (one plan entry per pool)."""
        store = self.primary if level == 0 else self.secondary
        pools = self.config.window_pools[window]
        content = store[pools[0]][slot]
        for p in pools[1:]:
            assert store[p][slot] == content, f"pools {pools[0]} and {p} of window {window} disagree at slot {slot}"
        return content


def salt(s):
    return cache_salt_id(s)


def busy_manager() -> KVCacheManager:
    """A ledger with a bit of everything: live sequences (one with two beams), cached, offloaded
    and onboarded blocks, pinned blocks of a removed request, an armed retention expiry, pending
    and published events, and an open one-op transfer plan (a partial-reuse copy)."""
    from kvjax import Request, RetentionConfig, TokenRangeRetention

    clock = FakeClock()
    m = make_manager(clock=clock, primary_blocks=14, secondary_blocks=2, max_beam_width=2, event_buffer_max_size=256)
    keep = RetentionConfig((TokenRangeRetention(0, None, 60, 100.0),))
    m.add_sequence(Request("seed", list(range(9)), retention=keep))
    m.remove_sequence("seed")  # blocks of [0..8) cached at priority 60, expiry armed
    m.add_sequence(Request("big", list(range(500, 552))))  # 13 blocks: offloads the seed chain
    m.remove_sequence("big", store_for_reuse=False)
    m.add_sequence(Request("a", list(range(13)), max_new_tokens=6))  # onboards the seed chain
    m.add_token("a", 13)
    m.add_token("a", 14)
    m.add_sequence(Request("b", list(range(100, 106)), max_new_tokens=4, beam_width=2))
    m.add_sequence(Request("p", list(range(200, 205))))
    m.pin_blocks("p")
    m.remove_sequence("p")
    m.store_context_blocks("a")
    m.flush_iteration_events()
    m.take_transfers()
    m.add_sequence(Request("c", [0, 1, 2, 3, 4, 5, 99, 98]))  # block [4..8) of "a" copied: 2 tokens
    plan = m.take_transfers()
    assert len(plan) == 1 and TransferKind(int(plan.kind[0])) is TransferKind.COPY, plan_ops
    m.store_context_blocks("b")  # a pending Stored event
    m.verify_integrity()
    return m
