"""The gated delta rule (Gated DeltaNet linear attention), in its two equal forms.

Per value head, a float32 state `S [Dk, Dv]` maps keys to values. Token t decays it by
`exp(g_t)` (g <= 0), then writes the correction of what it already predicts for `k_t`:

    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - k_t^T S))^T
    o_t = q_t^T S

- `recurrent_delta_rule`: that loop, one token per step (decode: one step).
- `chunked_delta_rule`: the same numbers from chunks of C tokens (prefill): inside a chunk the
  updates are solved at once (a unit lower-triangular system, the "UT transform"), and only the
  state crosses chunk boundaries, so a prompt costs T / C sequential steps of matmuls.

`gated_delta_rule` takes what a Gated DeltaNet layer produces (query/key heads possibly fewer
than value heads, un-normalised q and k) and prepares them as transformers' reference does
(`use_qk_l2norm_in_kernel=True`): q and k L2-normalised in float32, q scaled by `Dk ** -0.5`,
each query/key head serving `Hv / Hk` consecutive value heads. Everything runs in float32; the
output is cast back to the value dtype.

Letters: B batch, T tokens, Hk query/key heads, Hv value heads, Dk key head dim, Dv value head
dim, N chunks, C chunk length. Both forms are jitted (one executable per shape), so eager
callers do not dispatch their many small ops one by one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from kvjax.models.layers import einsum

#: transformers' (and the FLA kernels') chunk length for prefill
DEFAULT_CHUNK = 64


def l2_normalize(x: Float[Array, "... d"], eps: float = 1e-6) -> Float[Array, "... d"]:
    """`x / sqrt(sum(x^2) + eps)` over the last axis (the FLA convention transformers follows)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


@jax.jit
def recurrent_delta_rule(
    q: Float[Array, "b t h dk"],
    k: Float[Array, "b t h dk"],
    v: Float[Array, "b t h dv"],
    g: Float[Array, "b t h"],
    beta: Float[Array, "b t h"],
    state: Float[Array, "b h dk dv"],
) -> tuple[Float[Array, "b t h dv"], Float[Array, "b h dk dv"]]:
    """One token at a time (float32, prepared q/k: see `gated_delta_rule`); returns (outputs, final state)."""

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, Dk] x2, [B, H, Dv], [B, H] x2
        s = s * jnp.exp(g_t)[..., None, None]  # [B, H, Dk, Dv]
        predicted = einsum("bhk,bhkv->bhv", k_t, s)  # [B, H, Dv]
        delta = (v_t - predicted) * b_t[..., None]  # [B, H, Dv]
        s = s + k_t[..., :, None] * delta[..., None, :]  # [B, H, Dk, Dv]
        return s, einsum("bhk,bhkv->bhv", q_t, s)  # [B, H, Dv]

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))  # time-major for the scan
    final, out = jax.lax.scan(step, state, xs)  # out: [T, B, H, Dv]
    return jnp.moveaxis(out, 0, 1), final


