"""Causal depthwise 1-D convolution with a (K-1)-column state, as serving engines keep it.

Einsum letters: B batch, T new tokens, C channels, K kernel width. `state` holds the last K-1
inputs before this chunk (zeros at the start of a sequence), so one function serves prefill
chunks of any length and single-token decode (T = 1), and the state after a chunk is the last
K-1 columns of `state ++ x`. transformers keeps K columns (its decode kernel shifts a
K-wide window); the oldest of them never reaches an output, so K-1 suffice.
"""
from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def causal_conv1d(
    x: Float[Array, "B T C"],
    weight: Float[Array, "K C"],
    bias: Float[Array, " C"] | None,
    state: Float[Array, "B Km1 C"],
    lens: Int[Array, " B"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "B Km1 C"]]:
    """(y, new state): `y[t, c] = bias[c] + sum_k weight[k, c] * window[t + k, c]` over the window
    `state ++ x` (weight[K-1] multiplies the current token, as torch's `conv1d` with K-1 left padding).
    `lens` (the paged engine's right-padded rows): row b holds `lens[b]` real tokens, then
    padding; its new state is the K-1 inputs before position `lens[b]` (padding never enters it).

    Computed in float32 (as transformers' conv runs in float32 for float32 and upcast models) and
    returned in `x`'s dtype; the state keeps `x`'s dtype.
    """
    k = weight.shape[0]
    t = x.shape[1]
    if state.shape != (x.shape[0], k - 1, x.shape[2]):
        raise ValueError(f"conv state has shape {state.shape}, expected {(x.shape[0], k - 1, x.shape[2])}")
    window = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w32 = weight.astype(jnp.float32)  # [K, C]
    win32 = window.astype(jnp.float32)
    y = sum(win32[:, i : i + t, :] * w32[i][None, None, :] for i in range(k))  # [B, T, C]
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, None, :]
    new_state = window[:, t:, :] if k > 1 else window[:, :0, :]  # [B, K-1, C]: the last K-1 inputs
    if lens is not None:
        new_state = state_after(window, lens, k - 1)
    return jnp.asarray(y).astype(x.dtype), new_state


def state_after(window: Float[Array, "B W C"], lens: Int[Array, " B"], keep: int) -> Float[Array, "B Km1 C"]:
    """Per row b, `window[b, lens[b] : lens[b] + keep]`: the last `keep` inputs of `state ++ x`
    when only the first `lens[b]` tokens of x are real (`window = state ++ x`)."""
    idx = lens[:, None].astype(jnp.int32) + jnp.arange(keep, dtype=jnp.int32)[None, :]  # [B, keep]
    return jnp.take_along_axis(window, idx[:, :, None], axis=1)  # [B, keep, C]


def conv_state_zeros(batch: int, kernel: int, channels: int, dtype: jnp.dtype) -> Float[Array, "B Km1 C"]:
    """The state of a fresh sequence: K-1 zero columns (torch's left zero padding)."""
    return jnp.zeros((batch, kernel - 1, channels), dtype)


__all__ = ["causal_conv1d", "conv_state_zeros", "state_after"]
