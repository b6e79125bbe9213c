"""Data integrity through the ledger: drive a real `KVCacheManager` with tiny pools through
reuse, partial reuse, eviction, offload and onboard; apply every plan; write K/V whose
values are a function of (token prefix, position, layer, field) for exactly the positions an
engine computes; and check that every live sequence gathers exactly what its tokens imply
(so nothing ever reads another request's KV). float32 and FP8 pools."""
import zlib

import numpy as np
import pytest

from kvjax import CacheConfig, KVCacheManager, OutOfBlocksError, Request, TransferKind
from kvjax.device import allocate_pools, apply_transfers, build_kvcache_offsets, gather_kv, pad_block_table, pad_seq_lens, pad_slot_mapping, write_kv

TPB, LAYERS, HEADS, DIM = 4, 2, 1, 4


def kv_value(tokens, pos: int, layer: int, field: int) -> np.ndarray:
    """`[HEADS, DIM]` float32, exact: depends on tokens[:pos+1], layer and field only."""
    h = zlib.crc32(np.asarray(tokens[: pos + 1], np.int32).tobytes()) % 32768
    return (h * 64 + layer * 8 + field * 4 + np.arange(HEADS * DIM, dtype=np.float32) % 4).reshape(HEADS, DIM).astype(np.float32)


def kv_value_fp8(tokens, pos: int, layer: int, field: int) -> np.ndarray:
    """Like `kv_value`, exact in FP8 pools: each element is +-(4..7) * 2^(-4..3) (3
    significant bits, a range every block scale holds), drawn from the prefix hash, so two
    different (prefix, position, layer, field) almost never share a vector."""
    h = zlib.crc32(np.asarray(tokens[: pos + 1], np.int32).tobytes() + bytes([layer, field]))
    d = np.arange(HEADS * DIM)
    e = ((h >> (5 * d)) % 8).astype(np.float32) - 4
    m = 4 + (h >> (5 * d + 3)) % 4
    return ((1 - 2 * field) * m * 2.0**e).reshape(HEADS, DIM).astype(np.float32)


