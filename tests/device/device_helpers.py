"""Helpers for device tests: tiny configs and pools filled with deterministic data."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import CacheConfig
from kvjax.device import allocate_pools
from kvjax.device.pools import KVPools

DTYPES = ("float32", "bfloat16")
LAYOUTS = ("block_first", "layer_first")


def make_config(layout="block_first", dtype="float32", **kw) -> CacheConfig:
    base = dict(tokens_per_block=4, num_layers=3, num_kv_heads=2, head_dim=8, max_seq_len=48, primary_blocks=10,
                secondary_blocks=6, dtype=dtype, layout=layout, attention_windows=(48, 6))
    base.update(kw)
    return CacheConfig(**base)


def _owned(x: np.ndarray, like) -> jax.Array:
    # A jitted copy: XLA owns the buffer (a zero-copy view of numpy memory cannot be donated).
    return jax.jit(lambda a: a.astype(like.dtype), out_shardings=like.sharding)(x)


def fill(pools: KVPools, seed: int = 0) -> KVPools:
    """Random primary and secondary contents; the null slot stays zero."""
    rng = np.random.default_rng(seed)
    ba = pools.block_axis
    prim, sec = [], []
    for a, s in zip(pools.primary, pools.secondary):
        x = rng.standard_normal(a.shape).astype(np.float32)
        if ba == 0:
            x[-1] = 0
        else:
            x[:, -1] = 0
        prim.append(_owned(x, a))
        if s is None:
            sec.append(None)
        else:
            y = rng.standard_normal(s.shape).astype(np.float32)
            sec.append(jax.device_put(jnp.asarray(y, s.dtype), s.sharding))  # host tier: a transfer, owned
    return pools.replace(primary=tuple(prim), secondary=tuple(sec))


def snapshot(pools: KVPools):
    """Host copies taken from device copies: converting a pool array itself can leave a cached
    zero-copy numpy view on it (jax 0.11), which then blocks its in-place donation."""
    return ([np.array(jnp.copy(a)) for a in pools.primary],
            [None if s is None else np.array(jnp.copy(s)) for s in pools.secondary])


def assert_pools_equal(pools: KVPools, expected) -> None:
    prim, sec = snapshot(pools)
    for i, (a, e) in enumerate(zip(prim, expected[0])):
        np.testing.assert_array_equal(a, e, err_msg=f"primary pool {i}")
    for i, (a, e) in enumerate(zip(sec, expected[1])):
        if e is not None:
            np.testing.assert_array_equal(a, e, err_msg=f"secondary pool {i}")


def random_tables(rng, pool, batch: int, max_blocks: int, tpb: int, *, disjoint: bool = False):
    """Distinct random slots per row (across rows too when `disjoint`), null-slot padding,
    ragged lengths (row 0 full, others random, possibly empty)."""
    table = np.full((batch, max_blocks), pool.null_slot, np.int32)
    lens = np.zeros(batch, np.int32)
    free = list(rng.permutation(pool.primary_blocks))
    for b in range(batch):
        n_blocks = int(rng.integers(0, max_blocks + 1)) if b else max_blocks
        n_blocks = min(n_blocks, len(free) if disjoint else pool.primary_blocks)
        if disjoint:
            table[b, :n_blocks], free = free[:n_blocks], free[n_blocks:]
        else:
            table[b, :n_blocks] = rng.choice(pool.primary_blocks, n_blocks, replace=False)
        lens[b] = 0 if n_blocks == 0 else int(rng.integers((n_blocks - 1) * tpb + 1, n_blocks * tpb + 1))
    return table, lens


def assert_pools_match(a: KVPools, b: KVPools) -> None:
    """Every array of two pools equal (primary, secondary and, for FP8, their scales)."""
    arrays = lambda p: (*p.primary, *p.secondary, *p.primary_scales, *p.secondary_scales)  # noqa: E731
    for i, (x, y) in enumerate(zip(arrays(a), arrays(b))):
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_array_equal(np.array(jnp.copy(x)), np.array(jnp.copy(y)), err_msg=f"array {i}")
