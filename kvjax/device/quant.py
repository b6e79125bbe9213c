"""FP8 KV: values stored as `float8 * scale`, one float32 scale per (block, layer, field, head).

Scales are powers of two (like the shared E8M0 exponents of the OCP MX formats). For a
floating-point code this costs no precision (relative precision does not depend on the
scale), and it makes every rescale exact: moving a block to a larger scale shifts exponents
and rounds nothing, except values that drop into fp8's subnormal range (below 2^-6 of the
scale for e4m3), which are tiny next to the block's largest value anyway. Dequantising into
bfloat16 is exact for the same reason.

A scale grows, never shrinks, while its block holds data; writing offset 0 of a block starts
it afresh (what a causal cache does: the block's later positions are rewritten before they
are read). When a write needs a larger scale, it takes `HEADROOM` times what the new values
need, so that later tokens of the block rarely force another rescale (e4m3 keeps ~15 binades
of normal range; 4 of them are spent on headroom).

A scale of 0 means "nothing written": the block dequantises to zeros (the null slot's state).
Pool arrays hold the fp8 bit patterns as uint8 (`to_bytes` / `from_bytes`; see
`PoolGeometry.storage_dtype`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

#: Largest finite value of each scaled pool dtype.
QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
#: Factor (a power of two) by which a newly set or raised scale exceeds what its values need.
HEADROOM = 16.0


# (mantissa bits, exponent bias, smallest normal exponent, NaN code) of each format
_FORMAT = {"float8_e4m3fn": (3, 7, -6, 0x7F), "float8_e5m2": (2, 15, -14, 0x7E)}


def encode(x: Float[Array, "*s"], dtype) -> Shaped[Array, "*s"]:
    """float32 -> uint8 bit patterns of fp8 `dtype`, round to nearest even, bit-identical to
    `x.astype(dtype)` for |x| <= qmax(dtype) and NaN (callers clip first).

    Plain integer and float ops, which XLA vectorises: XLA CPU's own fp8 conversion is
    emulated element by element (measured 2.5x slower than this; `decode` 1.5x). On a GPU
    both are a few ALU ops per byte moved."""
    mb, bias, emin, nan = _FORMAT[jnp.dtype(dtype).name]
    x = x.astype(jnp.float32)
    a = jnp.abs(x)
    u = jax.lax.bitcast_convert_type(a, jnp.uint32)
    shift = 23 - mb
    lsb = (u >> shift) & 1
    r = (u + ((1 << (shift - 1)) - 1) + lsb) >> shift  # RNE to mb mantissa bits (carries into the exponent)
    normal = (r - ((127 - bias) << mb)).astype(jnp.int32)  # rebias the exponent field
    sub = jnp.round(a * 2.0 ** (mb - emin)).astype(jnp.int32)  # below the smallest normal: multiples of 2^(emin-mb)
    bits = jnp.where(a < 2.0**emin, sub, normal)
    bits = jnp.where(jnp.signbit(x), bits | 0x80, bits)
    return jnp.where(jnp.isnan(x), jnp.where(jnp.signbit(x), nan | 0x80, nan), bits).astype(jnp.uint8)


def decode(b: Shaped[Array, "*s"], dtype) -> Float[Array, "*s"]:
    """uint8 bit patterns of fp8 `dtype` -> float32, bit-identical to `.astype(float32)`."""
    mb, bias, emin, nan = _FORMAT[jnp.dtype(dtype).name]
    b = b.astype(jnp.uint32)
    e = (b >> mb) & ((0xFF >> (mb + 1)))  # exponent field
    m = b & ((1 << mb) - 1)
    normal = jax.lax.bitcast_convert_type(((e + (127 - bias)) << 23) | (m << (23 - mb)), jnp.float32)
    sub = m.astype(jnp.float32) * 2.0 ** (emin - mb)
    v = jnp.where(e == 0, sub, normal)
    top = 0xFF >> (mb + 1)
    if mb == 3:  # e4m3fn: no infinities, only S.1111.111 is NaN
        v = jnp.where((e == top) & (m == (1 << mb) - 1), jnp.nan, v)
    else:  # e5m2: IEEE-like
        v = jnp.where(e == top, jnp.where(m == 0, jnp.inf, jnp.nan), v)
    return jnp.where((b & 0x80) != 0, -v, v)


def to_bytes(q: Shaped[Array, "*s"]) -> Shaped[Array, "*s"]:
    """fp8 values -> their uint8 bit patterns (what pool arrays store)."""
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def from_bytes(b: Shaped[Array, "*s"], dtype) -> Shaped[Array, "*s"]:
    """uint8 bit patterns (from a pool array) -> fp8 values of `dtype`."""
    return jax.lax.bitcast_convert_type(b, jnp.dtype(dtype))


def qmax(dtype) -> float:
    return QMAX[jnp.dtype(dtype).name]


def pow2_at_least(y: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """Smallest power of two >= y for y > 0; 0 for y == 0; NaN stays NaN."""
    y = y.astype(jnp.float32)
    m, e = jnp.frexp(y)  # y = m * 2^e, m in [0.5, 1)
    e = jnp.where(m == 0.5, e - 1, e)  # exact powers of two map to themselves
    p = jnp.ldexp(jnp.ones_like(y), e)
    return jnp.where(jnp.isnan(y), y, jnp.where(y > 0, p, 0.0))


def needed_scale(amax: Float[Array, "*s"], dtype) -> Float[Array, "*s"]:
    """Smallest power-of-two scale that represents values up to `amax` without overflow."""
    return pow2_at_least(amax / qmax(dtype))


def grown_scale(base: Float[Array, "*s"], need: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """New block scale: `base` while it suffices, else `HEADROOM * need`."""
    return jnp.where(need > base, HEADROOM * need, base)


def quantize(x: Float[Array, "*s"], scale: Float[Array, "*s"], dtype) -> Shaped[Array, "*s"]:
    """`x / scale` in fp8 (0 where the scale is 0). `scale` broadcasts against `x`."""
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)  # exact: powers of two
    m = qmax(dtype)
    return jnp.clip(x.astype(jnp.float32) * inv, -m, m).astype(dtype)


def dequantize(q: Shaped[Array, "*s"], scale: Float[Array, "*s"], dtype=jnp.float32) -> Float[Array, "*s"]:
    """`q * scale` in `dtype` (bfloat16 and float32 are exact). `scale` broadcasts against `q`
    (fp8 values, not their uint8 bit patterns)."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


