"""`apply_transfers`: carry out a ledger `TransferPlan` on the pools (donated, in place).

Semantics (docs/device.md, "Transfers"): entries take effect one by one, in order
  OFFLOAD  primary[pool][src]   -> secondary[pool][dst]   whole block
  ONBOARD  secondary[pool][src] -> primary[pool][dst]     first num_tokens tokens
  COPY     primary[pool][src]   -> primary[pool][dst]     first num_tokens tokens
(a partial write changes only the first num_tokens token positions of the destination
block, for every layer, K/V field and head).

FP8 pools move their block scales with their blocks (same slots, same tiers). A partial
write merges two blocks that may have different scales: the destination takes the larger
of the two scales per (layer, field, head) and both parts are rescaled to it, so every value
is kept (exactly, since scales are powers of two, unless it drops into fp8's subnormal range).

Strategies (`strategy=`):

"sequential" (default on CPU): per pool, entries in plan order, as fori loops of in-place
dynamic_slice -> dynamic_update_slice, one loop per run of same-kind entries. That *is* the
one-by-one semantics, needs no staging buffer, and on XLA CPU each block move is a memcpy:
measured 3.3x faster than gather + scatter there (XLA CPU gathers/scatters element by
element, and a fresh staging buffer page-faults on every call).

"bulk" / "blockwise" (batched; "blockwise" is the default on GPU): the plan is cut on the
host into *segments*, maximal runs of consecutive entries in which no entry reads or
writes a location that an earlier entry of the run writes
(read-after-write and write-after-write hazards). Reading everything first and writing
everything afterwards then equals the in-order application (write-after-read is harmless),
so a segment runs as one jitted step: one gather of all sources into a staging buffer, one
bulk device->host and one host->device transfer, one scatter into each tier. A typical
step (evictions to host, onboards into the freed slots, partial-reuse copies) is a single
segment. Per-kind entry counts are bucketed to powers of two (padding entries write out of
range and are dropped), so a serving loop compiles a handful of variants.

Host-side moves of the batched strategies:
  "bulk"       gather on device -> one device_put to pinned_host -> scatter on the host
               array (and the mirror image for onboards). One transfer per direction.
  "blockwise"  a fori_loop of dynamic_slice -> device_put -> dynamic_update_slice per block,
               the pattern XLA's host-offload pass turns into one DMA per block (a block is
               one contiguous chunk in block_first layout). Default on GPU, where XLA may
               refuse compute (gather/scatter) on host-memory arrays; gather and scatter on
               the device stay vectorised (one kernel each). benchmarks/gpu_check.sh measures
               every strategy.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.device import _checks as chk
from kvjax.device import backend, quant
from kvjax.device import sharding as shd
from kvjax.device.buckets import bucket
from kvjax.device.pools import KVPools, PoolMeta
from kvjax.transfer_plan import TransferKind, TransferPlan

STRATEGIES = ("auto", "sequential", "bulk", "blockwise")
_PRIMARY, _SECONDARY = 0, 1


@dataclasses.dataclass(frozen=True)
class Segment:
    """One hazard-free run, split by kind; arrays are `[num_pools, bucket]` int32."""

    off_src: np.ndarray
    off_dst: np.ndarray
    on_src: np.ndarray
    on_dst: np.ndarray
    on_n: np.ndarray
    cp_src: np.ndarray
    cp_dst: np.ndarray
    cp_n: np.ndarray
    partial: bool  # some ONBOARD/COPY writes fewer than tokens_per_block tokens

    def arrays(self):
        return (self.off_src, self.off_dst, self.on_src, self.on_dst, self.on_n, self.cp_src, self.cp_dst, self.cp_n)


_PLAN_FIELDS = ("kind", "pool", "src", "dst", "num_tokens")
_KIND_MIN, _KIND_MAX = min(TransferKind), max(TransferKind)  # kinds are 0, 1, 2


def validate_plan(config, plan: TransferPlan) -> None:
    """Host checks of a plan against the pools' geometry: integer fields that fit int32 (a
    wider or float array is never narrowed silently), valid kinds, slots inside their tier
    (the null slot is never a destination), token counts in range."""
    if not isinstance(plan, TransferPlan):
        raise ValueError(f"plan must be a TransferPlan, got {type(plan)=}")
    n = None
    for name in _PLAN_FIELDS:
        a = getattr(plan, name)
        if not isinstance(a, np.ndarray) or a.ndim != 1:
            raise ValueError(f"plan.{name} must be a 1-D numpy array, got {type(a).__name__} {getattr(a, 'shape', '')}")
        if a.dtype.kind not in "iu":
            raise ValueError(f"plan.{name} must hold integers, got dtype {a.dtype}")
        if a.dtype != np.int32 and (a.dtype.itemsize > 4 or a.dtype == np.uint32):  # only these can leave int32
            if a.size and (int(a.min()) < chk.INT32_MIN or int(a.max()) > chk.INT32_MAX):
                raise ValueError(f"plan.{name} holds values outside int32 (min {int(a.min())}, max {int(a.max())})")
        if n is not None and a.shape[0] != n:
            raise ValueError(f"plan arrays differ in length: {name} has {a.shape[0]}, expected {n}")
        n = a.shape[0]
    if not len(plan):
        return
    if plan.kind.min() < _KIND_MIN or plan.kind.max() > _KIND_MAX:
        raise ValueError(f"plan.kind holds values outside TransferKind: {np.unique(plan.kind).tolist()}")
    pools = config.pools
    if plan.pool.min() < 0 or plan.pool.max() >= len(pools):
        raise ValueError(f"plan.pool entries must be in [0, {len(pools)}), got {np.unique(plan.pool).tolist()}")
    tpb = config.tokens_per_block
    prim = np.array([p.primary_blocks for p in pools])[plan.pool]  # real slots, null slot excluded
    sec = np.array([p.secondary_blocks for p in pools])[plan.pool]
    kind = plan.kind
    src_lim = np.where(kind == TransferKind.ONBOARD, sec, prim)
    dst_lim = np.where(kind == TransferKind.OFFLOAD, sec, prim)
    for name, val, lim in (("src", plan.src, src_lim), ("dst", plan.dst, dst_lim)):
        bad = (val < 0) | (val >= lim)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"plan entry {i} ({TransferKind(int(kind[i])).name}, pool {int(plan.pool[i])}): "
                             f"{name}={int(val[i])} is outside [0, {int(lim[i])})")
    bad = (plan.num_tokens < 1) | (plan.num_tokens > tpb) | ((kind == TransferKind.OFFLOAD) & (plan.num_tokens != tpb))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"plan entry {i}: num_tokens={int(plan.num_tokens[i])} must be in [1, {tpb}] "
                         f"(exactly {tpb} for OFFLOAD)")


def split_segments(config, plan: TransferPlan) -> list[Segment]:
    """Cut `plan` into hazard-free runs and pad each kind to a power-of-two bucket."""
    tpb, npools = config.tokens_per_block, len(config.pools)
    runs: list[list[tuple[int, int, int, int, int]]] = []
    cur: list = []
    written: set[tuple[int, int, int]] = set()
    for k, p, s, d, n in zip(*(getattr(plan, f).tolist() for f in ("kind", "pool", "src", "dst", "num_tokens")), strict=True):
        src_tier = _SECONDARY if k == TransferKind.ONBOARD else _PRIMARY
        dst_tier = _SECONDARY if k == TransferKind.OFFLOAD else _PRIMARY
        r, w = (src_tier, p, s), (dst_tier, p, d)
        if r in written or w in written:
            runs.append(cur)
            cur, written = [], set()
        cur.append((k, p, s, d, n))
        written.add(w)
    if cur:
        runs.append(cur)
    segs = []
    for run in runs:
        by: dict[TransferKind, list[list[tuple[int, int, int]]]] = {kk: [[] for _ in range(npools)] for kk in TransferKind}
        for k, p, s, d, n in run:
            by[TransferKind(k)][p].append((s, d, n))
        out = {}
        for kk, fill_dst in ((TransferKind.OFFLOAD, [q.secondary_blocks for q in config.pools]),
                             (TransferKind.ONBOARD, [q.num_slots for q in config.pools]),
                             (TransferKind.COPY, [q.num_slots for q in config.pools])):
            rows = by[kk]
            cnt = max(len(r) for r in rows)
            width = bucket(cnt) if cnt else 0
            src = np.zeros((npools, width), np.int32)
            dst = np.empty((npools, width), np.int32)
            num = np.full((npools, width), tpb, np.int32)
            for p, entries in enumerate(rows):
                dst[p] = fill_dst[p]  # out of range: the scatter drops padding entries
                for i, (s, d, n) in enumerate(entries):
                    src[p, i], dst[p, i], num[p, i] = s, d, n
            out[kk] = (src, dst, num)
        partial = bool((out[TransferKind.ONBOARD][2] < tpb).any() or (out[TransferKind.COPY][2] < tpb).any())
        segs.append(Segment(*out[TransferKind.OFFLOAD][:2], *out[TransferKind.ONBOARD], *out[TransferKind.COPY], partial=partial))
    return segs


# ----------------------------------------------------------------------------- device side
def _take(arr, idx, axis: int):
    return jnp.take(arr, idx, axis=axis, mode="clip")


def _token_mask(n, block_shape: tuple[int, ...], tok_axis: int):
    """[entries, *block] bool: token position < n (broadcastable)."""
    t = block_shape[tok_axis]
    shape = [1] * (len(block_shape) + 1)
    shape[0] = n.shape[0]
    shape[tok_axis + 1] = t
    pos = jnp.arange(t, dtype=jnp.int32).reshape([1] * (tok_axis + 1) + [t] + [1] * (len(block_shape) - tok_axis - 1))
    return pos < n.reshape([-1] + [1] * len(block_shape))


def _host_gather_bulk(sec, idx, ba: int):
    """Secondary blocks idx -> device staging, block axis first. One H2D transfer."""
    st = _take(sec, jax.device_put(idx, jax.memory.Space.Host), ba)
    st = jax.device_put(st, jax.memory.Space.Device)
    return jnp.moveaxis(st, ba, 0)


def _host_scatter_bulk(sec, staging, dst, ba: int):
    """Device staging (block axis first) -> secondary[dst]. One D2H transfer."""
    st = jax.device_put(jnp.moveaxis(staging, 0, ba), jax.memory.Space.Host)
    if ba == 0:
        return sec.at[dst].set(st, mode="drop")
    return sec.at[:, dst].set(st, mode="drop")


def _host_gather_blockwise(sec, idx, count, ba: int):
    blk_shape = sec.shape[:ba] + sec.shape[ba + 1:]
    staging = jnp.zeros((idx.shape[0],) + blk_shape, sec.dtype)

    def body(i, st):
        blk = jax.lax.dynamic_index_in_dim(sec, idx[i], ba, keepdims=False)
        blk = jax.device_put(blk, jax.memory.Space.Device)
        return jax.lax.dynamic_update_index_in_dim(st, blk, i, 0)

    return jax.lax.fori_loop(0, count, body, staging)


def _host_scatter_blockwise(sec, staging, dst, count, ba: int):
    def body(i, s):
        blk = jax.device_put(jax.lax.dynamic_index_in_dim(staging, i, 0, keepdims=True), jax.memory.Space.Host)
        return jax.lax.dynamic_update_slice_in_dim(s, jnp.moveaxis(blk, 0, ba), dst[i], ba)

    return jax.lax.fori_loop(0, count, body, sec)


def _gather_primary(arr, idx, ba: int, impl: str, mesh, axes):
    """Blocks `idx` of a primary array (pool or scales), block axis first."""
    if impl != "pallas" or arr.ndim != 6:  # scale arrays always move with XLA
        return jnp.moveaxis(_take(arr, idx, ba), ba, 0)  # [entries, *block]
    from pallas_kernels import copy_pages

    fn = functools.partial(copy_pages.gather_blocks, block_axis=ba)
    if mesh is not None:
        fn = shd.shard_map(fn, mesh, in_specs=(shd.pool_spec(axes), jax.sharding.PartitionSpec()),
                           out_specs=shd.pool_spec(axes))
    return fn(arr, idx)


def _merge_scaled(arr, sarr, staging, st_scales, dst, n, ba: int, dtype):
    """Partial writes into an FP8 pool: destination scale = max(source, destination) per
    (layer, field, head), both parts rescaled to it, then merged by token. Full-block
    entries keep the source's block and scale. Returns full blocks (and their scales)."""
    tpb = staging.shape[-2]
    old = jnp.moveaxis(_take(arr, dst, ba), ba, 0)  # [entries, L, F, H, T, D]
    old_s = jnp.moveaxis(_take(sarr, dst, ba), ba, 0)  # [entries, L, F, H]
    full = (n >= tpb)[:, None, None, None]  # [entries, 1, 1, 1]
    new_s = jnp.where(full, st_scales, jnp.maximum(st_scales, old_s))  # [entries, L, F, H]
    new = quant.rescale(staging, st_scales[..., None, None], new_s[..., None, None], dtype)
    old = quant.rescale(old, old_s[..., None, None], new_s[..., None, None], dtype)
    keep_new = _token_mask(n, staging.shape[1:], staging.ndim - 3)
    return jnp.where(keep_new, new, old), new_s


