"""Qwen3.5 dense text models (`Qwen3_5ForCausalLM`): gated DeltaNet layers mixed with gated attention.

Each layer is pre-norm, `x + mixer(norm(x))` then `x + mlp(norm(x))`, every norm a zero-centred
RMSNorm (scales by `1 + w`), the mixer either

- `linear_attention`: Gated DeltaNet. `in_proj_qkv` feeds a causal depthwise convolution (kernel
  K, silu) over the concatenated q, k, v channels; q and k are L2-normalised and run through the
  gated delta rule (`kvjax.models.hybrid.deltanet`) with `beta = sigmoid(in_proj_b x)` and decay
  `g = -exp(A_log) * softplus(in_proj_a x + dt_bias)`; the output goes through an RMSNorm gated by
  `silu(in_proj_z x)` (that norm scales by `w`, not `1 + w`) and `out_proj`. State per sequence:
  the last K - 1 conv inputs `[K - 1, 2 Hk Dk + Hv Dv]` (model dtype) and the delta-rule state
  `[Hv, Dk, Dv]` (float32); or
- `full_attention`: GQA whose `q_proj` also yields a per-head output gate (`o_proj(attn *
  sigmoid(gate))`), q/k RMSNorm per head, RoPE on the first `rotary_dim` (a `partial_rotary_factor`
  of head_dim) dims only. State per sequence: its keys and values (a contiguous cache here).

Two forwards, equal in their logits:

- `dense_forward(tokens)`: no cache, the whole sequence at once (the oracle);
- `forward_chunk(tokens, state)`: T more tokens of every row, after what `state` holds; T > 1 runs
  the delta rule's chunked form (prefill), T = 1 its recurrent form (decode). A prompt prefilled
  in chunks of any sizes, then decoded token by token, gives the dense forward's logits.

The text config (`model_type` `qwen3_5_text`, or the `text_config` of a multimodal `qwen3_5`
checkpoint) is read with `kvjax.hf_config`'s strictness into a `Qwen35Spec`; `load_qwen3_5`
fills a model from a checkpoint directory (text-only tensors under `model.`, or the multimodal
layout under `model.language_model.`, whose vision tower and multi-token-prediction head are not
loaded). Layers run unrolled (a Python loop over the pattern), not under `lax.scan`.

Letters: B batch, T tokens, S cached positions, D width, N query heads, K kv heads, H head dim,
F MLP width, V vocabulary; linear layers: Hk key heads, Hv value heads, Dk / Dv their head dims,
C conv channels (2 Hk Dk + Hv Dv), W conv kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax.checkpoint_files import CheckpointError, CheckpointTensors
from kvjax.device.attention import grouped_attention
from kvjax.errors import InvalidArgumentError
from kvjax.hf_config import (
    ConfigFields,
    UnsupportedConfigError,
    config_activation,
    config_dtype,
    read_config,
    report_unknown_fields,
)
from kvjax.models.hybrid.conv import state_after
from kvjax.models.hybrid.deltanet import DEFAULT_CHUNK, gated_delta_rule
from kvjax.models.layers import (
    MLP,
    RMSNorm,
    apply_rope,
    einsum,
    normal_init,
    parameter_at,
    rope_frequencies,
    shapes_only,
)

_ModuleList = getattr(nnx, "List", list)

LINEAR, FULL = "linear_attention", "full_attention"
TEXT_MODEL_TYPE, MULTIMODAL_MODEL_TYPE = "qwen3_5_text", "qwen3_5"
MODEL_TYPES = (TEXT_MODEL_TYPE, MULTIMODAL_MODEL_TYPE)


# ---------------------------------------------------------------------- spec
@dataclasses.dataclass(frozen=True)
class Qwen35Spec:
    """The numbers of a Qwen3.5 text model (from its `config.json`, `qwen35_spec_from_config`)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]  # LINEAR / FULL per layer
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of each head that RoPE rotates (even, <= head_dim)
    rope_theta: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    norm_eps: float
    max_seq_len: int
    tie_embeddings: bool = False
    dtype: str = "float32"
    source: str = ""

    def __post_init__(self) -> None:
        if any(t not in (LINEAR, FULL) for t in self.layer_types) or not self.layer_types:
            raise ValueError(f"layer_types must be a non-empty list of {LINEAR!r} / {FULL!r}, got {self.layer_types}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) does not split over num_key_value_heads "
                             f"({self.num_kv_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) does not split over "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {self.conv_kernel}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def conv_channels(self) -> int:
        """C: the q, k and v channels the convolution runs over."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def state_bytes(self, capacity: int) -> dict[str, int]:
        """Bytes of one sequence's state per layer kind: conv + delta-rule state of every linear
        layer (fixed), keys and values of every attention layer for `capacity` tokens."""
        itemsize = jnp.dtype(self.dtype).itemsize
        conv = (self.conv_kernel - 1) * self.conv_channels * itemsize
        delta = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
        kv = 2 * capacity * self.num_kv_heads * self.head_dim * itemsize
        return {"linear_attention": len(self.linear_layers) * (conv + delta), "full_attention": len(self.attention_layers) * kv}


_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, head_dim=256, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    tie_word_embeddings=False, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
)
#: fields of a Qwen3.5 text config that do not change the text model's numbers, and why
_TEXT_IGNORED = {
    "mtp_num_hidden_layers": "multi-token-prediction head (speculative decoding); kvjax does not load it",
    "mtp_use_dedicated_embeddings": "multi-token-prediction head (speculative decoding); kvjax does not load it",
}
#: top-level fields of the multimodal `qwen3_5` config that text-only serving never reads
_MULTIMODAL_IGNORED = {
    "vision_config": "vision tower (images are not served)",
    "text_config": "read as the model's config",
}
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}


def _rope(f: ConfigFields, head_dim: int) -> tuple[float, int]:
    """(rope_theta, rotary_dim). The multimodal position sections (mrope) give every text token
    the same position on all three axes, i.e. plain RoPE: their keys are accepted and unused."""
    params = f.get("rope_parameters", None)
    legacy = f.get("rope_scaling", None)
    if params is not None and legacy is not None:
        raise f.error("rope_scaling", "given together with rope_parameters; refusing an ambiguous config")
    field = "rope_parameters" if legacy is None else "rope_scaling"
    params = params if legacy is None else legacy
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise f.error(field, f"expected a table, got {params!r}")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise f.error(field, f"key {unknown[0]!r} is not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise f.error(field, f"rope_type {kind!r} is not supported for Qwen3.5 (supported: default)")
    theta = params.get("rope_theta", f.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", f.get("partial_rotary_factor", 0.25))
    for key, value in (("rope_theta", theta), ("partial_rotary_factor", factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise f.error(field, f"{key} must be a positive number, got {value!r}")
    for key in ("rope_theta", "partial_rotary_factor"):
        top = f.data.get(key)
        if key in params and top is not None and top != params[key]:
            raise f.error(key, f"{top!r} disagrees with {field}' {params[key]!r}; refusing an ambiguous config")
    rotary = int(head_dim * factor)  # transformers truncates, as here
    if factor > 1 or rotary < 2 or rotary % 2:
        raise f.error(field, f"partial_rotary_factor {factor!r} of head_dim {head_dim} gives {rotary} rotated dims; "
                             "kvjax needs an even count in [2, head_dim]")
    return float(theta), rotary


def _layer_types(f: ConfigFields, layers: int) -> tuple[str, ...]:
    interval = f.int("full_attention_interval")
    implied = [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    types = f.get("layer_types", None)
    if types is None:
        return tuple(implied)
    if not isinstance(types, list) or len(types) != layers or any(t not in (LINEAR, FULL) for t in types):
        raise f.error("layer_types", f"expected {layers} entries of {LINEAR}, {FULL}, got {types!r}")
    if f.data.get("full_attention_interval") is not None and types != implied:
        raise f.error("layer_types", f"disagrees with full_attention_interval {interval}; refusing an ambiguous config")
    return tuple(types)


def _text_spec(f: ConfigFields, name: str, source: str, dtype: str | None) -> Qwen35Spec:
    layers = f.int("num_hidden_layers")
    head_dim = f.int("head_dim")
    theta, rotary = _rope(f, head_dim)
    if config_activation(f, "hidden_act") != "silu":  # also the conv's activation; transformers' kernels assume silu
        raise f.error("hidden_act", f"value {f.get('hidden_act')!r} is not supported for Qwen3.5 (supported: silu)")
    f.require("attention_bias", (False,), False)
    f.require("attn_output_gate", (True,), True)
    f.require("mlp_only_layers", ([],), [])
    f.require("mamba_ssm_dtype", ("float32",), "float32")
    try:
        return Qwen35Spec(
            name=name,
            source=source,
            vocab_size=f.int("vocab_size"),
            hidden_size=f.int("hidden_size"),
            intermediate_size=f.int("intermediate_size"),
            layer_types=_layer_types(f, layers),
            num_attention_heads=f.int("num_attention_heads"),
            num_kv_heads=f.int("num_key_value_heads"),
            head_dim=head_dim,
            rotary_dim=rotary,
            rope_theta=theta,
            linear_num_key_heads=f.int("linear_num_key_heads"),
            linear_num_value_heads=f.int("linear_num_value_heads"),
            linear_key_head_dim=f.int("linear_key_head_dim"),
            linear_value_head_dim=f.int("linear_value_head_dim"),
            conv_kernel=f.int("linear_conv_kernel_dim"),
            norm_eps=f.number("rms_norm_eps"),
            max_seq_len=f.int("max_position_embeddings"),
            tie_embeddings=f.flag("tie_word_embeddings", False),
            dtype=config_dtype(f, dtype),
        )
    except ValueError as e:
        if isinstance(e, UnsupportedConfigError):
            raise
        raise UnsupportedConfigError(f"{source}: {e}") from None


def qwen35_spec_from_config(
    config: dict, *, name: str = "checkpoint", source: str = "<config.json>", strict: bool = False
) -> Qwen35Spec:
    """The spec of a Qwen3.5 `config.json` (parsed): `qwen3_5_text`, or the `text_config` of a
    multimodal `qwen3_5` checkpoint. Refuses what kvjax would compute wrong (`UnsupportedConfigError`
    naming the field); unknown fields are named in one `UnknownConfigFieldWarning` (refused with `strict`)."""
    if not isinstance(config, dict):
        raise UnsupportedConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type == TEXT_MODEL_TYPE:
        f = ConfigFields(config, source, TEXT_MODEL_TYPE, defaults=_TEXT_DEFAULTS)
        spec = _text_spec(f, name, source, None)
        report_unknown_fields(f.finish(_TEXT_IGNORED), source, TEXT_MODEL_TYPE, strict)
        return spec
    if model_type != MULTIMODAL_MODEL_TYPE:
        raise UnsupportedConfigError(f"{source}: config field 'model_type': {model_type!r} is not a Qwen3.5 model "
                                     f"(expected one of {', '.join(MODEL_TYPES)})")
    outer = ConfigFields(config, source, TEXT_MODEL_TYPE, label=MULTIMODAL_MODEL_TYPE, defaults=_TEXT_DEFAULTS)
    outer.used.update({"model_type", "text_config"})
    dtype = config_dtype(outer, None) if any(config.get(k) for k in ("dtype", "torch_dtype")) else None
    outer_tie = outer.get("tie_word_embeddings", None)
    unknown = outer.finish(_MULTIMODAL_IGNORED)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedConfigError(f"{source}: config field 'text_config': expected a table, got {text!r}")
    text = dict(text)
    if text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
        raise UnsupportedConfigError(f"{source}: text_config model_type {text.get('model_type')!r} is not {TEXT_MODEL_TYPE}")
    text.pop("model_type", None)
    if isinstance(outer_tie, bool):
        if text.get("tie_word_embeddings", outer_tie) != outer_tie:
            raise outer.error("tie_word_embeddings", f"{outer_tie} disagrees with text_config's "
                                                     f"{text['tie_word_embeddings']}; refusing an ambiguous config")
        text["tie_word_embeddings"] = outer_tie
    f = ConfigFields(text, f"{source} text_config", TEXT_MODEL_TYPE, defaults=_TEXT_DEFAULTS)
    spec = _text_spec(f, name, source, dtype)
    unknown += f.finish(_TEXT_IGNORED, prefix="text_config.")
    report_unknown_fields(unknown, source, MULTIMODAL_MODEL_TYPE, strict)
    return spec


def qwen35_spec_from_checkpoint(path: str | Path, *, strict: bool = False) -> Qwen35Spec:
    """The spec of a checkpoint directory (reads only its `config.json`)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    return qwen35_spec_from_config(read_config(file), name=file.parent.resolve().name, source=str(file), strict=strict)


# ---------------------------------------------------------------------- state
class DeltaNetState(NamedTuple):
    """One linear-attention layer's state for a batch of sequences (the whole history, fixed size)."""

    conv: Float[Array, "b w1 c"]  # the last W - 1 conv inputs, oldest first (model dtype)
    recurrent: Float[Array, "b hv dk dv"]  # the delta-rule state (float32)


class AttentionKV(NamedTuple):
    """One attention layer's keys and values (after q/k norm and RoPE), positions [0, S)."""

    k: Float[Array, "b s k h"]
    v: Float[Array, "b s k h"]


class Qwen35State(NamedTuple):
    """Everything a batch of sequences carries between chunks: `layers[i]` is layer i's state
    (a `DeltaNetState` or an `AttentionKV`), `lengths[b]` the tokens row b has seen."""

    layers: tuple[DeltaNetState | AttentionKV, ...]
    lengths: Int[Array, " b"]


# ---------------------------------------------------------------------- layers
def causal_conv(
    x: Float[Array, "b t c"], weight: Float[Array, "w c"], state: Float[Array, "b w1 c"],
    lens: Int[Array, " b"] | None = None,
) -> tuple[Float[Array, "b t c"], Float[Array, "b w1 c"]]:
    """Depthwise causal convolution with silu (torch's `conv1d` taps: `weight[-1]` on the newest
    input), continuing from `state` (the W - 1 inputs before x); returns (outputs, next state).
    `lens`: right-padded rows of `lens[b]` real tokens; the next state skips the padding."""
    w = weight.shape[0]
    t = x.shape[1]
    xs = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, W - 1 + T, C]
    f32 = jnp.float32
    out = sum(xs[:, j:j + t].astype(f32) * weight[j].astype(f32) for j in range(w))  # [B, T, C]
    after = xs[:, t:] if lens is None else state_after(xs, lens, w - 1)  # [B, W - 1, C]
    return jax.nn.silu(out).astype(x.dtype), after