def rescale(q: Shaped[Array, "*s"], old: Float[Array, "*s"], new: Float[Array, "*s"], dtype=None) -> Shaped[Array, "*s"]:
    """Re-express fp8 values stored at scale `old` at scale `new` (exact unless they turn
    subnormal). `q` may be uint8 bit patterns of `dtype` (returned as such)."""
    ratio = jnp.where(new > 0, old / jnp.where(new > 0, new, 1.0), 0.0)
    if q.dtype == jnp.uint8:
        return encode(decode(q, dtype) * ratio, dtype)
    return (q.astype(jnp.float32) * ratio).astype(q.dtype)


def quantize_bytes(x: Float[Array, "*s"], scale: Float[Array, "*s"], dtype) -> Shaped[Array, "*s"]:
    """`quantize` straight to the uint8 bit patterns a pool stores."""
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    m = qmax(dtype)
    return encode(jnp.clip(x.astype(jnp.float32) * inv, -m, m), dtype)


def dequantize_bytes(b: Shaped[Array, "*s"], scale: Float[Array, "*s"], dtype, out_dtype=jnp.float32) -> Float[Array, "*s"]:
    """`dequantize` straight from the uint8 bit patterns a pool stores."""
    return (decode(b, dtype) * scale).astype(out_dtype)
