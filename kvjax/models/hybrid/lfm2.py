"""LFM2 (`Lfm2ForCausalLM`, model_type `lfm2`): gated short-convolution layers and full-attention
layers (q/k RMSNorm, RoPE), each followed by a SwiGLU MLP; parity with transformers 5.24.

A conv layer computes `out_proj(C * conv(B * x))` with `B, C, x = split(in_proj(h))` and a causal
depthwise convolution of width K = `conv_L_cache`; its state is the last K-1 conv inputs
`[B, K-1, D]`. An attention layer keeps its keys and values. Layers run in a Python loop (the
pattern of conv and attention layers is irregular); there is no `lax.scan` over layers yet.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax.models.hybrid.blocks import HybridAttention, HybridLM
from kvjax.models.hybrid.config import ConfigReader
from kvjax.models.hybrid.conv import causal_conv1d, conv_state_zeros
from kvjax.models.hybrid.loading import Source, attention_sources, head_sources, load_family, same, transpose
from kvjax.models.hybrid.state import ConvState
from kvjax.models.layers import MLP, RMSNorm, einsum, normal_init

MODEL_TYPE = "lfm2"
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=65536, hidden_size=2560, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=128_000, norm_eps=1e-5, tie_word_embeddings=True,
    rope_theta=1000000.0, conv_bias=False, conv_L_cache=3, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=True,
)
#: fields of hub LFM2 configs that transformers does not read (or reads as another field), and why
_IGNORED = {
    "block_mlp_init_scale": "training-time initialisation",
    "block_out_init_scale": "training-time initialisation",
    "block_use_xavier_init": "training-time initialisation",
    "conv_use_xavier_init": "training-time initialisation",
    "block_norm_eps": "transformers reads norm_eps (LFM2's own code used the same value)",
    "block_use_swiglu": "transformers always builds the SwiGLU MLP",
    "use_pos_enc": "transformers always applies RoPE on LFM2's attention layers",
    "theta": "legacy copy of rope_theta; transformers reads rope_theta / rope_parameters",
    "full_attn_idxs": "read as layer_types",
    "attention_dropout": "dropout: training only",
}


@dataclasses.dataclass(frozen=True)
class Lfm2Spec:
    """What an LFM2 checkpoint's config.json says, checked (`from_hf_config`)."""

    name: str
    vocab_size: int
    hidden_size: int
    ffn_size: int  # the MLP width as transformers builds it (after block_auto_adjust_ff_dim)
    layer_types: tuple[str, ...]  # "conv" or "full_attention" per layer
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    conv_kernel: int  # K = conv_L_cache; the conv state keeps K-1 columns
    conv_bias: bool
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_embeddings: bool = True
    dtype: str = "float32"

    model_type = MODEL_TYPE

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf_config(cls, config: dict, *, name: str = "checkpoint", source: str = "<config.json>",
                       strict: bool = False) -> Lfm2Spec:
        f = ConfigReader(config, source, MODEL_TYPE, _DEFAULTS)
        if config.get("model_type") != MODEL_TYPE:
            raise f.error("model_type", f"{config.get('model_type')!r} is not {MODEL_TYPE!r}")
        hidden = f.int("hidden_size")
        heads = f.int("num_attention_heads")
        layers = f.int("num_hidden_layers")
        # transformers pops the legacy spellings: block_ff_dim replaces intermediate_size, tie_embedding the tie flag
        inter = f.int("block_ff_dim") if f.has("block_ff_dim") else f.int("intermediate_size")
        if f.has("block_ff_dim"):
            f.used.add("intermediate_size")
        tie = f.flag("tie_embedding") if f.has("tie_embedding") else f.flag("tie_word_embeddings")
        if f.has("tie_embedding"):
            f.used.add("tie_word_embeddings")
        ffn = inter
        if f.flag("block_auto_adjust_ff_dim"):
            ffn = int(2 * inter / 3)
            mult = f.get("block_ffn_dim_multiplier")
            if mult is not None:
                mult = f.number("block_ffn_dim_multiplier")
                multiple = f.int("block_multiple_of")
                ffn = int(mult * ffn)
                ffn = multiple * ((ffn + multiple - 1) // multiple)
        else:
            f.used.update({"block_ffn_dim_multiplier", "block_multiple_of"})
        if ffn < 1:
            raise f.error("intermediate_size", f"gives an MLP width of {ffn}")
        types = f.get("layer_types", None)
        if types is None:
            idxs = f.get("full_attn_idxs", list(range(layers)))
            if not isinstance(idxs, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in idxs):
                raise f.error("full_attn_idxs", f"expected a list of layer indices, got {idxs!r}")
            types = ["full_attention" if i in idxs else "conv" for i in range(layers)]
        elif not isinstance(types, list) or len(types) != layers or any(t not in ("conv", "full_attention")
                                                                         for t in types):
            raise f.error("layer_types", f"expected {layers} entries of conv / full_attention, got {types!r}")
        if f.has("full_attn_idxs") and f.has("layer_types"):
            implied = [i for i, t in enumerate(types) if t == "full_attention"]
            f.same("full_attn_idxs", implied, "the attention layers of layer_types")
        kv = f.int("num_key_value_heads")
        if heads % kv:
            raise f.error("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
        head_dim = f.int("head_dim", hidden // heads)
        if head_dim % 2:
            raise f.error("head_dim", f"{head_dim} is odd; RoPE rotates pairs")
        for legacy in ("block_dim", "conv_dim", "conv_dim_out"):
            f.same(legacy, hidden, "hidden_size; transformers ignores it")
        f.same("num_heads", heads, "num_attention_heads; transformers ignores it")
        return cls(
            name=name,
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            ffn_size=ffn,
            layer_types=tuple(types),
            num_attention_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            conv_kernel=f.int("conv_L_cache"),
            conv_bias=f.flag("conv_bias"),
            norm_eps=f.number("norm_eps"),
            rope_theta=f.rope_theta(),
            max_seq_len=f.int("max_position_embeddings"),
            tie_embeddings=tie,
            dtype=f.close(_IGNORED, strict),
        )


class ShortConv(nnx.Module):
    """LFM2's gated short convolution: `out_proj(C * conv(B * x))`, `B, C, x = split(in_proj(h))`."""

    def __init__(self, dim: int, kernel: int, bias: bool, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.in_proj = nnx.Param(normal_init(rngs.params(), (dim, 3 * dim), dim, dtype))  # [D, 3D]
        self.conv_w = nnx.Param(normal_init(rngs.params(), (kernel, dim), kernel, dtype))  # [K, D]
        self.out_proj = nnx.Param(normal_init(rngs.params(), (dim, dim), dim, dtype))  # [D, D]
        if bias:
            self.in_bias: nnx.Param | None = nnx.Param(jnp.zeros((3 * dim,), dtype))  # [3D]
            self.conv_b: nnx.Param | None = nnx.Param(jnp.zeros((dim,), dtype))  # [D]
            self.out_bias: nnx.Param | None = nnx.Param(jnp.zeros((dim,), dtype))  # [D]
        else:
            self.in_bias = self.conv_b = self.out_bias = None

    def __call__(self, h: Float[Array, "B T D"], state: Float[Array, "B Km1 D"], lens: Int[Array, " B"] | None = None
                 ) -> tuple[Float[Array, "B T D"], Float[Array, "B Km1 D"]]:
        """`lens`: right-padded rows of `lens[b]` real tokens (the paged engine); the state skips the padding."""
        bcx = einsum("btd,de->bte", h, self.in_proj[...])  # [B, T, 3D]
        if self.in_bias is not None:
            bcx = bcx + self.in_bias[...]
        b, c, x = jnp.split(bcx, 3, axis=-1)  # [B, T, D] each
        conv_b = None if self.conv_b is None else self.conv_b[...]
        y, new_state = causal_conv1d(b * x, self.conv_w[...], conv_b, state, lens)  # [B, T, D], [B, K-1, D]
        out = einsum("btd,de->bte", c * y, self.out_proj[...])  # [B, T, D]
        if self.out_bias is not None:
            out = out + self.out_bias[...]
        return out, new_state


class Lfm2Layer(nnx.Module):
    """`h + op(norm(h))`, then `+ mlp(norm(.))`; `op` is the short conv or attention."""

    def __init__(self, spec: Lfm2Spec, kind: str, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = spec.hidden_size
        self.kind = kind
        self.operator_norm = RMSNorm(d, eps=spec.norm_eps, dtype=dtype)
        self.ffn_norm = RMSNorm(d, eps=spec.norm_eps, dtype=dtype)
        self.mlp = MLP(d, spec.ffn_size, dtype=dtype, rngs=rngs)
        if kind == "conv":
            self.conv: ShortConv | None = ShortConv(d, spec.conv_kernel, spec.conv_bias, dtype=dtype, rngs=rngs)
            self.attn: HybridAttention | None = None
        else:
            self.conv = None
            self.attn = HybridAttention(d, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim, dtype=dtype,
                                        rngs=rngs, scale=spec.head_dim**-0.5, rope_theta=spec.rope_theta,
                                        qk_norm_eps=spec.norm_eps)

    def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"], state: Any,
                 start: Int[Array, ""] | None) -> tuple[Float[Array, "B T D"], Any]:
        h = self.operator_norm(x)  # [B, T, D]
        if self.conv is not None:
            conv_in = state.conv if state is not None else conv_state_zeros(x.shape[0], self.conv.conv_w.shape[0],
                                                                             x.shape[2], x.dtype)
            out, conv_state = self.conv(h, conv_in)  # [B, T, D]
            new_state: Any = None if state is None else ConvState(conv=conv_state)
        else:
            assert self.attn is not None
            out, new_state = self.attn(h, positions, state, start)  # [B, T, D]
        x = x + out
        return x + self.mlp(self.ffn_norm(x)), new_state


class Lfm2(HybridLM):
    """The LFM2 causal LM. `dense_forward` (no state, the oracle) and `forward_chunk` (prefill
    chunks of any size and decode steps, carrying `HybridState`) give the same logits."""

    spec: Lfm2Spec

    def __init__(self, spec: Lfm2Spec, *, rngs: nnx.Rngs):
        # the final norm is transformers' embedding_norm
        super().__init__(spec, lambda kind, dtype: Lfm2Layer(spec, kind, dtype=dtype, rngs=rngs), rngs=rngs)

    def _recurrent_state(self, kind: str, batch: int) -> ConvState | None:
        s = self.spec
        return ConvState(conv=conv_state_zeros(batch, s.conv_kernel, s.hidden_size, self.dtype)) if kind == "conv" else None


def lfm2_sources(spec: Lfm2Spec) -> tuple[list[Source], tuple[str, ...]]:
    """(checkpoint tensor -> parameter table, tensors a checkpoint may carry unused)."""
    d, h, f = spec.hidden_size, spec.head_dim, spec.ffn_size
    out, optional = head_sources(spec, "embedding_norm")
    kk = spec.conv_kernel
    for i, kind in enumerate(spec.layer_types):
        p = f"model.layers.{i}."
        lay: tuple[Any, ...] = ("layers", i)
        out += [Source(p + "operator_norm.weight", lay + ("operator_norm", "scale"), (d,), same),
                Source(p + "ffn_norm.weight", lay + ("ffn_norm", "scale"), (d,), same),
                Source(p + "feed_forward.w1.weight", lay + ("mlp", "gate"), (f, d), transpose),
                Source(p + "feed_forward.w3.weight", lay + ("mlp", "up"), (f, d), transpose),
                Source(p + "feed_forward.w2.weight", lay + ("mlp", "down"), (d, f), transpose)]
        if kind == "conv":
            c = lay + ("conv",)
            out += [Source(p + "conv.in_proj.weight", c + ("in_proj",), (3 * d, d), transpose),
                    Source(p + "conv.conv.weight", c + ("conv_w",), (d, 1, kk), lambda a: a[:, 0, :].T),
                    Source(p + "conv.out_proj.weight", c + ("out_proj",), (d, d), transpose)]
            if spec.conv_bias:
                out += [Source(p + "conv.in_proj.bias", c + ("in_bias",), (3 * d,), same),
                        Source(p + "conv.conv.bias", c + ("conv_b",), (d,), same),
                        Source(p + "conv.out_proj.bias", c + ("out_bias",), (d,), same)]
        else:
            a = lay + ("attn",)
            out += attention_sources(p + "self_attn.", a, spec, "out_proj")
            out += [Source(p + "self_attn.q_layernorm.weight", a + ("q_norm", "scale"), (h,), same),
                    Source(p + "self_attn.k_layernorm.weight", a + ("k_norm", "scale"), (h,), same)]
    return out, optional


def load_lfm2(path: str | Path, *, dtype: Any = None, strict_config: bool = False) -> Lfm2:
    """An LFM2 checkpoint directory (config.json + safetensors) as an `Lfm2` model; `dtype`
    (default: the checkpoint's) is the weights', activations' and states' dtype."""
    model: Lfm2 = load_family(path, Lfm2Spec.from_hf_config, lambda spec: Lfm2(spec, rngs=nnx.Rngs(params=0)),
                              lfm2_sources, dtype, strict_config)
    return model