def take_blocks(arr: jax.Array, idx: jax.Array, block_axis: int) -> jax.Array:
    """Copies of blocks `idx` of one primary array (a pool or its FP8 scales), block axis first
    (`[n, *block]`; the XLA path): what a block leaves the pools as, e.g. for another process."""
    return _gather_primary(arr, idx, block_axis, "xla", None, None)


def put_blocks(arr: jax.Array, blocks: jax.Array, idx: jax.Array, block_axis: int) -> jax.Array:
    """`arr` with whole blocks `blocks[i]` (`take_blocks`' layout) written into slots `idx[i]`
    (the XLA path; donate `arr` to update it in place)."""
    return _scatter_primary(arr, blocks, idx, jnp.zeros_like(idx), False, block_axis, "xla", None, None)


def _scatter_primary(arr, staging, dst, n, partial: bool, ba: int, impl: str, mesh, axes):
    if impl == "pallas" and arr.ndim == 6:
        from pallas_kernels import copy_pages

        dst = jnp.where(dst >= arr.shape[ba], -1, dst)  # kernels skip negative entries
        fn = functools.partial(copy_pages.scatter_blocks, block_axis=ba)
        if mesh is not None:
            rep = jax.sharding.PartitionSpec()
            fn = shd.shard_map(fn, mesh, in_specs=(shd.pool_spec(axes), shd.pool_spec(axes), rep, rep),
                               out_specs=shd.pool_spec(axes))
        return fn(arr, staging, dst, n)
    if partial:
        old = jnp.moveaxis(_take(arr, dst, ba), ba, 0)  # [entries, *block]
        keep_new = _token_mask(n, staging.shape[1:], staging.ndim - 3)
        staging = jnp.where(keep_new, staging, old)
    if ba == 0:
        return arr.at[dst].set(staging, mode="drop")
    return arr.at[:, dst].set(jnp.moveaxis(staging, 0, 1), mode="drop")