@functools.partial(jax.jit, static_argnames="chunk_size")
def chunked_delta_rule(
    q: Float[Array, "b t h dk"],
    k: Float[Array, "b t h dk"],
    v: Float[Array, "b t h dv"],
    g: Float[Array, "b t h"],
    beta: Float[Array, "b t h"],
    state: Float[Array, "b h dk dv"],
    *,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[Float[Array, "b t h dv"], Float[Array, "b h dk dv"]]:
    """The same as `recurrent_delta_rule`, chunk by chunk (transformers' `torch_chunk_gated_delta_rule`).

    The tail is padded to a whole chunk with k = v = 0, g = 0, beta = 0: padded tokens neither
    decay nor write the state, so the final state is the one after the last real token.
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = -t % c
    n = (t + pad) // c

    def chunks(x: jax.Array) -> jax.Array:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 2, 1)  # [B, H, T', ...]
        return x.reshape(b, h, n, c, *x.shape[3:])

    qc, kc, vc, gc, bc = (chunks(a) for a in (q, k, v, g, beta))  # [B, H, N, C, Dk|Dv], [B, H, N, C] x2
    cum = jnp.cumsum(gc, axis=-1)  # [B, H, N, C]: log decay from the chunk start to each token
    causal = jnp.tril(jnp.ones((c, c), bool))  # [C, C]: token i sees j <= i
    gap = cum[..., :, None] - cum[..., None, :]  # [B, H, N, C, C]: log decay from j to i
    pairwise = jnp.exp(jnp.where(causal, gap, -jnp.inf))  # [B, H, N, C, C]; 0 above the diagonal
    k_beta = kc * bc[..., None]  # [B, H, N, C, Dk]
    v_beta = vc * bc[..., None]  # [B, H, N, C, Dv]
    # (I + strictly-lower(beta_i k_i.k_j decay_ij)) X = rhs: the chunk's writes, each corrected for the earlier ones
    system = einsum("bhncd,bhnmd->bhncm", k_beta, kc) * pairwise  # [B, H, N, C, C]
    solve = functools.partial(jax.lax.linalg.triangular_solve, system, left_side=True, lower=True, unit_diagonal=True)
    new_values = solve(v_beta)  # [B, H, N, C, Dv]
    k_cumdecay = solve(k_beta * jnp.exp(cum)[..., None])  # [B, H, N, C, Dk]
    intra = einsum("bhncd,bhnmd->bhncm", qc, kc) * pairwise  # [B, H, N, C, C]
    q_decayed = qc * jnp.exp(cum)[..., None]  # [B, H, N, C, Dk]: reads the state as of the chunk start
    k_decayed = kc * jnp.exp(cum[..., -1:] - cum)[..., None]  # [B, H, N, C, Dk]: decay left to the chunk end
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, N]

    def step(s, xs):
        nv, kcd, qd, kd, att, dec = xs  # one chunk of each, [B, H, ...]
        v_new = nv - einsum("bhcd,bhdv->bhcv", kcd, s)  # [B, H, C, Dv]
        out = einsum("bhcd,bhdv->bhcv", qd, s) + einsum("bhcm,bhmv->bhcv", att, v_new)  # [B, H, C, Dv]
        s = s * dec[..., None, None] + einsum("bhcd,bhcv->bhdv", kd, v_new)  # [B, H, Dk, Dv]
        return s, out

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (new_values, k_cumdecay, q_decayed, k_decayed, intra, chunk_decay))
    final, out = jax.lax.scan(step, state, xs)  # out: [N, B, H, C, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]  # [B, H, T, Dv]
    assert final.shape == (b, h, dk, dv)
    return jnp.moveaxis(out, 1, 2), final


def gated_delta_rule(
    q: Float[Array, "b t hk dk"],
    k: Float[Array, "b t hk dk"],
    v: Float[Array, "b t hv dv"],
    g: Float[Array, "b t hv"],
    beta: Float[Array, "b t hv"],
    state: Float[Array, "b hv dk dv"],
    *,
    chunk_size: int | None = DEFAULT_CHUNK,
) -> tuple[Float[Array, "b t hv dv"], Float[Array, "b hv dk dv"]]:
    """A Gated DeltaNet layer's core: (outputs in v's dtype, final float32 state).

    `chunk_size=None` runs the recurrent form (decode), else the chunked form (prefill).
    """
    hk, hv = q.shape[2], v.shape[2]
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if hv % hk:
        raise ValueError(f"{hv} value heads do not split over {hk} query/key heads")
    f32 = jnp.float32
    qf = l2_normalize(q.astype(f32))  # [B, T, Hk, Dk]
    kf = l2_normalize(k.astype(f32))  # [B, T, Hk, Dk]
    qf = qf * jnp.asarray(q.shape[-1] ** -0.5, f32)
    if hv != hk:  # key head i serves value heads i * G ... i * G + G - 1
        qf = jnp.repeat(qf, hv // hk, axis=2)  # [B, T, Hv, Dk]
        kf = jnp.repeat(kf, hv // hk, axis=2)  # [B, T, Hv, Dk]
    args = (qf, kf, v.astype(f32), g.astype(f32), beta.astype(f32), state.astype(f32))
    if chunk_size is None:
        out, final = recurrent_delta_rule(*args)
    else:
        out, final = chunked_delta_rule(*args, chunk_size=chunk_size)
    return out.astype(v.dtype), final
