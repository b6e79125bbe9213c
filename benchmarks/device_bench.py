"""Device-side bandwidth: gather, write, copy and tier swaps on pools far larger than the
CPU's last-level cache, as ratios to two ceilings measured in the same run:
  numpy   `np.copyto` into a preallocated buffer (the machine's copy bandwidth)
  xla     XLA's own streaming rate: a donated elementwise `x + 1` over a large array
  xla_fresh  the same `x + 1` without donation: a fresh output buffer every call, as any op
          that returns a new array pays (gather_kv does). On a CPU a fresh buffer of this size
          is a new mmap whose pages fault on first touch, often the dominant cost (measured
          2-3x cheaper with transparent huge pages, e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1
          where THP is in `madvise` mode: an environment setting, not used by default).
All rates count bytes *moved* (each byte read once and written once), so they compare
directly with a copy. Also: paged decode attention vs dense attention over the same K/V.

    python benchmarks/device_bench.py [--quick] [--impl xla|pallas] [--strategy ...] [--out results/device_bench.json]

Why gather/write stay well below XLA streaming on CPU (formulations measured in one run, best of
5-8, 2 GiB bf16 pool; kept = the XLA path in kvjax/device):
  gather  row gather with the mask folded into the null slot (kept) 0.83-0.93 GB/s;
          block take + transpose + mask 0.41-0.51; fori_loop of DS -> transpose -> DUS 0.77-0.90;
          flat [rows, D] take: same as kept; bitcast to uint32: 0.6-0.7x of kept (extra copy).
  write   one scatter per K/V field straight from k, v (kept) decode 0.94-1.17 / prefill 2.0 GB/s;
          scatter of a stacked [N, F, H, D] temporary 0.42-0.66 / 0.68-0.73 (its page faults);
          flat row scatter 0.59 / 0.86-0.98; per-token fori DUS 1.05 / 2.2-2.3; per-block-run
          loops (also chosen on device with lax.cond) 1.2-1.4 on prefill.
XLA CPU runs gather and scatter as single-threaded element loops, and a returned array pays
its fresh pages; the donated `x + 1` baseline is vectorised on both cores and pays neither.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvjax import CacheConfig, TransferKind, TransferPlan  # noqa: E402
from kvjax.device import allocate_pools, apply_transfers, dense_attention, gather_kv, paged_attention, write_kv  # noqa: E402

GB = 1e9


def tmin(fn, reps: int) -> float:
    """Min wall time of `fn()` (which must block) over reps, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def ceilings(nbytes: int, reps: int) -> dict:
    """numpy copy, XLA streaming (the device copy rate on a GPU) and the host<->device link."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    t_np = tmin(lambda: np.copyto(dst, src), reps)
    del src, dst
    st = {"x": jnp.ones(nbytes // 4, jnp.float32)}
    step = jax.jit(lambda x: x + 1, donate_argnums=0)

    def stream():
        st["x"] = step(st["x"])
        st["x"].block_until_ready()

    t_x = tmin(stream, reps)
    fresh = jax.jit(lambda x: x + 1)
    t_f = tmin(lambda: fresh(st["x"]).block_until_ready(), reps)
    dev = jax.devices()[0]
    s_host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    s_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    x = st["x"]
    t_d2h = tmin(lambda: jax.device_put(x, s_host).block_until_ready(), reps)
    xh = jax.device_put(x, s_host)
    t_h2d = tmin(lambda: jax.device_put(xh, s_dev).block_until_ready(), reps)
    return {"numpy_copy_GBps": nbytes / t_np / GB, "xla_stream_GBps": nbytes / t_x / GB,
            "xla_fresh_GBps": nbytes / t_f / GB,
            "d2h_GBps": nbytes / t_d2h / GB, "h2d_GBps": nbytes / t_h2d / GB, "ceiling_bytes": nbytes}


def fill_random(pools, seed=0):
    key = jax.random.key(seed)
    prim = tuple(jax.jit(lambda k, s=a.shape, d=a.dtype: jax.random.normal(k, s, d), out_shardings=a.sharding)(key)
                 for a in pools.primary)
    return pools.replace(primary=prim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small pools (seconds; numbers are in-cache, not DRAM)")
    ap.add_argument("--impl", default="xla", choices=["auto", "xla", "pallas"])
    ap.add_argument("--strategy", default="auto", choices=["auto", "sequential", "bulk", "blockwise"],
                    help="apply_transfers strategy for copy and swaps")
    ap.add_argument("--out", default="results/device_bench.json")
    args = ap.parse_args()
    q = args.quick
    gpu = jax.default_backend() == "gpu"
    reps = 3 if q else (20 if gpu else 5)
    # block = layers * 2 * heads * tpb * dim * 2 bytes = 256 KiB (full), 32 KiB (quick)
    layers, heads, dim, tpb = (2, 4, 64, 16) if q else (4, 8, 128, 16)
    primary, secondary = (1024, 256) if q else ((65536, 16384) if gpu else (8192, 2048))  # GPU: 16 GiB + 4 GiB
    scale = 8 if gpu and not q else 1  # GPU: 8x larger moves so each timed op is well over launch overheads
    cfg = CacheConfig(tokens_per_block=tpb, num_layers=layers, num_kv_heads=heads, head_dim=dim, max_seq_len=1 << 16,
                      primary_blocks=primary, secondary_blocks=secondary, dtype="bfloat16")
    pool = cfg.pools[0]
    pools = fill_random(allocate_pools(cfg))
    block_bytes = layers * 2 * heads * tpb * dim * 2
    layer_block_bytes = 2 * heads * tpb * dim * 2
    rng = np.random.default_rng(0)
    res = {"jax": jax.__version__, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
           "machine": platform.processor() or platform.machine(), "quick": q, "impl": args.impl, "strategy": args.strategy,
           "pool_primary_bytes": pools.primary[0].nbytes, "pool_secondary_bytes": pools.secondary[0].nbytes}
    res.update(ceilings((64 << 20) if q else (1 << 30), reps))
    ref_np, ref_x, ref_f = res["numpy_copy_GBps"], res["xla_stream_GBps"], res["xla_fresh_GBps"]
    print(f"jax {jax.__version__} on {res['backend']} ({res['device']}); primary pool {res['pool_primary_bytes'] / 2**20:.0f} MiB, "
          f"host tier {res['pool_secondary_bytes'] / 2**20:.0f} MiB")
    print(f"ceilings: numpy.copyto {ref_np:.2f} GB/s, XLA streaming (device copy) {ref_x:.2f} GB/s, "
          f"XLA fresh-output streaming {ref_f:.2f} GB/s, "
          f"link D2H {res['d2h_GBps']:.2f} GB/s, H2D {res['h2d_GBps']:.2f} GB/s")

    def report(name, nbytes, t, link=None, fresh=False):
        rate = nbytes / t / GB
        res[name] = {"bytes": nbytes, "seconds": t, "GBps": rate, "vs_numpy": rate / ref_np, "vs_xla": rate / ref_x}
        extra = ""
        if fresh:  # the op returns a new array: also compare with XLA streaming into a fresh output
            res[name]["vs_xla_fresh"] = rate / ref_f
            extra = f" | {rate / ref_f:5.2f}x XLA fresh-output"
        if link:
            res[name]["vs_link"] = rate / res[link]
            extra = f" | {rate / res[link]:5.2f}x {link[:3].upper()} link"
        print(f"{name:>13}: {nbytes / 2**20:8.1f} MiB in {t * 1e3:8.2f} ms = {rate:6.2f} GB/s | "
              f"{rate / ref_np:5.2f}x numpy copy | {rate / ref_x:5.2f}x XLA streaming{extra}")

    # ---- gather: one layer of `batch` requests x `blocks` blocks each, random slots
    batch, blocks = (8, 64) if q else (32 * scale, 128)
    table = rng.integers(0, primary, (batch, blocks)).astype(np.int32)
    lens = np.full(batch, blocks * tpb, np.int32)
    table_d, lens_d = jnp.asarray(table), jnp.asarray(lens)
    t = tmin(lambda: jax.block_until_ready(gather_kv(pools, 1, table_d, lens_d, impl=args.impl)), reps)
    report("gather", batch * blocks * layer_block_bytes, t, fresh=True)

    # ---- write: n_tok tokens of one layer; "write": decode-like, every token at a random
    # (slot, offset); "write_prefill": prefill-like, whole blocks of consecutive offsets
    n_tok = 8192 if q else 32768 * scale
    k = jnp.asarray(rng.standard_normal((n_tok, heads, dim)), jnp.bfloat16)
    st = {"p": pools}
    decode_slots = rng.choice(primary * tpb, n_tok, replace=False).astype(np.int32)
    prefill_slots = (rng.choice(primary, n_tok // tpb, replace=False)[:, None] * tpb + np.arange(tpb)).reshape(-1)

    def write(slots):
        slots_d = jnp.asarray(slots, jnp.int32)

        def run():
            st["p"] = write_kv(st["p"], 1, k, k, slots_d, impl=args.impl)
            st["p"].primary[0].block_until_ready()
        return run

    report("write", n_tok * heads * dim * 2 * 2, tmin(write(decode_slots), reps))
    report("write_prefill", n_tok * heads * dim * 2 * 2, tmin(write(prefill_slots), reps))

    # ---- copy: full-block intra-pool copies (every layer), one segment
    n_blk = 256 if q else 1024 * scale
    perm = rng.permutation(primary)
    copy_plan = TransferPlan.from_ops([(TransferKind.COPY, 0, int(s), int(d), tpb) for s, d in zip(perm[:n_blk], perm[n_blk:2 * n_blk])])

    def copy():
        st["p"] = apply_transfers(st["p"], copy_plan, impl=args.impl, strategy=args.strategy)
        st["p"].primary[0].block_until_ready()

    report("copy", n_blk * block_bytes, tmin(copy, reps))

    # ---- swaps: offload n blocks to the host tier, onboard n blocks back
    n_sw = min(n_blk, secondary)
    host = rng.permutation(secondary)[:n_sw]
    off_plan = TransferPlan.from_ops([(TransferKind.OFFLOAD, 0, int(s), int(d), tpb) for s, d in zip(perm[:n_sw], host)])
    on_plan = TransferPlan.from_ops([(TransferKind.ONBOARD, 0, int(s), int(d), tpb) for s, d in zip(host, perm[n_sw:2 * n_sw])])

    def swap(plan):
        def run():
            st["p"] = apply_transfers(st["p"], plan, impl=args.impl, strategy=args.strategy)
            jax.block_until_ready((st["p"].primary, st["p"].secondary))
        return run

    report("swap_out", n_sw * block_bytes, tmin(swap(off_plan), reps), link="d2h_GBps")
    report("swap_in", n_sw * block_bytes, tmin(swap(on_plan), reps), link="h2d_GBps")

    # ---- paged decode attention vs dense attention over the same K/V bytes
    pools = st["p"]
    ab, ablocks = (4, 32) if q else (16 * scale, 128)
    heads_q = heads * 4
    atable = jnp.asarray(rng.permutation(primary)[: ab * ablocks].reshape(ab, ablocks).astype(np.int32))
    alens = jnp.full((ab,), ablocks * tpb, jnp.int32)
    qd = jnp.asarray(rng.standard_normal((ab, 1, heads_q, dim)), jnp.bfloat16)
    kd, vd = gather_kv(pools, 1, atable, alens, impl="xla")
    kd, vd = jnp.array(kd, copy=True), jnp.array(vd, copy=True)
    dense = jax.jit(lambda q_, k_, v_, l_: dense_attention(q_, k_, v_, l_, scale=dim ** -0.5, window=cfg.layer_windows[1]))
    t_dense = tmin(lambda: dense(qd, kd, vd, alens).block_until_ready(), reps)
    t_paged = tmin(lambda: paged_attention(qd, pools, 1, atable, alens, impl=args.impl).block_until_ready(), reps)
    kv_bytes = ab * ablocks * layer_block_bytes
    res["attention"] = {"kv_bytes": kv_bytes, "dense_s": t_dense, "paged_s": t_paged, "paged_vs_dense": t_dense / t_paged}
    print(f"attention: decode over {kv_bytes / 2**20:.1f} MiB of K/V: dense {t_dense * 1e3:.2f} ms, paged {t_paged * 1e3:.2f} ms "
          f"= {t_dense / t_paged:.2f}x dense speed")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
