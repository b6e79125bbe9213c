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

    python benchmarks/device_bench.py [--quick | --tiny] [--impl xla|pallas] [--strategy ...] [--out results/device_bench.json]

`--tiny` (gpu_check's dry run) runs every row at toy sizes, once: it checks the script, its
figures mean nothing.

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
import dataclasses
import functools
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
    t_np = tmin(functools.partial(np.copyto, dst, src), reps)
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
    """Unit-normal K/V in every slot (FP8 pools: e4m3 bit patterns at scale 1)."""
    key = jax.random.key(seed)
    if pools.is_scaled:
        def draw(k, s, d=pools.geometry.jnp_dtype):
            return jax.lax.bitcast_convert_type(jax.random.normal(k, s, jnp.float32).astype(d), jnp.uint8)
        sc = tuple(jax.jit(lambda s=a.shape: jnp.ones(s, jnp.float32), out_shardings=a.sharding)() for a in pools.primary_scales)
        pools = pools.replace(primary_scales=sc)
    else:
        def draw(k, s, d=pools.geometry.jnp_dtype):
            return jax.random.normal(k, s, d)
    prim = tuple(jax.jit(lambda k, s=a.shape: draw(k, s), out_shardings=a.sharding)(key) for a in pools.primary)
    return pools.replace(primary=prim)


def scan_rows(res, cfg, rng, reps, quick, scale, impl):
    """A decode step through every layer of the pool (write_kv then paged_attention per
    layer, the model's projections left out): unrolled in Python vs `jax.lax.scan` over a
    traced layer index carrying the pools. Step time and compile time of each."""
    layers = cfg.num_layers
    small = dataclasses.replace(cfg, primary_blocks=min(cfg.primary_blocks, 2048), secondary_blocks=0)
    heads, dim, tpb = cfg.num_kv_heads, cfg.head_dim, cfg.tokens_per_block
    b, blocks = (4, 32) if quick else (16 * scale, 64)
    table = jnp.asarray(rng.permutation(small.primary_blocks)[: b * blocks].reshape(b, blocks).astype(np.int32))
    lens = jnp.full((b,), blocks * tpb - 1, jnp.int32)
    slots = jnp.asarray(np.asarray(table)[:, -1] * tpb + tpb - 1, jnp.int32)  # the last position of each row
    k = jnp.asarray(rng.standard_normal((layers, b, heads, dim)), jnp.bfloat16)
    qd = jnp.asarray(rng.standard_normal((layers, b, 1, heads * 4, dim)), jnp.bfloat16)

    def layer(pools, layer_index, k_l, q_l):
        pools = write_kv(pools, layer_index, k_l, k_l, slots, impl=impl)
        return pools, paged_attention(q_l, pools, layer_index, table, lens + 1, impl=impl)

    def unrolled(pools, k, qd):
        out = jnp.zeros(qd.shape[1:], jnp.float32)
        for i in range(layers):
            pools, o = layer(pools, i, k[i], qd[i])
            out = out + o
        return pools, out

    def scanned(pools, k, qd):
        def body(carry, xs):
            pools, out = carry
            i, k_l, q_l = xs
            pools, o = layer(pools, i, k_l, q_l)
            return (pools, out + o), None

        (pools, out), _ = jax.lax.scan(body, (pools, jnp.zeros(qd.shape[1:], jnp.float32)),
                                       (jnp.arange(layers, dtype=jnp.int32), k, qd))
        return pools, out

    entry = {"layers": layers, "batch": b, "context_tokens": blocks * tpb}
    for name, fn in (("unrolled", unrolled), ("scanned", scanned)):
        st = {"p": fill_random(allocate_pools(small))}
        step = jax.jit(fn, donate_argnums=0)
        t0 = time.perf_counter()
        compiled = step.trace(st["p"], k, qd).lower().compile()
        entry[f"{name}_compile_s"] = time.perf_counter() - t0

        def run():
            st["p"], out = compiled(st["p"], k, qd)  # noqa: B023  # run() is timed within this iteration
            out.block_until_ready()

        entry[f"{name}_step_s"] = tmin(run, reps)
    entry["scanned_vs_unrolled_speed"] = entry["unrolled_step_s"] / entry["scanned_step_s"]
    res["scan_decode"] = entry
    print(f"scan_decode: {layers} layers x (write_kv + paged_attention), batch {b}, {blocks * tpb} tokens of context: "
          f"unrolled {entry['unrolled_step_s'] * 1e3:.2f} ms (compile {entry['unrolled_compile_s']:.1f} s), "
          f"scanned {entry['scanned_step_s'] * 1e3:.2f} ms (compile {entry['scanned_compile_s']:.1f} s) = "
          f"{entry['scanned_vs_unrolled_speed']:.2f}x unrolled speed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small pools (seconds; numbers are in-cache, not DRAM)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes, one repeat: checks the script (implies --quick)")
    ap.add_argument("--impl", default="xla", choices=["auto", "xla", "pallas"])
    ap.add_argument("--strategy", default="auto", choices=["auto", "sequential", "bulk", "blockwise"],
                    help="apply_transfers strategy for copy and swaps")
    ap.add_argument("--out", default="results/device_bench.json")
    args = ap.parse_args()
    q, tiny = args.quick or args.tiny, args.tiny
    gpu = jax.default_backend() == "gpu"
    reps = 3 if q else (20 if gpu else 5)
    # block = layers * 2 * heads * tpb * dim * 2 bytes = 256 KiB (full), 32 KiB (quick)
    layers, heads, dim, tpb = (2, 4, 64, 16) if q else (4, 8, 128, 16)
    primary, secondary = (1024, 256) if q else ((65536, 16384) if gpu else (8192, 2048))  # GPU: 16 GiB + 4 GiB
    if tiny:
        reps, heads, primary, secondary = 1, 2, 256, 64
    scale = 8 if gpu and not q else 1  # GPU: 8x larger moves so each timed op is well over launch overheads
    cfg = CacheConfig(tokens_per_block=tpb, num_layers=layers, num_kv_heads=heads, head_dim=dim, max_seq_len=1 << 16,
                      primary_blocks=primary, secondary_blocks=secondary, dtype="bfloat16")
    pools = fill_random(allocate_pools(cfg))
    rng = np.random.default_rng(0)
    res = {"jax": jax.__version__, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
           "machine": platform.processor() or platform.machine(), "quick": q, "impl": args.impl, "strategy": args.strategy,
           "pool_primary_bytes": pools.primary[0].nbytes, "pool_secondary_bytes": pools.secondary[0].nbytes}
    res.update(ceilings((4 << 20) if tiny else (64 << 20) if q else (1 << 30), reps))
    ref_np, ref_x, ref_f = res["numpy_copy_GBps"], res["xla_stream_GBps"], res["xla_fresh_GBps"]
    print(
        f"jax {jax.__version__} on {res['backend']} ({res['device']}); primary pool {res['pool_primary_bytes'] / 2**20:.0f} MiB, "
        f"host tier {res['pool_secondary_bytes'] / 2**20:.0f} MiB"
    )
    print(f"ceilings: numpy.copyto {ref_np:.2f} GB/s, XLA streaming (device copy) {ref_x:.2f} GB/s, "
          f"XLA fresh-output streaming {ref_f:.2f} GB/s, "
          f"link D2H {res['d2h_GBps']:.2f} GB/s, H2D {res['h2d_GBps']:.2f} GB/s")

    def report(name, nbytes, t, link=None, fresh=False, base=None):
        rate = nbytes / t / GB
        res[name] = {"bytes": nbytes, "seconds": t, "GBps": rate, "vs_numpy": rate / ref_np, "vs_xla": rate / ref_x}
        extra = ""
        if fresh:  # the op returns a new array: also compare with XLA streaming into a fresh output
            res[name]["vs_xla_fresh"] = rate / ref_f
            extra = f" | {rate / ref_f:5.2f}x XLA fresh-output"
        if link:
            res[name]["vs_link"] = rate / res[link]
            extra = f" | {rate / res[link]:5.2f}x {link[:3].upper()} link"
        if base:  # the same moves on the 16-bit pools: how much faster per token
            res[name]["speedup_vs_bf16"] = res[base]["seconds"] / t
            extra += f" | {res[base]['seconds'] / t:5.2f}x {base} speed"
        print(f"{name:>17}: {nbytes / 2**20:8.1f} MiB in {t * 1e3:8.2f} ms = {rate:6.2f} GB/s | "
              f"{rate / ref_np:5.2f}x numpy copy | {rate / ref_x:5.2f}x XLA streaming{extra}")

    n_tok = 1024 if tiny else 8192 if q else 32768 * scale
    n_blk = 32 if tiny else 256 if q else 1024 * scale
    perm = rng.permutation(primary)
    plans = {}

    def rows(pools, suffix=""):
        """gather, write (decode-like and prefill-like), copy, swaps and paged decode attention
        on `pools`; byte counts are what the pools store (1 byte per value for FP8, plus its
        block scales). With a suffix (FP8) each row also reports its speed against the bf16 row."""
        geo = pools.geometry
        vb = 1 if geo.is_scaled else 2  # bytes per stored value
        sb = 4 if geo.is_scaled else 0  # bytes of a block scale (per layer, field, head)
        block_bytes = layers * 2 * heads * (tpb * dim * vb + sb)
        layer_block_bytes = 2 * heads * (tpb * dim * vb + sb)
        base = (lambda name: name) if suffix else (lambda name: None)
        # ---- gather: one layer of `batch` requests x `blocks` blocks each, random slots
        batch, blocks = (4, 16) if tiny else (8, 64) if q else (32 * scale, 128)
        table = rng.integers(0, primary, (batch, blocks)).astype(np.int32)
        lens = np.full(batch, blocks * tpb, np.int32)
        table_d, lens_d = jnp.asarray(table), jnp.asarray(lens)
        t = tmin(lambda: jax.block_until_ready(gather_kv(pools, 1, table_d, lens_d, impl=args.impl)), reps)
        report("gather" + suffix, batch * blocks * layer_block_bytes, t, fresh=True, base=base("gather"))

        # ---- write: n_tok tokens of one layer; "write": decode-like, every token at a random
        # (slot, offset); "write_prefill": prefill-like, whole blocks of consecutive offsets
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

        report("write" + suffix, n_tok * heads * dim * vb * 2, tmin(write(decode_slots), reps), base=base("write"))
        report("write_prefill" + suffix, n_tok * heads * dim * vb * 2, tmin(write(prefill_slots), reps),
               base=base("write_prefill"))

        # ---- copy: full-block intra-pool copies (every layer), one segment
        copy_plan = plans.setdefault("copy", TransferPlan.from_ops(
            [(TransferKind.COPY, 0, int(s), int(d), tpb) for s, d in zip(perm[:n_blk], perm[n_blk:2 * n_blk], strict=True)]))

        def copy():
            st["p"] = apply_transfers(st["p"], copy_plan, impl=args.impl, strategy=args.strategy)
            st["p"].primary[0].block_until_ready()

        report("copy" + suffix, n_blk * block_bytes, tmin(copy, reps), base=base("copy"))

        # ---- swaps: offload n blocks to the host tier, onboard n blocks back
        n_sw = min(n_blk, secondary)
        host = plans.setdefault("host", rng.permutation(secondary)[:n_sw])
        off_plan = TransferPlan.from_ops(
            [(TransferKind.OFFLOAD, 0, int(s), int(d), tpb) for s, d in zip(perm[:n_sw], host, strict=True)]
        )
        on_plan = TransferPlan.from_ops(
            [(TransferKind.ONBOARD, 0, int(s), int(d), tpb) for s, d in zip(host, perm[n_sw : 2 * n_sw], strict=True)]
        )

        def swap(plan):
            def run():
                st["p"] = apply_transfers(st["p"], plan, impl=args.impl, strategy=args.strategy)
                jax.block_until_ready((st["p"].primary, st["p"].secondary))
            return run

        report("swap_out" + suffix, n_sw * block_bytes, tmin(swap(off_plan), reps), link="d2h_GBps", base=base("swap_out"))
        report("swap_in" + suffix, n_sw * block_bytes, tmin(swap(on_plan), reps), link="h2d_GBps", base=base("swap_in"))

        # ---- paged decode attention vs dense attention over the same K/V values
        pools = st["p"]
        ab, ablocks = (4, 16) if tiny else (4, 32) if q else (16 * scale, 128)
        heads_q = heads * 4
        atable = jnp.asarray(rng.permutation(primary)[: ab * ablocks].reshape(ab, ablocks).astype(np.int32))
        alens = jnp.full((ab,), ablocks * tpb, jnp.int32)
        qd = jnp.asarray(rng.standard_normal((ab, 1, heads_q, dim)), jnp.bfloat16)
        kd, vd = gather_kv(pools, 1, atable, alens, impl="xla", dtype=jnp.bfloat16)
        kd, vd = jnp.array(kd, copy=True), jnp.array(vd, copy=True)
        dense = jax.jit(lambda q_, k_, v_, l_: dense_attention(q_, k_, v_, l_, scale=dim ** -0.5, window=cfg.layer_windows[1]))
        t_dense = tmin(lambda: dense(qd, kd, vd, alens).block_until_ready(), reps)
        t_paged = tmin(lambda: paged_attention(qd, pools, 1, atable, alens, impl=args.impl).block_until_ready(), reps)
        kv_bytes = ab * ablocks * layer_block_bytes
        name = "attention" + suffix
        res[name] = {"kv_bytes": kv_bytes, "dense_s": t_dense, "paged_s": t_paged, "paged_vs_dense": t_dense / t_paged}
        extra = ""
        if suffix:
            res[name]["speedup_vs_bf16"] = res["attention"]["paged_s"] / t_paged
            extra = f"; {res[name]['speedup_vs_bf16']:.2f}x the bf16 pools' paged speed"
        print(f"{name}: decode over {kv_bytes / 2**20:.1f} MiB of K/V: dense (bf16 copy) {t_dense * 1e3:.2f} ms, "
              f"paged {t_paged * 1e3:.2f} ms = {t_dense / t_paged:.2f}x dense speed{extra}")
        return pools

    pools = rows(pools)
    del pools  # ---- FP8 (e4m3) pools: same geometry and moves, 1 byte per value + block scales
    cfg8 = CacheConfig(**{**{f: getattr(cfg, f) for f in ("tokens_per_block", "num_layers", "num_kv_heads", "head_dim",
                                                          "max_seq_len", "primary_blocks", "secondary_blocks")},
                          "dtype": "float8_e4m3fn"})
    pools8 = rows(fill_random(allocate_pools(cfg8)), "_fp8")
    del pools8
    scan_rows(res, cfg, rng, reps, q, scale, args.impl)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