class Engine:
    """The device half of a serving loop, minimal: plans first, then K/V of new positions."""

    def __init__(self, config: CacheConfig, impl: str):
        self.cfg, self.impl = config, impl
        self.value = kv_value_fp8 if config.dtype == "float8_e4m3fn" else kv_value
        self.mgr = KVCacheManager(config)
        self.pools = allocate_pools(config)
        self.tokens: dict[int, list[int]] = {}
        self.written: dict[int, int] = {}
        self.kinds = {k: 0 for k in TransferKind}
        self.reused_tokens = 0

    def apply_plan(self):
        plan = self.mgr.take_transfers()
        for k in plan.kind.tolist():
            self.kinds[TransferKind(k)] += 1
        self.pools = apply_transfers(self.pools, plan, impl=self.impl)

    def add(self, rid: int, prompt: list[int]) -> bool:
        try:
            pre = self.mgr.add_sequence(Request(request_id=rid, prompt=prompt, max_new_tokens=8))
        except OutOfBlocksError:
            return False
        self.apply_plan()
        self.tokens[rid], self.written[rid] = list(prompt), pre
        self.reused_tokens += pre
        self.compute(rid)
        self.mgr.store_context_blocks(rid)
        return True

    def decode(self, rid: int, token: int):
        try:
            self.mgr.add_token(rid, token)
        except OutOfBlocksError:  # what a scheduler would do: preempt the request
            self.remove(rid)
            return
        self.apply_plan()
        self.tokens[rid].append(token)
        self.compute(rid)

    def remove(self, rid: int):
        self.mgr.remove_sequence(rid)
        self.apply_plan()
        del self.tokens[rid], self.written[rid]

    def compute(self, rid: int):
        """Write K/V for positions [written, len(tokens)): what the model computes."""
        toks, start = self.tokens[rid], self.written[rid]
        pos = np.arange(start, len(toks))
        table = self.mgr.block_table([rid])[0]
        # bucketed token count (padding slots are -1): a handful of compiled shapes
        slot_mapping = pad_slot_mapping((table[pos // TPB] * TPB + pos % TPB).astype(np.int32))
        n = slot_mapping.shape[0]
        for layer in range(LAYERS):
            k = np.zeros((n, HEADS, DIM), np.float32)
            v = np.zeros((n, HEADS, DIM), np.float32)
            k[: len(pos)] = [self.value(toks, p, layer, 0) for p in pos]
            v[: len(pos)] = [self.value(toks, p, layer, 1) for p in pos]
            self.pools = write_kv(self.pools, layer, k, v, slot_mapping, impl=self.impl)
        self.written[rid] = len(toks)

    def verify(self):
        self.mgr.verify_integrity()
        rids = sorted(self.tokens)
        if not rids:
            return
        table = self.mgr.block_table(rids, max_blocks=self.cfg.max_blocks_per_seq)
        # the ledger's KVCacheIndex offsets equal the device builder's for the same slots
        np.testing.assert_array_equal(self.mgr.block_offsets(rids, max_blocks=table.shape[1]),
                                      np.asarray(build_kvcache_offsets(self.cfg, table)))
        table = pad_block_table(table, self.cfg.pools[0].null_slot, max_blocks=table.shape[1])
        lens = pad_seq_lens(np.array([len(self.tokens[r]) for r in rids], np.int32))
        for layer in range(LAYERS):
            k, v = (np.asarray(x, np.float32) for x in gather_kv(self.pools, layer, table, lens, impl=self.impl))
            for i, r in enumerate(rids):
                toks = self.tokens[r]
                want_k = np.stack([self.value(toks, p, layer, 0) for p in range(len(toks))])
                want_v = np.stack([self.value(toks, p, layer, 1) for p in range(len(toks))])
                np.testing.assert_array_equal(k[i, : len(toks)], want_k, err_msg=f"K of request {r}, layer {layer}")
                np.testing.assert_array_equal(v[i, : len(toks)], want_v, err_msg=f"V of request {r}, layer {layer}")


@pytest.mark.parametrize("layout,impl,dtype", [("block_first", "xla", "float32"), ("layer_first", "xla", "float32"),
                                                ("block_first", "pallas", "float32"),
                                                ("layer_first", "xla", "float8_e4m3fn")])
def test_ledger_driven_integrity(layout, impl, dtype):
    """FP8 pools too: their values are exact in e4m3, and every move (offload, onboard,
    partial copy) must carry the block scales with the bytes, or reads come back wrong."""
    cfg = CacheConfig(tokens_per_block=TPB, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, max_seq_len=32,
                      primary_blocks=8, secondary_blocks=6, dtype=dtype, layout=layout)
    eng = Engine(cfg, impl)
    rng = np.random.default_rng(7)
    systems = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
    next_id = 0
    for step in range(40 if impl == "xla" else 16):
        live = sorted(eng.tokens)
        action = rng.random()
        if action < 0.45 or not live:
            sys_prompt = systems[int(rng.integers(0, 2))]
            cut = int(rng.integers(2, len(sys_prompt) + 1))  # shared prefixes of every length: partial reuse
            prompt = sys_prompt[:cut] + rng.integers(100, 104, int(rng.integers(1, 5))).tolist()
            if eng.add(next_id, prompt):
                next_id += 1
        elif action < 0.75:
            for rid in live:
                if len(eng.tokens[rid]) < cfg.max_seq_len - 1:
                    eng.decode(rid, int(rng.integers(100, 104)))
        else:
            eng.remove(live[int(rng.integers(0, len(live)))])
        eng.verify()
    for rid in sorted(eng.tokens):
        eng.remove(rid)
    # a prompt seen long ago comes back: its blocks are onboarded from the host tier or reused
    eng.add(next_id, systems[1] + [100, 101])
    eng.verify()
    assert eng.reused_tokens > 0
    if impl == "xla":  # the long run must exercise every kind of move
        assert all(eng.kinds[k] > 0 for k in TransferKind), eng.kinds
