"""Mamba2's state-space duality (SSD) scan: chunked form for prefill, recurrent form for decode.

Per head h, with `a_t = A_h * dt_t` (A < 0) and the SSM state `S [P, N]` (float32):
    S_t = exp(a_t) * S_{t-1} + dt_t * x_t B_t^T,        y_t = S_t C_t + D_h * x_t.
The chunked form computes the same within chunks of `chunk` tokens as masked matrix products
(the "attention-like" dual) and carries S across chunks; the recurrent form steps S token by
token. Letters: B batch, T tokens, L / s positions in a chunk, c chunks, NH heads (h), P head
dim, G groups (head h reads group h // (NH / G)), N state size.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from kvjax.models.layers import PRECISION


def _heads(m: Float[Array, "B T G N"], heads: int) -> Float[Array, "B T NH N"]:
    return jnp.repeat(m, heads // m.shape[2], axis=2)  # group g serves heads g*NH/G .. (g+1)*NH/G - 1


def _segsum(a: Float[Array, "... L"]) -> Float[Array, "... L L"]:
    """out[..., l, s] = a[s+1] + ... + a[l] for s <= l, -inf above the diagonal (sums of masked
    terms, not differences of cumulative sums: stable however long the chunk)."""
    length = a.shape[-1]
    rep = jnp.broadcast_to(a[..., None, :], (*a.shape, length))  # [..., L(l), L(s)]: a[s]... transposed below
    rep = jnp.swapaxes(rep, -1, -2)  # [..., l, s] = a[l]
    strict = jnp.tril(jnp.ones((length, length), bool), -1)  # s < l
    summed = jnp.cumsum(jnp.where(strict, rep, 0.0), axis=-2)  # [..., l, s] = sum_{s < m <= l} a[m]
    return jnp.where(jnp.tril(jnp.ones((length, length), bool)), summed, -jnp.inf)


def ssd_chunked(
    x: Float[Array, "B T NH P"],
    dt: Float[Array, "B T NH"],
    a: Float[Array, " NH"],
    b: Float[Array, "B T G N"],
    c: Float[Array, "B T G N"],
    d: Float[Array, " NH"],
    state: Float[Array, "B NH P N"],
    chunk: int,
) -> tuple[Float[Array, "B T NH P"], Float[Array, "B NH P N"]]:
    """(y float32, final state float32) over T tokens after `state`; `dt` already softplus'ed."""
    bsz, t, nh, p = x.shape
    x, dt, a, d = (v.astype(jnp.float32) for v in (x, dt, a, d))
    bh, ch = _heads(b.astype(jnp.float32), nh), _heads(c.astype(jnp.float32), nh)  # [B, T, NH, N]
    pad = -t % chunk
    nc = (t + pad) // chunk

    def split(v):  # [B, T, ...] -> [B, c, L, ...]; padding has dt = 0: no decay, no input
        v = jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
        return v.reshape(bsz, nc, chunk, *v.shape[2:])

    xdt = split(x * dt[..., None])  # [B, c, L, NH, P]
    adt = split(dt * a)  # [B, c, L, NH]
    bc, cc = split(bh), split(ch)  # [B, c, L, NH, N]
    a_cum = jnp.cumsum(adt, axis=2)  # [B, c, L, NH]
    decay = jnp.exp(_segsum(jnp.moveaxis(adt, 3, 2)))  # [B, c, NH, L(l), L(s)]
    scores = jnp.einsum("bclhn,bcshn->bchls", cc, bc, precision=PRECISION) * decay  # [B, c, NH, L, L]
    y_diag = jnp.einsum("bchls,bcshp->bclhp", scores, xdt, precision=PRECISION)  # [B, c, L, NH, P]
    to_end = jnp.exp(a_cum[:, :, -1:, :] - a_cum)  # [B, c, L, NH]: decay from each position to the chunk end
    chunk_states = jnp.einsum("bclhn,bclh,bclhp->bchpn", bc, to_end, xdt, precision=PRECISION)  # [B, c, NH, P, N]
    chunk_decay = jnp.exp(a_cum[:, :, -1, :])  # [B, c, NH]

    def carry(s, inputs):  # s: [B, NH, P, N], the state before this chunk
        decay_c, new_c = inputs
        return s * decay_c[..., None, None] + new_c, s

    final, before = jax.lax.scan(carry, state.astype(jnp.float32),
                                 (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(chunk_states, 1, 0)))
    before = jnp.moveaxis(before, 0, 1)  # [B, c, NH, P, N]
    y_off = jnp.einsum("bclhn,bchpn,bclh->bclhp", cc, before, jnp.exp(a_cum), precision=PRECISION)  # [B, c, L, NH, P]
    y = (y_diag + y_off).reshape(bsz, nc * chunk, nh, p)[:, :t]  # [B, T, NH, P]
    return y + x * d[None, None, :, None], final


def ssd_recurrent(
    x: Float[Array, "B T NH P"],
    dt: Float[Array, "B T NH"],
    a: Float[Array, " NH"],
    b: Float[Array, "B T G N"],
    c: Float[Array, "B T G N"],
    d: Float[Array, " NH"],
    state: Float[Array, "B NH P N"],
) -> tuple[Float[Array, "B T NH P"], Float[Array, "B NH P N"]]:
    """The same token by token (decode: T = 1), float32."""
    nh = x.shape[2]
    x, dt, a, d = (v.astype(jnp.float32) for v in (x, dt, a, d))
    bh, ch = _heads(b.astype(jnp.float32), nh), _heads(c.astype(jnp.float32), nh)  # [B, T, NH, N]

    def step(s, inputs):  # s: [B, NH, P, N]
        x_t, dt_t, b_t, c_t = inputs  # [B, NH, P], [B, NH], [B, NH, N], [B, NH, N]
        s = s * jnp.exp(dt_t * a)[..., None, None] + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
        y_t = jnp.einsum("bhpn,bhn->bhp", s, c_t, precision=PRECISION) + x_t * d[None, :, None]
        return s, y_t

    final, ys = jax.lax.scan(step, state.astype(jnp.float32),
                             tuple(jnp.moveaxis(v, 1, 0) for v in (x, dt, bh, ch)))
    return jnp.moveaxis(ys, 0, 1), final  # [B, T, NH, P], [B, NH, P, N]