def _write_primary(arr, sarr, staging, st_scales, dst, n, partial: bool, ba: int, impl: str, mesh, axes, dtype):
    """Scatter staged blocks (and FP8 scales) into a primary pool; partial entries merge."""
    if sarr is None:
        return _scatter_primary(arr, staging, dst, n, partial, ba, impl, mesh, axes), None
    if partial:  # merged in XLA: what lands is a full block at its new scale
        staging, st_scales = _merge_scaled(arr, sarr, staging, st_scales, dst, n, ba, dtype)
        n = jnp.full_like(n, staging.shape[-2])
    arr = _scatter_primary(arr, staging, dst, n, False, ba, impl, mesh, axes)
    sarr = _scatter_primary(sarr, st_scales, dst, n, False, ba, "xla", mesh, axes)
    return arr, sarr


def _pairs(xs):
    """Per pool `(kv, scales)` -> the arrays that exist."""
    return [x for x in xs if x is not None]


@functools.partial(jax.jit, static_argnames=("meta", "partial", "impl", "swap"), donate_argnames=("prim_w", "sec_w"))
def _apply_segment(prim_w, sec_w, prim_r, sec_r, off_src, off_dst, on_src, on_dst, on_n, cp_src, cp_dst, cp_n, *,
                   meta: PoolMeta, partial: bool, impl: str, swap: str):
    """One hazard-free segment. Tiers are per-pool `(kv, scales)` pairs (scales None unless
    FP8). Only the tiers it writes go in donated (`*_w`) and come back; the ones it only
    reads (`*_r`) are plain inputs, so no host array is ever passed through jit unchanged
    (its memory kind would not survive)."""
    ba = meta.block_axis
    prim = prim_w or prim_r
    sec = sec_w or sec_r
    new_prim, new_sec = [], []
    for p in range(len(prim)):
        (arr, sarr), (host, hsc) = prim[p], sec[p]
        # ---- read phase: every source (and, for partial writes, old destinations) first
        off_stage = None
        if off_src.shape[1] and host is not None:
            off_stage = [_gather_primary(a, off_src[p], ba, impl, meta.mesh, meta.kv_axes) for a in _pairs((arr, sarr))]
        parts, dsts, nums = [], [], []
        if on_src.shape[1] and host is not None:
            if swap == "bulk":
                parts.append([_host_gather_bulk(h, on_src[p], ba) for h in _pairs((host, hsc))])  # [n_on, *block]
            else:
                count = jnp.sum(on_dst[p] < arr.shape[ba])
                parts.append([_host_gather_blockwise(h, on_src[p], count, ba) for h in _pairs((host, hsc))])
            dsts.append(on_dst[p])
            nums.append(on_n[p])
        if cp_src.shape[1]:
            parts.append([_gather_primary(a, cp_src[p], ba, impl, meta.mesh, meta.kv_axes) for a in _pairs((arr, sarr))])
            dsts.append(cp_dst[p])
            nums.append(cp_n[p])
        # ---- write phase
        if prim_w:
            if parts:
                staged = [
                    jnp.concatenate(xs) if len(xs) > 1 else xs[0] for xs in zip(*parts, strict=True)
                ]  # [n_on + n_cp, *block]
                dst = jnp.concatenate(dsts) if len(dsts) > 1 else dsts[0]
                num = jnp.concatenate(nums) if len(nums) > 1 else nums[0]
                arr, sarr = _write_primary(arr, sarr, staged[0], staged[1] if sarr is not None else None, dst, num, partial,
                                           ba, impl, meta.mesh, meta.kv_axes, meta.geometry.jnp_dtype)
            new_prim.append((arr, sarr))
        if sec_w:
            if off_stage is not None:
                out = []
                for h, st in zip(_pairs((host, hsc)), off_stage, strict=True):
                    if swap == "bulk":
                        out.append(_host_scatter_bulk(h, st, off_dst[p], ba))
                    else:
                        count = jnp.sum(off_dst[p] < h.shape[ba])
                        out.append(_host_scatter_blockwise(h, st, off_dst[p], count, ba))
                host, hsc = (out[0], out[1]) if hsc is not None else (out[0], None)
            new_sec.append((host, hsc))
    return tuple(new_prim), tuple(new_sec)