class GatedRMSNorm(nnx.Module):
    """RMSNorm of each head's output, scaled by `w` (identity at 1) and gated by `silu(z)`."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))  # [Dv]

    def __call__(self, x: Float[Array, "... d"], z: Float[Array, "... d"]) -> Float[Array, "... d"]:
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        scaled = self.scale[...].astype(x.dtype) * normed  # [..., Dv]
        return (scaled.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    """A linear-attention mixer (see the module docstring)."""

    def __init__(self, spec: Qwen35Spec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = spec.hidden_size
        self.hk, self.hv = spec.linear_num_key_heads, spec.linear_num_value_heads
        self.dk, self.dv = spec.linear_key_head_dim, spec.linear_value_head_dim
        c = spec.conv_channels
        self.in_qkv = nnx.Param(normal_init(rngs.params(), (d, c), d, dtype))  # [D, C]
        self.in_z = nnx.Param(normal_init(rngs.params(), (d, self.hv * self.dv), d, dtype))  # [D, Hv Dv]
        self.in_b = nnx.Param(normal_init(rngs.params(), (d, self.hv), d, dtype))  # [D, Hv]
        self.in_a = nnx.Param(normal_init(rngs.params(), (d, self.hv), d, dtype))  # [D, Hv]
        self.conv = nnx.Param(normal_init(rngs.params(), (spec.conv_kernel, c), spec.conv_kernel, dtype))  # [W, C]
        self.a_log = nnx.Param(jnp.full((self.hv,), -1.0, dtype))  # [Hv]
        self.dt_bias = nnx.Param(jnp.zeros((self.hv,), dtype))  # [Hv]
        self.norm = GatedRMSNorm(self.dv, eps=spec.norm_eps, dtype=dtype)
        self.out = nnx.Param(normal_init(rngs.params(), (self.hv * self.dv, d), self.hv * self.dv, dtype))  # [Hv Dv, D]

    def __call__(
        self, x: Float[Array, "b t d"], state: DeltaNetState, chunk_size: int | None, lens: Int[Array, " b"] | None = None
    ) -> tuple[Float[Array, "b t d"], DeltaNetState]:
        """`lens`: right-padded rows of `lens[b]` real tokens (the paged engine): padding gets
        g = 0 and beta = 0 (no decay, no write) and stays out of the conv state."""
        b, t, _ = x.shape
        mixed, conv = causal_conv(einsum("btd,dc->btc", x, self.in_qkv[...]), self.conv[...], state.conv, lens)  # [B, T, C]
        kd = self.hk * self.dk
        q = mixed[..., :kd].reshape(b, t, self.hk, self.dk)  # [B, T, Hk, Dk]
        k = mixed[..., kd:2 * kd].reshape(b, t, self.hk, self.dk)  # [B, T, Hk, Dk]
        v = mixed[..., 2 * kd:].reshape(b, t, self.hv, self.dv)  # [B, T, Hv, Dv]
        beta = jax.nn.sigmoid(einsum("btd,dh->bth", x, self.in_b[...]))  # [B, T, Hv]
        a = einsum("btd,dh->bth", x, self.in_a[...]).astype(jnp.float32)  # [B, T, Hv]
        g = -jnp.exp(self.a_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        if lens is not None:
            valid = jnp.arange(t)[None, :, None] < lens[:, None, None]  # [B, T, 1]
            g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
        core, recurrent = gated_delta_rule(q, k, v, g, beta, state.recurrent, chunk_size=chunk_size)  # [B, T, Hv, Dv]
        z = einsum("btd,de->bte", x, self.in_z[...]).reshape(b, t, self.hv, self.dv)  # [B, T, Hv, Dv]
        gated = self.norm(core, z).reshape(b, t, self.hv * self.dv)  # [B, T, Hv Dv]
        return einsum("bte,ed->btd", gated, self.out[...]), DeltaNetState(conv, recurrent)

    def empty_state(self, batch: int, dtype: jnp.dtype) -> DeltaNetState:
        """The state before any token: zero conv inputs (the causal padding), zero delta-rule state."""
        w, c = self.conv.shape
        return DeltaNetState(
            conv=jnp.zeros((batch, w - 1, c), dtype),  # [B, W - 1, C]
            recurrent=jnp.zeros((batch, self.hv, self.dk, self.dv), jnp.float32),  # [B, Hv, Dk, Dv]
        )


class GatedAttention(nnx.Module):
    """GQA with a sigmoid output gate per head, q/k RMSNorm and partial RoPE."""

    def __init__(self, spec: Qwen35Spec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, n, k, h = spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
        self.wq = nnx.Param(normal_init(rngs.params(), (d, n, h), d, dtype))  # [D, N, H]
        self.wgate = nnx.Param(normal_init(rngs.params(), (d, n, h), d, dtype))  # [D, N, H]
        self.wk = nnx.Param(normal_init(rngs.params(), (d, k, h), d, dtype))  # [D, K, H]
        self.wv = nnx.Param(normal_init(rngs.params(), (d, k, h), d, dtype))  # [D, K, H]
        self.wo = nnx.Param(normal_init(rngs.params(), (n, h, d), n * h, dtype))  # [N, H, D]
        self.q_norm = RMSNorm(h, eps=spec.norm_eps, dtype=dtype, offset=1.0)
        self.k_norm = RMSNorm(h, eps=spec.norm_eps, dtype=dtype, offset=1.0)
        self.rotary_dim = spec.rotary_dim
        self.rope_theta = spec.rope_theta
        self.scale = h ** -0.5

    def _rope(self, x: Float[Array, "b t n h"], positions: Int[Array, "b t"]) -> Float[Array, "b t n h"]:
        r = self.rotary_dim
        inv_freq = rope_frequencies(r, self.rope_theta)  # [R/2]: over the rotated dims only, as transformers
        return jnp.concatenate([apply_rope(x[..., :r], positions, inv_freq), x[..., r:]], axis=-1)

    def __call__(
        self, x: Float[Array, "b t d"], positions: Int[Array, "b t"], cache: AttentionKV | None
    ) -> tuple[Float[Array, "b t d"], AttentionKV | None]:
        """With `cache` (keys of positions [0, S)), the T new keys go to `positions` and the
        queries see every cached key at or before their position; without, they see each other."""
        q, k, v = self.project(x, positions)  # [B, T, N, H], [B, T, K, H] x2
        if cache is None:
            keys, values, k_positions = k, v, positions  # [B, T, K, H] x2, [B, T]
        else:
            write = jax.vmap(lambda c, new, start: jax.lax.dynamic_update_slice_in_dim(c, new, start, axis=0))
            start = positions[:, 0]  # [B]
            keys = write(cache.k, k.astype(cache.k.dtype), start)  # [B, S, K, H]
            values = write(cache.v, v.astype(cache.v.dtype), start)  # [B, S, K, H]
            k_positions = jnp.broadcast_to(jnp.arange(keys.shape[1], dtype=positions.dtype), keys.shape[:2])  # [B, S]
            cache = AttentionKV(keys, values)
        mask = k_positions[:, None, :] <= positions[:, :, None]  # [B, T, S]
        attended = grouped_attention(q, keys, values, mask, self.scale)  # [B, T, N, H]
        return self.output(x, attended), cache

    def project(self, x: Float[Array, "b t d"], positions: Int[Array, "b t"]
                ) -> tuple[Float[Array, "b t n h"], Float[Array, "b t k h"], Float[Array, "b t k h"]]:
        """Queries, keys (q/k norm, partial RoPE) and values of `x` at `positions`."""
        q = self._rope(self.q_norm(einsum("btd,dnh->btnh", x, self.wq[...])), positions)  # [B, T, N, H]
        k = self._rope(self.k_norm(einsum("btd,dkh->btkh", x, self.wk[...])), positions)  # [B, T, K, H]
        v = einsum("btd,dkh->btkh", x, self.wv[...])  # [B, T, K, H]
        return q, k, v

    def output(self, x: Float[Array, "b t d"], attended: Float[Array, "b t n h"]) -> Float[Array, "b t d"]:
        """The attended values gated per head by `sigmoid(x wgate)`, then `o_proj`."""
        gate = jax.nn.sigmoid(einsum("btd,dnh->btnh", x, self.wgate[...]).astype(jnp.float32))  # [B, T, N, H]
        gated = (attended.astype(jnp.float32) * gate).astype(x.dtype)  # [B, T, N, H]
        return einsum("btnh,nhd->btd", gated, self.wo[...])


class DecoderLayer(nnx.Module):
    def __init__(self, spec: Qwen35Spec, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.kind = spec.layer_types[layer]
        norm = functools.partial(RMSNorm, spec.hidden_size, eps=spec.norm_eps, dtype=dtype, offset=1.0)
        self.mixer_norm = norm()
        self.linear_attn = GatedDeltaNet(spec, dtype=dtype, rngs=rngs) if self.kind == LINEAR else None
        self.self_attn = GatedAttention(spec, dtype=dtype, rngs=rngs) if self.kind == FULL else None
        self.mlp_norm = norm()
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size, dtype=dtype, rngs=rngs, activation="silu")

    def __call__(
        self, x: Float[Array, "b t d"], positions: Int[Array, "b t"], state: Any, chunk_size: int | None
    ) -> tuple[Float[Array, "b t d"], Any]:
        h = self.mixer_norm(x)  # [B, T, D]
        if self.linear_attn is not None:
            out, state = self.linear_attn(h, state, chunk_size)
        else:
            assert self.self_attn is not None
            out, state = self.self_attn(h, positions, state)
        x = x + out
        return x + self.mlp(self.mlp_norm(x)), state


# ---------------------------------------------------------------------- model
class Qwen35ForCausalLM(nnx.Module):
    """A Qwen3.5 text model (see the module docstring). Random weights from `from_spec`,
    checkpoint weights from `load_qwen3_5`."""

    def __init__(self, spec: Qwen35Spec, *, rngs: nnx.Rngs, dtype: Any = None):
        self.spec = spec
        self.dtype = jnp.dtype(spec.dtype if dtype is None else dtype)
        d, vocab = spec.hidden_size, spec.vocab_size
        self.embed = nnx.Param(normal_init(rngs.params(), (vocab, d), d, self.dtype))  # [V, D]
        self.layers = _ModuleList([DecoderLayer(spec, i, dtype=self.dtype, rngs=rngs) for i in range(spec.num_layers)])
        self.final_norm = RMSNorm(d, eps=spec.norm_eps, dtype=self.dtype, offset=1.0)
        self.lm_head = None if spec.tie_embeddings else nnx.Param(normal_init(rngs.params(), (d, vocab), d, self.dtype))

    @classmethod
    def from_spec(cls, spec: Qwen35Spec, *, seed: int = 0, dtype: Any = None) -> Qwen35ForCausalLM:
        return cls(spec, rngs=nnx.Rngs(params=seed), dtype=dtype)

    def _logits(self, x: Float[Array, "b t d"]) -> Float[Array, "b t v"]:
        x = self.final_norm(x)
        if self.lm_head is None:
            logits = einsum("btd,vd->btv", x, self.embed[...])
        else:
            logits = einsum("btd,dv->btv", x, self.lm_head[...])
        return logits.astype(jnp.float32)  # [B, T, V]

    def embed_tokens(self, tokens: Int[Array, "b t"]) -> Float[Array, "b t d"]:
        """The token embedding: the paged engine's forward starts here."""
        return jnp.take(self.embed[...], tokens, axis=0)  # [B, T, D]

    def logits(self, hidden: Float[Array, "r d"]) -> Float[Array, "r v"]:
        """Final norm and head of chosen hidden states: float32 [R, V]."""
        return self._logits(hidden[None])[0]

    def _check_tokens(self, tokens: Any) -> None:
        if tokens.ndim != 2 or tokens.shape[1] < 1:
            raise InvalidArgumentError(f"tokens must be [batch, tokens] with at least one token, got shape {tokens.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise InvalidArgumentError(f"tokens must be integers, got {tokens.dtype}")
        if not isinstance(tokens, jax.core.Tracer):
            host = np.asarray(tokens)
            if host.min() < 0 or host.max() >= self.spec.vocab_size:
                raise InvalidArgumentError(f"token ids must lie in [0, {self.spec.vocab_size}), got {host.min()}..{host.max()}")

    def dense_forward(self, tokens: Int[Array, "b s"], *, chunk_size: int = DEFAULT_CHUNK) -> Float[Array, "b s v"]:
        """Float32 logits of every position, no cache (the oracle). Compiled per shape (`jax.jit`)."""
        self._check_tokens(tokens)
        graphdef, params = nnx.split(self)
        return _dense_jit(graphdef, params, tokens, chunk_size)

    def _dense(self, tokens: Int[Array, "b s"], chunk_size: int) -> Float[Array, "b s v"]:
        b, s = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))  # [B, S]
        x = jnp.take(self.embed[...], tokens, axis=0)  # [B, S, D]
        for layer in self.layers:
            linear = layer.linear_attn
            state = None if linear is None else linear.empty_state(b, self.dtype)
            x, _ = layer(x, positions, state, chunk_size)
        return self._logits(x)

    def init_state(self, batch: int, capacity: int) -> Qwen35State:
        """The state of `batch` empty sequences whose attention layers hold up to `capacity` tokens."""
        if batch < 1 or capacity < 1:
            raise InvalidArgumentError(f"batch and capacity must be positive, got {batch}, {capacity}")
        spec = self.spec
        layers: list[DeltaNetState | AttentionKV] = []
        for layer in self.layers:
            if layer.linear_attn is not None:
                layers.append(layer.linear_attn.empty_state(batch, self.dtype))
            else:
                shape = (batch, capacity, spec.num_kv_heads, spec.head_dim)
                layers.append(AttentionKV(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)))  # [B, S, K, H]
        return Qwen35State(tuple(layers), jnp.zeros((batch,), jnp.int32))

    def forward_chunk(
        self, tokens: Int[Array, "b t"], state: Qwen35State, *, chunk_size: int = DEFAULT_CHUNK
    ) -> tuple[Float[Array, "b t v"], Qwen35State]:
        """Float32 logits of T more tokens per row and the state after them.

        T = 1 runs the delta rule's recurrent form, T > 1 its chunked form (`chunk_size`).
        Eagerly, a chunk that would overrun a row's attention capacity raises
        `InvalidArgumentError` before anything runs; under `jax.jit` (lengths unknown) such a
        row's logits come back NaN, never silently computed from a truncated cache.
        """
        self._check_tokens(tokens)
        b, t = tokens.shape
        self._check_state(state, b)
        capacity = self.capacity(state)
        overrun = state.lengths + t > (self.spec.max_seq_len if capacity is None else capacity)  # [B]
        if not isinstance(state.lengths, jax.core.Tracer) and bool(np.any(np.asarray(overrun))):
            raise InvalidArgumentError(f"rows with {np.asarray(state.lengths).tolist()} tokens cannot take {t} more: "
                                       f"the attention cache holds {capacity}")
        graphdef, params = nnx.split(self)
        return _chunk_jit(graphdef, params, tokens, state, chunk_size)

    def _chunk(self, tokens: Int[Array, "b t"], state: Qwen35State, chunk_size: int) -> tuple[Float[Array, "b t v"], Qwen35State]:
        t = tokens.shape[1]
        capacity = self.capacity(state)
        overrun = state.lengths + t > (self.spec.max_seq_len if capacity is None else capacity)  # [B]
        positions = state.lengths[:, None] + jnp.arange(t, dtype=state.lengths.dtype)[None, :]  # [B, T]
        x = jnp.take(self.embed[...], tokens, axis=0)  # [B, T, D]
        new_layers = []
        for layer, layer_state in zip(self.layers, state.layers, strict=True):
            x, layer_state = layer(x, positions, layer_state, None if t == 1 else chunk_size)
            new_layers.append(layer_state)
        logits = self._logits(x)  # [B, T, V]
        logits = jnp.where(overrun[:, None, None], jnp.nan, logits)
        return logits, Qwen35State(tuple(new_layers), state.lengths + t)

    def _check_state(self, state: Any, batch: int) -> None:
        """A state of this model (`init_state`'s structure) for `batch` rows, else InvalidArgumentError."""
        want: Any = jax.tree.structure(jax.eval_shape(lambda: self.init_state(batch, 1)))
        if want != jax.tree.structure(state) or getattr(state.lengths, "shape", None) != (batch,):
            raise InvalidArgumentError(f"state does not fit this model and {batch} rows of tokens: expected "
                                       f"{self.spec.num_layers} layer states ({', '.join(self.spec.layer_types)}) from "
                                       "init_state(batch, capacity)")

    def capacity(self, state: Qwen35State) -> int | None:
        """Tokens the attention layers of `state` hold (None: a model without attention layers)."""
        for layer_state in state.layers:
            if isinstance(layer_state, AttentionKV):
                return int(layer_state.k.shape[1])
        return None


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk_size"))
def _dense_jit(graphdef: Any, params: Any, tokens: jax.Array, chunk_size: int) -> jax.Array:
    model = nnx.merge(graphdef, params)
    return model._dense(tokens, chunk_size)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk_size"))
