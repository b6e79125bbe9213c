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
    stored = q.dtype == jnp.uint8
    x = from_bytes(q, dtype) if stored else q
    ratio = jnp.where(new > 0, old / jnp.where(new > 0, new, 1.0), 0.0)
    y = (x.astype(jnp.float32) * ratio).astype(x.dtype)
    return to_bytes(y) if stored else y
