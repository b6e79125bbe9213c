"""Granite-4.0-H dense (`GraniteMoeHybridForCausalLM` with `num_local_experts = 0`, model_type
`granitemoehybrid`): Mamba2 layers and attention layers, each followed by a SwiGLU MLP, with
Granite's multipliers; parity with transformers 5.24. Mixture-of-experts configs are refused.

Granite scales the embeddings by `embedding_multiplier`, every residual branch by
`residual_multiplier`, attention logits by `attention_multiplier` (instead of head_dim ** -0.5)
and divides the logits by `logits_scaling`. Attention uses RoPE only with
`position_embedding_type: rope` (the published models say `nope`).

A Mamba2 layer: `z, xBC, dt = split(in_proj(h))`, `xBC = silu(conv(xBC))` (causal depthwise, width
K = `mamba_d_conv`), `x, B, C = split(xBC)`, `y = SSD(x, softplus(dt + dt_bias), -exp(A_log), B, C) + D x`,
then a grouped RMSNorm of `y * silu(z)` and `out_proj`. Its state: the conv's last K-1 inputs
`[B, K-1, I + 2 G N]` and the float32 SSM state `[B, NH, P, N]`. Layers run in a Python loop.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax.models.hybrid.blocks import HybridAttention, HybridLM
from kvjax.models.hybrid.config import ConfigReader
from kvjax.models.hybrid.conv import causal_conv1d, conv_state_zeros
from kvjax.models.hybrid.loading import Source, attention_sources, head_sources, load_family, rows, same, transpose
from kvjax.models.hybrid.ssd import ssd_chunked, ssd_recurrent
from kvjax.models.hybrid.state import MambaState
from kvjax.models.layers import MLP, RMSNorm, einsum, normal_init

MODEL_TYPE = "granitemoehybrid"
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, hidden_act="silu",
    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
    attention_bias=False, embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0,
    attention_multiplier=1.0, num_local_experts=8, shared_intermediate_size=1024, mamba_n_heads=128,
    mamba_n_groups=1, mamba_d_state=256, mamba_d_head="auto", mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
    mamba_conv_bias=True, mamba_proj_bias=False,
)
_LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}
_IGNORED = {
    "init_method": "training-time initialisation",
    "output_router_logits": "what transformers returns (router logits; no experts here)",
    "router_aux_loss_coef": "training loss of the (absent) router",
    "num_experts_per_tok": "routing of the (absent) experts",
    "intermediate_size": "the experts' width; the dense model has none (shared_intermediate_size is its MLP)",
    "attention_dropout": "dropout: training only",
    **{k: "training-time initialisation of dt_bias (Mamba)" for k in ("time_step_min", "time_step_max", "time_step_floor")},
}


@dataclasses.dataclass(frozen=True)
class GraniteSpec:
    """What a Granite-4.0-H dense checkpoint's config.json says, checked (`from_hf_config`)."""

    name: str
    vocab_size: int
    hidden_size: int
    ffn_size: int  # shared_intermediate_size
    layer_types: tuple[str, ...]  # "mamba" or "attention" per layer
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float | None  # None: no positional embedding (`nope`)
    norm_eps: float
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float
    logits_scaling: float
    mamba_heads: int  # NH
    mamba_head_dim: int  # P
    mamba_groups: int  # G
    mamba_state: int  # N
    mamba_conv: int  # K
    mamba_chunk: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    max_seq_len: int
    tie_embeddings: bool = False
    dtype: str = "float32"

    model_type = MODEL_TYPE

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_inner(self) -> int:  # I = NH * P
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_channels(self) -> int:  # I + 2 G N: the conv runs over x, B and C
        return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state

    @classmethod
    def from_hf_config(cls, config: dict, *, name: str = "checkpoint", source: str = "<config.json>",
                       strict: bool = False) -> GraniteSpec:
        f = ConfigReader(config, source, MODEL_TYPE, _DEFAULTS)
        if config.get("model_type") != MODEL_TYPE:
            raise f.error("model_type", f"{config.get('model_type')!r} is not {MODEL_TYPE!r}")
        experts = f.get("num_local_experts")
        if isinstance(experts, bool) or not isinstance(experts, int) or experts != 0:
            raise f.error("num_local_experts", f"{experts!r}: mixture-of-experts Granite-4.0-H models are not "
                                               "supported (supported: 0, the dense models; absent means 8)")
        hidden = f.int("hidden_size")
        heads = f.int("num_attention_heads")
        layers = f.int("num_hidden_layers")
        kv = f.int("num_key_value_heads", heads)
        if heads % kv:
            raise f.error("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
        head_dim = f.int("head_dim", hidden // heads)
        given = {k: config[k] for k in ("layer_types", "layers_block_type") if config.get(k) is not None}
        if len(given) == 2 and [_LAYER_KINDS.get(t) for t in given["layer_types"]] != [
                _LAYER_KINDS.get(t) for t in given["layers_block_type"]]:
            raise f.error("layers_block_type", "disagrees with layer_types; refusing an ambiguous config")
        f.used.update({"layer_types", "layers_block_type"})
        raw = next(iter(given.values()), ["mamba"] * layers)
        if not isinstance(raw, list) or len(raw) != layers or any(t not in _LAYER_KINDS for t in raw):
            raise f.error(next(iter(given), "layer_types"),
                          f"expected {layers} entries of {', '.join(_LAYER_KINDS)}, got {raw!r}")
        act = f.get("hidden_act")
        if act not in ("silu", "swish"):
            raise f.error("hidden_act", f"value {act!r} is not supported (supported: silu)")
        norm = f.get("normalization_function", "rmsnorm")
        if norm != "rmsnorm":
            raise f.error("normalization_function", f"value {norm!r} is not supported (supported: rmsnorm)")
        pos = f.get("position_embedding_type", None)
        if pos not in (None, "nope", "rope"):
            raise f.error("position_embedding_type", f"value {pos!r} is not supported (supported: rope, nope, null)")
        if pos == "rope":
            theta: float | None = f.rope_theta()
            if head_dim % 2:
                raise f.error("head_dim", f"{head_dim} is odd; RoPE rotates pairs")
        else:
            theta = None
            f.used.update({"rope_theta", "rope_parameters", "rope_scaling"})  # transformers builds no RoPE
        limit = f.get("time_step_limit", None)
        if isinstance(limit, list) and len(limit) == 2 and limit[1] == {"__float__": "Infinity"}:
            limit = [limit[0], math.inf]  # how transformers 5 writes float("inf") into config.json
        if limit is not None and (not isinstance(limit, list) or len(limit) != 2
                                  or limit[0] != 0.0 or limit[1] != math.inf):
            raise f.error("time_step_limit", f"{limit!r} is not supported (supported: [0.0, Infinity], no clamp)")
        nh = f.int("mamba_n_heads")
        groups = f.int("mamba_n_groups")
        inner = f.int("mamba_expand") * hidden
        d_head = f.get("mamba_d_head")
        if d_head == "auto":
            d_head = inner // nh
        if isinstance(d_head, bool) or not isinstance(d_head, int) or d_head < 1 or d_head * nh != inner:
            raise f.error("mamba_d_head", f"{d_head!r} x mamba_n_heads {nh} must equal mamba_expand x hidden_size "
                                          f"({inner})")
        if nh % groups:
            raise f.error("mamba_n_groups", f"{groups} does not divide mamba_n_heads {nh}")
        return cls(
            name=name,
            vocab_size=f.int("vocab_size"),
            hidden_size=hidden,
            ffn_size=f.int("shared_intermediate_size"),
            layer_types=tuple(_LAYER_KINDS[t] for t in raw),
            num_attention_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            attention_bias=f.flag("attention_bias"),
            rope_theta=theta,
            norm_eps=f.number("rms_norm_eps"),
            embedding_multiplier=f.number("embedding_multiplier"),
            residual_multiplier=f.number("residual_multiplier"),
            attention_multiplier=f.number("attention_multiplier"),
            logits_scaling=f.number("logits_scaling"),
            mamba_heads=nh,
            mamba_head_dim=d_head,
            mamba_groups=groups,
            mamba_state=f.int("mamba_d_state"),
            mamba_conv=f.int("mamba_d_conv"),
            mamba_chunk=f.int("mamba_chunk_size"),
            mamba_conv_bias=f.flag("mamba_conv_bias"),
            mamba_proj_bias=f.flag("mamba_proj_bias"),
            max_seq_len=f.int("max_position_embeddings"),
            tie_embeddings=f.flag("tie_word_embeddings"),
            dtype=f.close(_IGNORED, strict),
        )


def mamba_zeros(spec: GraniteSpec, batch: int, dtype: jnp.dtype) -> MambaState:
    """A Mamba2 layer's state before any token: conv inputs in `dtype`, the SSM state float32."""
    return MambaState(conv=conv_state_zeros(batch, spec.mamba_conv, spec.conv_channels, dtype),
                      ssm=jnp.zeros((batch, spec.mamba_heads, spec.mamba_head_dim, spec.mamba_state), jnp.float32))


class Mamba2(nnx.Module):
    """Granite's Mamba2 mixer (see the module docstring); `__call__` picks the chunked SSD for
    chunks of several tokens and the recurrent form for single-token decode."""

    def __init__(self, spec: GraniteSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, inner, nh, conv = spec.hidden_size, spec.mamba_inner, spec.mamba_heads, spec.conv_channels
        self.spec = spec
        width = inner + conv + nh  # z, xBC, dt
        self.in_proj = nnx.Param(normal_init(rngs.params(), (d, width), d, dtype))  # [D, I + C + NH]
        self.conv_w = nnx.Param(normal_init(rngs.params(), (spec.mamba_conv, conv), spec.mamba_conv, dtype))  # [K, C]
        self.dt_bias = nnx.Param(jnp.zeros((nh,), dtype))  # [NH]
        self.a_log = nnx.Param(jnp.zeros((nh,), dtype))  # [NH]: A = -exp(a_log)
        self.d = nnx.Param(jnp.ones((nh,), dtype))  # [NH]
        self.norm = nnx.Param(jnp.ones((inner,), dtype))  # [I]: gated grouped RMSNorm scale
        self.out_proj = nnx.Param(normal_init(rngs.params(), (inner, d), inner, dtype))  # [I, D]
        self.conv_b: nnx.Param | None = nnx.Param(jnp.zeros((conv,), dtype)) if spec.mamba_conv_bias else None  # [C]
        if spec.mamba_proj_bias:
            self.in_bias: nnx.Param | None = nnx.Param(jnp.zeros((width,), dtype))  # [I + C + NH]
            self.out_bias: nnx.Param | None = nnx.Param(jnp.zeros((d,), dtype))  # [D]
        else:
            self.in_bias = self.out_bias = None

    def __call__(self, h: Float[Array, "B T D"], state: MambaState, lens: Int[Array, " B"] | None = None
                 ) -> tuple[Float[Array, "B T D"], MambaState]:
        """`lens`: right-padded rows of `lens[b]` real tokens (the paged engine): padding gets
        dt = 0 (no decay, no input) and stays out of the conv state, so the state is the real tokens'."""
        s = self.spec
        b, t, _ = h.shape
        inner, nh, p, g, n = s.mamba_inner, s.mamba_heads, s.mamba_head_dim, s.mamba_groups, s.mamba_state
        proj = einsum("btd,de->bte", h, self.in_proj[...])  # [B, T, I + C + NH]
        if self.in_bias is not None:
            proj = proj + self.in_bias[...]
        z, xbc, dt = proj[..., :inner], proj[..., inner:inner + s.conv_channels], proj[..., inner + s.conv_channels:]
        conv_b = None if self.conv_b is None else self.conv_b[...]
        xbc, conv_state = causal_conv1d(xbc, self.conv_w[...], conv_b, state.conv, lens)  # [B, T, C], [B, K-1, C]
        xbc = jax.nn.silu(xbc.astype(jnp.float32))  # [B, T, C]
        x = xbc[..., :inner].reshape(b, t, nh, p)  # [B, T, NH, P]
        bm = xbc[..., inner:inner + g * n].reshape(b, t, g, n)  # [B, T, G, N]
        cm = xbc[..., inner + g * n:].reshape(b, t, g, n)  # [B, T, G, N]
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))  # [B, T, NH]
        if lens is not None:
            dt = jnp.where(jnp.arange(t)[None, :, None] < lens[:, None, None], dt, 0.0)  # [B, T, NH]
        a = -jnp.exp(self.a_log[...].astype(jnp.float32))  # [NH]
        if t == 1:
            y, ssm = ssd_recurrent(x, dt, a, bm, cm, self.d[...], state.ssm)  # [B, 1, NH, P], [B, NH, P, N]
        else:
            y, ssm = ssd_chunked(x, dt, a, bm, cm, self.d[...], state.ssm, s.mamba_chunk)
        y = y.reshape(b, t, inner) * jax.nn.silu(z.astype(jnp.float32))  # [B, T, I]
        grouped = y.reshape(b, t, g, inner // g)  # [B, T, G, I/G]: the norm's statistics per group
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + s.norm_eps)
        y = (self.norm[...].astype(jnp.float32) * grouped.reshape(b, t, inner)).astype(h.dtype)  # [B, T, I]
        out = einsum("bti,id->btd", y, self.out_proj[...])  # [B, T, D]
        if self.out_bias is not None:
            out = out + self.out_bias[...]
        return out, MambaState(conv=conv_state, ssm=ssm)


class GraniteLayer(nnx.Module):
    """`h + r * op(norm(h))`, then `+ r * mlp(norm(.))` with r = residual_multiplier."""

    def __init__(self, spec: GraniteSpec, kind: str, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d = spec.hidden_size
        self.residual = spec.residual_multiplier
        self.input_norm = RMSNorm(d, eps=spec.norm_eps, dtype=dtype)
        self.post_norm = RMSNorm(d, eps=spec.norm_eps, dtype=dtype)
        self.mlp = MLP(d, spec.ffn_size, dtype=dtype, rngs=rngs)
        if kind == "mamba":
            self.mamba: Mamba2 | None = Mamba2(spec, dtype=dtype, rngs=rngs)
            self.attn: HybridAttention | None = None
        else:
            self.mamba = None
            self.attn = HybridAttention(d, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim, dtype=dtype,
                                        rngs=rngs, scale=spec.attention_multiplier, rope_theta=spec.rope_theta,
                                        bias=spec.attention_bias)

    def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"], state: Any,
                 start: Int[Array, ""] | None) -> tuple[Float[Array, "B T D"], Any]:
        h = self.input_norm(x)  # [B, T, D]
        new_state: Any
        if self.mamba is not None:  # dense_forward (no state) starts from zeros
            start_state = state if state is not None else mamba_zeros(self.mamba.spec, x.shape[0], x.dtype)
            out, mamba_state = self.mamba(h, start_state)
            new_state = None if state is None else mamba_state
        else:
            assert self.attn is not None
            out, new_state = self.attn(h, positions, state, start)  # [B, T, D]
        x = x + out * jnp.asarray(self.residual, x.dtype)
        return x + self.mlp(self.post_norm(x)) * jnp.asarray(self.residual, x.dtype), new_state


class Granite(HybridLM):
    """The Granite-4.0-H dense causal LM: `dense_forward` (oracle; chunked SSD over the whole
    sequence) and `forward_chunk` (with `HybridState`), with Granite's embedding and logits scales."""

    spec: GraniteSpec

    def __init__(self, spec: GraniteSpec, *, rngs: nnx.Rngs):
        super().__init__(spec, lambda kind, dtype: GraniteLayer(spec, kind, dtype=dtype, rngs=rngs), rngs=rngs)

    def _recurrent_state(self, kind: str, batch: int) -> MambaState | None:
        return mamba_zeros(self.spec, batch, self.dtype) if kind == "mamba" else None

    def _embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        x = super()._embed(tokens)  # [B, T, D]
        return x * jnp.asarray(self.spec.embedding_multiplier, x.dtype)

    def _logits(self, x: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        return super()._logits(x) / jnp.float32(self.spec.logits_scaling)  # [B, T, V]


def granite_sources(spec: GraniteSpec) -> tuple[list[Source], tuple[str, ...]]:
    """(checkpoint tensor -> parameter table, tensors a checkpoint may carry unused)."""
    d, n, k, h, f = spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim, spec.ffn_size
    out, optional = head_sources(spec, "norm")
    inner, nh, conv = spec.mamba_inner, spec.mamba_heads, spec.conv_channels
    width = inner + conv + nh
    for i, kind in enumerate(spec.layer_types):
        p = f"model.layers.{i}."
        lay: tuple[Any, ...] = ("layers", i)
        out += [Source(p + "input_layernorm.weight", lay + ("input_norm", "scale"), (d,), same),
                Source(p + "post_attention_layernorm.weight", lay + ("post_norm", "scale"), (d,), same),
                Source(p + "shared_mlp.input_linear.weight", lay + ("mlp", "gate"), (2 * f, d), rows(0, f, transpose)),
                Source(p + "shared_mlp.input_linear.weight", lay + ("mlp", "up"), (2 * f, d), rows(f, 2 * f, transpose)),
                Source(p + "shared_mlp.output_linear.weight", lay + ("mlp", "down"), (d, f), transpose)]
        if kind == "mamba":
            m, mp = lay + ("mamba",), p + "mamba."
            out += [Source(mp + "in_proj.weight", m + ("in_proj",), (width, d), transpose),
                    Source(mp + "conv1d.weight", m + ("conv_w",), (conv, 1, spec.mamba_conv), lambda a: a[:, 0, :].T),
                    Source(mp + "dt_bias", m + ("dt_bias",), (nh,), same),
                    Source(mp + "A_log", m + ("a_log",), (nh,), same),
                    Source(mp + "D", m + ("d",), (nh,), same),
                    Source(mp + "norm.weight", m + ("norm",), (inner,), same),
                    Source(mp + "out_proj.weight", m + ("out_proj",), (d, inner), transpose)]
            if spec.mamba_conv_bias:
                out.append(Source(mp + "conv1d.bias", m + ("conv_b",), (conv,), same))
            if spec.mamba_proj_bias:
                out += [Source(mp + "in_proj.bias", m + ("in_bias",), (width,), same),
                        Source(mp + "out_proj.bias", m + ("out_bias",), (d,), same)]
        else:
            a, ap = lay + ("attn",), p + "self_attn."
            out += attention_sources(ap, a, spec, "o_proj")
            if spec.attention_bias:
                out += [Source(ap + "q_proj.bias", a + ("bq",), (n * h,), lambda x: x.reshape(n, h)),
                        Source(ap + "k_proj.bias", a + ("bk",), (k * h,), lambda x: x.reshape(k, h)),
                        Source(ap + "v_proj.bias", a + ("bv",), (k * h,), lambda x: x.reshape(k, h)),
                        Source(ap + "o_proj.bias", a + ("bo",), (d,), same)]
    return out, optional


def load_granite(path: str | Path, *, dtype: Any = None, strict_config: bool = False) -> Granite:
    """A Granite-4.0-H dense checkpoint directory as a `Granite` model; `dtype` (default: the
    checkpoint's) is the weights', activations' and conv states' dtype (SSM states stay float32)."""
    model: Granite = load_family(path, GraniteSpec.from_hf_config,
                                 lambda spec: Granite(spec, rngs=nnx.Rngs(params=0)), granite_sources, dtype,
                                 strict_config)
    return model