def _chunk_jit(graphdef: Any, params: Any, tokens: jax.Array, state: Qwen35State, chunk_size: int) -> Any:
    model = nnx.merge(graphdef, params)
    return model._chunk(tokens, state, chunk_size)


# ---------------------------------------------------------------------- checkpoint
@dataclasses.dataclass(frozen=True)
class _Target:
    path: tuple[Any, ...]
    hf_shape: tuple[int, ...]
    convert: Callable[[np.ndarray], np.ndarray]


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _transpose(a: np.ndarray) -> np.ndarray:  # [out, in] -> [in, out]
    return a.T


def _tensor_names(spec: Qwen35Spec, prefix: str, head: str) -> dict[str, _Target]:
    """Checkpoint tensor name -> where it goes in `Qwen35ForCausalLM`."""
    d, f, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    n, k, h = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    hv, dv, c, w = spec.linear_num_value_heads, spec.linear_value_head_dim, spec.conv_channels, spec.conv_kernel
    out = {
        f"{prefix}embed_tokens.weight": _Target(("embed",), (v, d), _same),
        f"{prefix}norm.weight": _Target(("final_norm", "scale"), (d,), _same),
    }
    if not spec.tie_embeddings:
        out[head] = _Target(("lm_head",), (v, d), _transpose)

    def q_part(part: int) -> Callable[[np.ndarray], np.ndarray]:  # q_proj [N * 2H, D]: per head H query rows, H gate rows
        return lambda a: a.reshape(n, 2, h, d)[:, part].transpose(2, 0, 1)  # -> [D, N, H]

    def heads_in(heads: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda a: a.reshape(heads, h, d).transpose(2, 0, 1)  # [heads * H, D] -> [D, heads, H]

    for i, kind in enumerate(spec.layer_types):
        lp = f"{prefix}layers.{i}."
        layer = ("layers", i)
        names: dict[str, tuple[tuple[Any, ...], tuple[int, ...], Callable[[np.ndarray], np.ndarray]]] = {
            "input_layernorm.weight": (("mixer_norm", "scale"), (d,), _same),
            "post_attention_layernorm.weight": (("mlp_norm", "scale"), (d,), _same),
            "mlp.gate_proj.weight": (("mlp", "gate"), (f, d), _transpose),
            "mlp.up_proj.weight": (("mlp", "up"), (f, d), _transpose),
            "mlp.down_proj.weight": (("mlp", "down"), (d, f), _transpose),
        }
        if kind == LINEAR:
            la = ("linear_attn",)
            names.update({
                "linear_attn.in_proj_qkv.weight": (la + ("in_qkv",), (c, d), _transpose),
                "linear_attn.in_proj_z.weight": (la + ("in_z",), (hv * dv, d), _transpose),
                "linear_attn.in_proj_b.weight": (la + ("in_b",), (hv, d), _transpose),
                "linear_attn.in_proj_a.weight": (la + ("in_a",), (hv, d), _transpose),
                "linear_attn.conv1d.weight": (la + ("conv",), (c, 1, w), lambda a: a[:, 0, :].T),
                "linear_attn.A_log": (la + ("a_log",), (hv,), _same),
                "linear_attn.dt_bias": (la + ("dt_bias",), (hv,), _same),
                "linear_attn.norm.weight": (la + ("norm", "scale"), (dv,), _same),
                "linear_attn.out_proj.weight": (la + ("out",), (d, hv * dv), _transpose),
            })
        else:
            sa = ("self_attn",)
            names.update({
                "self_attn.q_proj.weight": (sa + ("wq",), (n * 2 * h, d), q_part(0)),
                "self_attn.k_proj.weight": (sa + ("wk",), (k * h, d), heads_in(k)),
                "self_attn.v_proj.weight": (sa + ("wv",), (k * h, d), heads_in(k)),
                "self_attn.o_proj.weight": (sa + ("wo",), (d, n * h), lambda a: a.reshape(d, n, h).transpose(1, 2, 0)),
                "self_attn.q_norm.weight": (sa + ("q_norm", "scale"), (h,), _same),
                "self_attn.k_norm.weight": (sa + ("k_norm", "scale"), (h,), _same),
            })
        for name, (path, shape, convert) in names.items():
            out[lp + name] = _Target(layer + path, shape, convert)
        if kind == FULL:  # the gate half of q_proj: a second target of the same tensor
            out[lp + "self_attn.q_proj.weight#gate"] = _Target(layer + ("self_attn", "wgate"), (n * 2 * h, d), q_part(1))
    return out


#: tensors of a Qwen3.5 checkpoint that the text model does not use: the multi-token-prediction
#: head (speculative decoding) and the multimodal checkpoints' vision tower
IGNORED_PREFIXES = ("mtp.", "model.visual.")


def _layout(tensors: CheckpointTensors) -> tuple[str, str]:
    for prefix, head in (("model.", "lm_head.weight"), ("model.language_model.", "lm_head.weight")):
        if f"{prefix}embed_tokens.weight" in tensors:
            return prefix, head
    raise CheckpointError(f"{tensors.directory}: no embedding tensor (model.embed_tokens.weight / "
                          "model.language_model.embed_tokens.weight)")


def load_qwen3_5(
    path: str | Path, *, dtype: Any = None, strict_config: bool = False, spec: Qwen35Spec | None = None
) -> Qwen35ForCausalLM:
    """A Qwen3.5 checkpoint directory (config.json + safetensors) as a `Qwen35ForCausalLM`.

    `dtype` (default: the checkpoint's) is the weights' and activations' dtype; the delta-rule
    state is float32 whatever it is. Raises `UnsupportedConfigError` for a config kvjax would
    compute wrong and `CheckpointError` for missing, unexpected or misshapen tensors.
    """
    path = Path(path)
    if spec is None:
        spec = qwen35_spec_from_checkpoint(path, strict=strict_config)
    if dtype is not None:
        name = jnp.dtype(dtype).name
        if name not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        spec = dataclasses.replace(spec, dtype=name)
    tensors = CheckpointTensors(path)
    prefix, head = _layout(tensors)
    targets = _tensor_names(spec, prefix, head)
    # q_proj's gate half ("#gate") is a second target of a stored tensor; tied: transformers ignores a stored head too
    tensors.check_names({name.split("#")[0]: t.hf_shape for name, t in targets.items()},
                        lambda name: name.startswith(IGNORED_PREFIXES) or (spec.tie_embeddings and name == head))
    with shapes_only():
        model = nnx.eval_shape(lambda: Qwen35ForCausalLM(spec, rngs=nnx.Rngs(params=0)))
    target_dtype = np.dtype(jnp.dtype(spec.dtype))
    for name, target in targets.items():
        var = parameter_at(model, target.path)
        value = np.asarray(target.convert(tensors.array(name.split("#")[0])), target_dtype)
        expected = tuple(var.get_value().shape)
        if value.shape != expected:  # a layout bug, not a user error: names and shapes were checked
            raise AssertionError(f"{name}: converted to {value.shape}, parameter is {expected}")
        var.set_value(jax.device_put(value))
    return model