def resolve_strategy(strategy: str, impl: str) -> str:
    """"auto": sequential XLA loops on CPU, batched blockwise on GPU; impl="pallas" means the
    batched path (its gather/scatter are the Pallas copy kernels)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"{strategy=} must be one of {STRATEGIES}")
    if strategy == "sequential" and impl == "pallas":
        raise ValueError("strategy='sequential' is plain XLA loops: use impl='xla', or a batched strategy with impl='pallas'")
    if strategy != "auto":
        return strategy
    if backend.on_gpu():
        return "blockwise"
    return "bulk" if impl == "pallas" else "sequential"


# ------------------------------------------------------------------------- sequential
def split_runs(config, plan: TransferPlan) -> list[tuple[int, int, np.ndarray, int]]:
    """Per pool (pools never share memory, so their entries commute), runs of consecutive
    same-kind entries: `(pool, kind, [3, bucket] int32 src/dst/num_tokens, live entries)`, entry
    order kept."""
    out = []
    tpb = config.tokens_per_block
    for p in range(len(config.pools)):
        sel = np.flatnonzero(plan.pool == p)
        if not sel.size:
            continue
        kinds = plan.kind[sel]
        cuts = np.flatnonzero(np.diff(kinds)) + 1
        for run in np.split(sel, cuts):
            width = bucket(run.size)
            arr = np.zeros((3, width), np.int32)
            arr[2] = tpb
            arr[0, : run.size], arr[1, : run.size], arr[2, : run.size] = plan.src[run], plan.dst[run], plan.num_tokens[run]
            out.append((p, int(plan.kind[run[0]]), arr, run.size))
    return out


def _merge_tokens(new, old, n, tok_axis: int):
    pos = jax.lax.broadcasted_iota(jnp.int32, new.shape, tok_axis)
    return jnp.where(pos < n, new, old)


@functools.partial(jax.jit, static_argnames=("kind", "ba", "partial", "dtype"), donate_argnames=("dst_tier",))
def _sequential_run(dst_tier, src_tier, ops, count, *, kind: int, ba: int, partial: bool, dtype=None):
    """Entries `ops[:, :count]` of one kind, in order: DS from `src_tier` (None: `dst_tier`
    itself, for COPY), DUS into the donated `dst_tier`. Tiers are `(kv, scales)` pairs."""
    tok_axis = 4  # pool dims: [*, *, F, H, T, D]

    def move(blk):
        if kind == TransferKind.OFFLOAD:
            return jax.device_put(blk, jax.memory.Space.Host)
        if kind == TransferKind.ONBOARD:
            return jax.device_put(blk, jax.memory.Space.Device)
        return blk

    def body(i, dst):
        (d_kv, d_sc) = dst
        s_kv, s_sc = dst if src_tier is None else src_tier
        blk = move(jax.lax.dynamic_slice_in_dim(s_kv, ops[0, i], 1, ba))  # one block, block axis kept
        blk_s = None if s_sc is None else move(jax.lax.dynamic_slice_in_dim(s_sc, ops[0, i], 1, ba))
        if partial:
            n = ops[2, i]
            old = jax.lax.dynamic_slice_in_dim(d_kv, ops[1, i], 1, ba)
            if blk_s is not None:  # FP8: both parts move to the larger scale first
                old_s = jax.lax.dynamic_slice_in_dim(d_sc, ops[1, i], 1, ba)
                new_s = jnp.where(n >= d_kv.shape[tok_axis], blk_s, jnp.maximum(blk_s, old_s))
                blk = quant.rescale(blk, blk_s[..., None, None], new_s[..., None, None], dtype)
                old = quant.rescale(old, old_s[..., None, None], new_s[..., None, None], dtype)
                blk_s = new_s
            blk = _merge_tokens(blk, old, n, tok_axis)
        d_kv = jax.lax.dynamic_update_slice_in_dim(d_kv, blk, ops[1, i], ba)
        if blk_s is not None:
            d_sc = jax.lax.dynamic_update_slice_in_dim(d_sc, blk_s, ops[1, i], ba)
        return d_kv, d_sc

    return jax.lax.fori_loop(0, count, body, dst_tier)


def _apply_sequential(pools: KVPools, plan: TransferPlan) -> KVPools:
    prim = [list(t) for t in zip(pools.primary, pools.primary_scales, strict=True)]
    sec = [list(t) for t in zip(pools.secondary, pools.secondary_scales, strict=True)]
    tpb, ba = pools.geometry.tokens_per_block, pools.block_axis
    dtype = pools.geometry.jnp_dtype if pools.is_scaled else None
    for p, kind, ops, n in split_runs(pools.geometry, plan):
        partial = bool((ops[2, :n] < tpb).any())
        count = np.int32(n)
        run = functools.partial(_sequential_run, ops=ops, count=count, kind=kind, ba=ba, dtype=dtype)
        if kind == TransferKind.OFFLOAD:
            sec[p] = list(run(tuple(sec[p]), tuple(prim[p]), partial=False))
        elif kind == TransferKind.ONBOARD:
            prim[p] = list(run(tuple(prim[p]), tuple(sec[p]), partial=partial))
        else:
            prim[p] = list(run(tuple(prim[p]), None, partial=partial))
    return pools.replace(primary=tuple(a for a, _ in prim), primary_scales=tuple(s for _, s in prim),
                         secondary=tuple(a for a, _ in sec), secondary_scales=tuple(s for _, s in sec))


def apply_transfers(pools: KVPools, plan: TransferPlan, *, impl: str = "auto", strategy: str = "auto") -> KVPools:
    """Apply `plan` (from `KVCacheManager.take_transfers()`) and return the new pools; the old
    ones are donated. Equal to applying the entries one by one, in order. The whole plan is
    validated before anything is donated: a rejected plan leaves the pools usable.

    `strategy`: "sequential" | "bulk" | "blockwise" | "auto" (module docstring). `impl`
    ("xla" | "pallas") picks the device-side gather/scatter of the batched strategies;
    "sequential" is plain XLA loops."""
    chk.check_pools(pools)
    validate_plan(pools.geometry, plan)
    for i in range(len(pools.geometry.pools)):
        if pools.secondary[i] is None and len(plan) and ((plan.pool == i) & (plan.kind != TransferKind.COPY)).any():
            raise ValueError(f"plan moves blocks of pool {i} to/from a secondary tier it does not have (secondary_blocks=0)")
    impl = backend.resolve(impl, "apply_transfers")
    strategy = resolve_strategy(strategy, impl)
    if not len(plan):
        return pools
    if strategy == "sequential":
        return _apply_sequential(pools, plan)
    swap = strategy
    for seg in split_segments(pools.geometry, plan):
        writes_prim = bool(seg.on_src.shape[1] or seg.cp_src.shape[1])
        writes_sec = bool(seg.off_src.shape[1])
        prim = tuple(zip(pools.primary, pools.primary_scales, strict=True))
        sec = tuple(zip(pools.secondary, pools.secondary_scales, strict=True))
        new_prim, new_sec = _apply_segment(
            prim if writes_prim else (), sec if writes_sec else (),
            () if writes_prim else prim, () if writes_sec else sec,
            *seg.arrays(), meta=pools.meta, partial=seg.partial, impl=impl, swap=swap)
        new_prim, new_sec = new_prim or prim, new_sec or sec
        pools = pools.replace(primary=tuple(a for a, _ in new_prim), primary_scales=tuple(s for _, s in new_prim),
                              secondary=tuple(a for a, _ in new_sec), secondary_scales=tuple(s for _, s in new_sec))
    return pools


def apply_transfers_reference(pools: KVPools, plan: TransferPlan) -> KVPools:
    """Oracle: entry by entry, on host copies (numpy), then back onto the original placement.
    FP8 partial writes: both parts rescaled to the larger scale, then merged."""
    validate_plan(pools.geometry, plan)
    ba = pools.block_axis
    copy = lambda xs: [None if a is None else np.array(a) for a in xs]  # noqa: E731
    prim, sec = copy(pools.primary), copy(pools.secondary)
    prim_s, sec_s = copy(pools.primary_scales), copy(pools.secondary_scales)

    def blk(a, i):
        return a[i] if ba == 0 else a[:, i]

    def rescaled(q, old, new):  # q: uint8 bit patterns of the pools' fp8 dtype
        fp8 = pools.geometry.jnp_dtype
        ratio = np.where(new > 0, old / np.where(new > 0, new, 1), 0).astype(np.float32)
        return (np.ascontiguousarray(q).view(fp8).astype(np.float32) * ratio[..., None, None]).astype(fp8).view(np.uint8)

    for op in plan:
        p, s, d, n = op.pool, op.src, op.dst, op.num_tokens
        if op.kind == TransferKind.OFFLOAD:
            (src_a, src_s), (dst_a, dst_s) = (prim[p], prim_s[p]), (sec[p], sec_s[p])
        elif op.kind == TransferKind.ONBOARD:
            (src_a, src_s), (dst_a, dst_s) = (sec[p], sec_s[p]), (prim[p], prim_s[p])
        else:
            (src_a, src_s), (dst_a, dst_s) = (prim[p], prim_s[p]), (prim[p], prim_s[p])
        new_blk = blk(src_a, s).copy()  # [L, F, H, T, D]
        if src_s is not None:
            s_src, s_dst = blk(src_s, s).copy(), blk(dst_s, d).copy()  # [L, F, H]
            s_new = s_src if n == new_blk.shape[-2] else np.maximum(s_src, s_dst)
            new_blk = rescaled(new_blk, s_src, s_new)
            blk(dst_a, d)[...] = rescaled(blk(dst_a, d), s_dst, s_new)
            blk(dst_s, d)[...] = s_new
        blk(dst_a, d)[..., :n, :] = new_blk[..., :n, :]
    put = lambda xs, like: tuple(None if a is None else jax.device_put(x, a.sharding) for x, a in zip(xs, like, strict=True))  # noqa: E731
    return pools.replace(primary=put(prim, pools.primary), secondary=put(sec, pools.secondary),
                         primary_scales=put(prim_s, pools.primary_scales), secondary_scales=put(sec_s, pools.secondary_scales))
