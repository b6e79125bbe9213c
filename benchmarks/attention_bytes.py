"""Bytes the XLA attention path (`paged_attention(impl="xla")`) moves per call, and its wall
time, against the reference gather (`paged_attention_reference`), on this machine.

    python benchmarks/attention_bytes.py [--repeat 15] [--shapes decode,prefill] [--dtypes float32,bfloat16,float8_e4m3fn]

All figures are in live K/V units: the bytes of the K and V pages the rows hold, in the pool's
dtype (`batch * columns * tokens * kv_heads * head_dim * 2 * itemsize`; FP8 scales left out).
Every row is full and the table is exactly as wide as the rows need.

  model    XLA's cost analysis of the compiled program ("bytes accessed"). It counts a while
           loop's body once whatever its trip count, and charges a fusion that gathers from a
           pool with the whole pool operand (both fields), not the pages it gathers.
  honest   the same program counted op by op (`hlo_bytes`): every top-level op reads its
           operands and writes its output, a loop body counts once per trip, and a fusion
           parameter that only feeds gathers or dynamic slices (through reshapes) is charged the
           bytes they take from it. Split into
             read     pages read from the pool by the page-gather fusions
             copy     the operand copies those fusions write (in the dots' dtype)
             rest     everything else: the dots reading those copies, scores, softmax, output
  floor    what any formulation of this step as dots moves on XLA CPU: pages read, copied in
           the dots' dtype, read again (`1 + 2 * dot_itemsize / pool_itemsize`): XLA CPU runs
           every dot and reduction as a library kernel (YNNPACK) on a materialised operand and
           fuses no gather or convert into it; FP8 operands it converts to float32 first.
  FP8 dot  the pages fed to `dot_general` as float8 (bf16 q, float32 accumulation): XLA CPU
           accepts it and converts them to float32 in a fusion of its own before the dot.
  ms       best wall time of `--repeat` calls, the XLA path and the reference timed
           interleaved; ref/xla their ratio.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kvjax import CacheConfig  # noqa: E402
from kvjax.device import allocate_pools, attention, paged_attention, paged_attention_reference  # noqa: E402

ITEM = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1}
#: name -> (batch, columns, q_len); 16-token pages, 2 kv heads x 4 query heads each, head_dim 64
SHAPES = {"decode": (8, 64, 1), "prefill": (2, 64, 128)}
TPB, KV_HEADS, GROUP, HEAD_DIM = 16, 2, 4, 64

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_HEAD = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z\-]*)\((.*?)\)(, .*)?$")
_SHAPE_ONLY = ("bitcast", "reshape", "slice", "transpose", "copy")
_SKIP = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "copy-done")


def _nbytes(type_text: str) -> int:
    return sum(_BYTES[d] * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _ARRAY.findall(type_text))


def _itemsize(type_text: str) -> int:
    m = _ARRAY.search(type_text)
    return _BYTES[m.group(1)] if m else 0


def _computations(text: str) -> tuple[dict[str, list[dict]], str]:
    comps: dict[str, list[dict]] = {}
    cur, entry = "", ""
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head:
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
            continue
        m = _INSTR.match(line)
        if m and cur:
            comps[cur].append(dict(name=m.group(1), type=m.group(2), op=m.group(3), args=m.group(4), rest=m.group(5) or ""))
    return comps, entry


def _gathered_bytes(comp: list[dict], name: str, itemsize: int) -> int | None:
    """Bytes the ops of a fused computation take from `name` when every path from it ends in a
    gather or dynamic slice of it (through shape-only ops); None when some op reads it whole."""
    users = [i for i in comp if re.search(r"%" + re.escape(name) + r"\b", i["args"])]
    if not users:
        return None
    total = 0
    for u in users:
        if u["op"] in ("gather", "dynamic-slice") and u["args"].startswith("%" + name):
            total += _nbytes(u["type"]) // max(_itemsize(u["type"]), 1) * itemsize
        elif u["op"] in _SHAPE_ONLY:
            sub = _gathered_bytes(comp, u["name"], itemsize)
            if sub is None:
                return None
            total += sub
        else:
            return None
    return total


def hlo_bytes(text: str, trips: int) -> dict[str, int]:
    """Bytes a compiled program's ops move (see the module docstring, "honest"): `read` pages
    read by page-gather fusions, `copy` their outputs, `rest` the other ops; each loop body
    counted `trips` times."""
    comps, entry = _computations(text)
    out = {"read": 0, "copy": 0, "rest": 0}

    def walk(comp: str, mult: int) -> None:
        types = {i["name"]: i["type"] for i in comps[comp]}
        for ins in comps[comp]:
            if ins["op"] in _SKIP:
                continue
            body = re.search(r"\bbody=%([\w.\-]+)", ins["rest"])
            if ins["op"] == "while" and body:
                walk(body.group(1), mult * trips)
                continue
            called = re.search(r"\b(?:calls|to_apply)=%([\w.\-]+)", ins["rest"])
            if ins["op"] == "call" and called:
                walk(called.group(1), mult)
                continue
            fused = comps.get(called.group(1), []) if called and ins["op"] == "fusion" else []
            params = {i["args"]: i["name"] for i in fused if i["op"] == "parameter"}
            gathered, read = 0, 0
            for k, operand in enumerate(re.findall(r"%([\w.\-]+)", ins["args"])):
                full = _nbytes(types.get(operand, ""))
                part = _gathered_bytes(fused, params[str(k)], _itemsize(types.get(operand, ""))) if str(k) in params else None
                if part is None:
                    read += full
                else:
                    gathered += part
            if gathered:
                out["read"] += gathered * mult
                out["copy"] += _nbytes(ins["type"]) * mult
                out["rest"] += read * mult
            else:
                out["rest"] += (read + _nbytes(ins["type"])) * mult
    walk(entry, 1)
    return out


def problem(dtype: str, batch: int, columns: int, q_len: int, seed: int = 0):
    """Pools holding exactly the rows' pages plus the null slot, random contents, a shuffled
    table, full rows; and q."""
    cfg = CacheConfig(tokens_per_block=TPB, num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_seq_len=columns * TPB, primary_blocks=batch * columns, secondary_blocks=0, dtype=dtype)
    pools = allocate_pools(cfg)
    rng = np.random.default_rng(seed)
    shape = pools.primary[0].shape
    if dtype.startswith("float8"):  # finite e4m3 bit patterns (no 0x7f/0xff NaN), unit-ish scales
        x = (rng.integers(0, 0x70, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)
        x[-1] = 0
        scales = np.full(pools.primary_scales[0].shape, 0.5, np.float32)
        scales[-1] = 0
        pools = pools.replace(primary=(jnp.asarray(x),), primary_scales=(jnp.asarray(scales),))
    else:
        y = rng.standard_normal(shape).astype(np.float32)
        y[-1] = 0
        pools = pools.replace(primary=(jnp.asarray(y, pools.primary[0].dtype),))
    table = jnp.asarray(rng.permutation(batch * columns).reshape(batch, columns).astype(np.int32))
    lens = jnp.full((batch,), columns * TPB, jnp.int32)
    q = jax.random.normal(jax.random.key(seed), (batch, q_len, KV_HEADS * GROUP, HEAD_DIM),
                          jnp.float32 if dtype == "float32" else jnp.bfloat16)
    return q, pools, table, lens


def xla_steps(dtype: str, batch: int, columns: int, q_len: int, chunk_bytes: int | None = None) -> int:
    """Trips of the XLA path's column loop over full rows (as `_attention_xla` sizes them), for
    the default backend's step budget unless `chunk_bytes` is given."""
    dot_item = 4 if dtype == "float32" else 2
    budget = attention.chunk_bytes_budget() if chunk_bytes is None else chunk_bytes
    c = attention.xla_chunk_columns(batch, columns, KV_HEADS * TPB * max(HEAD_DIM * dot_item, GROUP * q_len * 4), budget)
    return -(-columns // c)


def _best(fns, args, repeat: int) -> list[float]:
    for f in fns:
        jax.block_until_ready(f(*args))
    best = [math.inf] * len(fns)
    for _ in range(repeat):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def measure(dtype: str, shape: str, repeat: int = 15) -> dict[str, float]:
    batch, columns, q_len = SHAPES[shape]
    args = problem(dtype, batch, columns, q_len)
    live = batch * columns * TPB * KV_HEADS * HEAD_DIM * 2 * ITEM[dtype]
    xla = jax.jit(lambda q, p, t, s: paged_attention(q, p, 0, t, s, impl="xla"))
    ref = jax.jit(lambda q, p, t, s: paged_attention_reference(q, p, 0, t, s))
    row: dict[str, float] = {}
    for name, fn, trips in (("xla", xla, xla_steps(dtype, batch, columns, q_len)), ("ref", ref, 1)):
        compiled = fn.lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        counted = hlo_bytes(compiled.as_text(), trips)
        row[f"{name}_model"] = cost["bytes accessed"] / live
        row[f"{name}_honest"] = sum(counted.values()) / live
        for part, n in counted.items():
            row[f"{name}_{part}"] = n / live
    dot_item = 4 if dtype == "float32" else 2
    row["floor"] = 1 + 2 * dot_item / ITEM[dtype]
    if repeat:
        row["xla_ms"], row["ref_ms"] = (t * 1e3 for t in _best((xla, ref), args, repeat))
    return row


def fp8_dot_probe() -> dict[str, float]:
    """One step's scores dot over FP8 pages (`[8, 2, 512, 64]`, float8_e4m3fn) with a bfloat16 q,
    float32 accumulation: the pages fed to `dot_general` as float8 (mixed operand dtypes) or
    converted to bfloat16 first. Returns each program's bytes (`hlo_bytes`, in page bytes) and
    the dtype XLA converts the float8 operand to before its dot (None: no convert)."""
    q = jax.ShapeDtypeStruct((8, 2, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((8, 2, 512, 64), jnp.float8_e4m3fn)
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    fns = {"float8": lambda q, k: jax.lax.dot_general(q, k, dims, preferred_element_type=jnp.float32),
           "bfloat16": lambda q, k: jax.lax.dot_general(q, k.astype(jnp.bfloat16), dims, preferred_element_type=jnp.float32)}
    out: dict[str, float] = {}
    for name, fn in fns.items():
        text = jax.jit(fn).lower(q, k).compile().as_text()
        out[f"{name}_bytes"] = sum(hlo_bytes(text, 1).values()) / (8 * 2 * 512 * 64)
        converts = re.findall(r"= (\w+)\[8,2,512,64\]\S* convert\(", text)
        out[f"{name}_convert"] = converts[0] if converts else None  # type: ignore[assignment]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--shapes", default="decode,prefill")
    p.add_argument("--dtypes", default=",".join(ITEM))
    a = p.parse_args(argv)
    print(f"{jax.default_backend()}; shapes (batch, columns of {TPB} tokens, q_len): "
          + ", ".join(f"{s} {SHAPES[s]}" for s in a.shapes.split(",")) + f"; {KV_HEADS} kv heads x {GROUP}, head_dim {HEAD_DIM}")
    print(f"{'shape':8s} {'dtype':14s} {'model':>6s} {'honest':>7s} = {'read':>5s} + {'copy':>5s} + {'rest':>5s} "
          f"{'floor':>6s} | {'ref model':>9s} {'ref honest':>10s} | {'xla ms':>7s} {'ref ms':>7s} {'ref/xla':>7s}")
    for shape in a.shapes.split(","):
        for dtype in a.dtypes.split(","):
            r = measure(dtype, shape, a.repeat)
            times = (f"{r['xla_ms']:7.3f} {r['ref_ms']:7.3f} {r['ref_ms'] / r['xla_ms']:7.2f}" if a.repeat else "")
            print(f"{shape:8s} {dtype:14s} {r['xla_model']:6.2f} {r['xla_honest']:7.2f} = {r['xla_read']:5.2f} + "
                  f"{r['xla_copy']:5.2f} + {r['xla_rest']:5.2f} {r['floor']:6.2f} | {r['ref_model']:9.2f} "
                  f"{r['ref_honest']:10.2f} | {times}", flush=True)
    probe = fp8_dot_probe()
    print("FP8 pages into the scores dot ([8, 2, 512, 64] pages, bf16 q, f32 accumulation), bytes in page bytes: "
          f"fed as float8 {probe['float8_bytes']:.2f} (XLA converts them to {probe['float8_convert']} before the dot), "
          f"converted to bfloat16 first {probe['bfloat16_bytes']:.2f}")


if __name__ == "__main__":
    main()
