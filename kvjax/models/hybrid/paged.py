"""The paged forward of the hybrid models (LFM2, Granite-4.0-H dense, Qwen3.5): what the serving
engine runs instead of `forward_chunk`'s dense per-batch state.

Attention layers write and read the paged KV pools through the device ops exactly as the
`Transformer` does (`write_kv` on the flat token batch, `paged_attention` per row group with the
full-attention window's block tables and sequence lengths). Each recurrent layer reads its state
for every row from the state pool at the row's READ slot (the null slot, zeros, for a fresh
sequence), runs the row group's chunk (prefill: the chunked form; decode, one token: the
recurrent form) and writes the state after the row's real tokens to its WRITE slot (-1:
padding rows write nothing). The ledger's recurrent-state window hands out both slots
(`KVCacheManager.begin_recurrent_step`, copy-forward).

Rows of a group hold the LAST `q_len` positions of their sequence (left-padded, the engine's
convention); a recurrent layer rolls each row to right padding first (`lens[b]` real tokens,
then padding that neither decays nor enters the state), then rolls its output back.

The KV pools cover only the attention layers: `kv_cache_view(config)` is the attention-only
`CacheConfig` they are allocated from (layer j there is the model's j-th attention layer); the
state pools follow `state_geometry(config, layout)` (layer j: the j-th recurrent layer).

Letters: N flat tokens, R rows, T tokens per row, D width, M block-table width.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from kvjax.config import RECURRENT_STATES, CacheConfig
from kvjax.device.state_pools import StateField, StateGeometry, StatePools, read_states, write_states
from kvjax.errors import InvalidArgumentError
from kvjax.models.hybrid.deltanet import DEFAULT_CHUNK
from kvjax.models.hybrid.granite import GraniteSpec
from kvjax.models.hybrid.lfm2 import Lfm2Spec
from kvjax.models.hybrid.qwen3_5 import LINEAR, DeltaNetState, Qwen35ForCausalLM, Qwen35Spec
from kvjax.models.hybrid.state import MambaState
from kvjax.transfer_plan import TransferPlan


@dataclasses.dataclass(frozen=True)
class HybridLayout:
    """Which layers of a hybrid model are recurrent, their state's fields (one `StateField`
    per part, per layer without the batch axis) and the attention layers' KV geometry."""

    recurrent: tuple[bool, ...]  # per model layer
    fields: tuple[StateField, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def num_layers(self) -> int:
        return len(self.recurrent)

    @property
    def state_bytes(self) -> int:
        """One recurrent layer's state (`CacheConfig.recurrent_state_bytes`)."""
        return sum(f.layer_bytes for f in self.fields)

    def attention_windows(self, max_seq_len: int) -> tuple[int, ...]:
        return tuple(RECURRENT_STATES if r else max_seq_len for r in self.recurrent)


def is_hybrid_spec(spec: Any) -> bool:
    """The spec of a hybrid family (`Lfm2Spec`, `GraniteSpec`, `Qwen35Spec`)."""
    return isinstance(spec, (Lfm2Spec, GraniteSpec, Qwen35Spec))


def hybrid_layout(model: Any) -> HybridLayout:
    """The layout of an `Lfm2`, a `Granite` or a `Qwen35ForCausalLM`, or of its spec (states in
    the spec's dtype) (`InvalidArgumentError` else)."""
    s = getattr(model, "spec", model)
    dtype = jnp.dtype(getattr(model, "dtype", None) or s.dtype).name
    if isinstance(s, Lfm2Spec):
        rec = tuple(t == "conv" for t in s.layer_types)
        fields: tuple[StateField, ...] = (StateField("conv", (s.conv_kernel - 1, s.hidden_size), dtype),)
    elif isinstance(s, GraniteSpec):
        rec = tuple(t == "mamba" for t in s.layer_types)
        fields = (StateField("conv", (s.mamba_conv - 1, s.conv_channels), dtype),
                  StateField("ssm", (s.mamba_heads, s.mamba_head_dim, s.mamba_state), "float32"))
    elif isinstance(s, Qwen35Spec):
        rec = tuple(t == LINEAR for t in s.layer_types)
        fields = (StateField("conv", (s.conv_kernel - 1, s.conv_channels), dtype),
                  StateField("recurrent", (s.linear_num_value_heads, s.linear_key_head_dim, s.linear_value_head_dim),
                             "float32"))
    else:
        raise InvalidArgumentError(f"{type(model).__name__} is not a hybrid model (Lfm2, Granite, Qwen35ForCausalLM) "
                                   "or its spec")
    if all(rec) or not any(rec):
        raise InvalidArgumentError(f"{s.name}: a served hybrid model needs both recurrent and attention layers, "
                                   f"got {list(s.layer_types)}")
    return HybridLayout(rec, fields, s.num_kv_heads, s.head_dim, dtype)


def hybrid_cache_config(model: Any, *, tokens_per_block: int, max_seq_len: int, primary_blocks: int, state_blocks: int,
                        secondary_blocks: int = 0, secondary_state_blocks: int = 0, **kwargs: Any) -> CacheConfig:
    """The `CacheConfig` of a hybrid model (or its spec): its attention layers in one full-attention window of
    `primary_blocks` KV blocks (`secondary_blocks` on the host), its recurrent layers in the
    `RECURRENT_STATES` window of `state_blocks` state blocks (`secondary_state_blocks`); other
    `CacheConfig` fields (`snapshot_interval`, `enable_block_reuse`, ...) as keywords."""
    lay = hybrid_layout(model)
    w = max_seq_len
    return CacheConfig(tokens_per_block=tokens_per_block, num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                       head_dim=lay.head_dim, max_seq_len=max_seq_len, attention_windows=lay.attention_windows(w),
                       primary_blocks={w: primary_blocks, RECURRENT_STATES: state_blocks},
                       secondary_blocks={w: secondary_blocks, RECURRENT_STATES: secondary_state_blocks},
                       recurrent_state_bytes=lay.state_bytes, **{"dtype": lay.dtype, **kwargs})


def check_hybrid_cache(model: Any, config: CacheConfig) -> None:
    """Raise `InvalidArgumentError` unless `config` describes `model`: recurrent layers in the
    `RECURRENT_STATES` window with this model's state size, attention layers in one
    full-attention window with its KV heads and head dim."""
    lay = hybrid_layout(model)
    if not isinstance(config, CacheConfig):
        raise InvalidArgumentError(f"a hybrid model's cache is a CacheConfig, got {type(config).__name__}")
    want = lay.attention_windows(config.max_seq_len)
    if config.layer_windows != want:
        raise InvalidArgumentError(f"cache layer windows {config.layer_windows} != the model's {want} "
                                   f"({RECURRENT_STATES}: recurrent layers; use hybrid_cache_config)")
    if config.recurrent_state_bytes != lay.state_bytes:
        raise InvalidArgumentError(f"cache recurrent_state_bytes={config.recurrent_state_bytes} != the model's "
                                   f"{lay.state_bytes} per recurrent layer")
    for layer, rec in enumerate(lay.recurrent):
        if not rec and (config.kv_heads_per_layer[layer], config.head_dim_per_layer[layer]) != (lay.num_kv_heads,
                                                                                                   lay.head_dim):
            raise InvalidArgumentError(f"cache layer {layer}: kv heads / head dim {config.kv_heads_per_layer[layer]}, "
                                       f"{config.head_dim_per_layer[layer]} != the model's {lay.num_kv_heads}, {lay.head_dim}")
    if config.kv_factor != 2:
        raise InvalidArgumentError(f"the model stores K and V; cache_type={config.cache_type!r} is not supported")


def attention_window(config: CacheConfig) -> int:
    """The one attention window of a hybrid cache."""
    (w,) = [w for w in config.windows if w != RECURRENT_STATES]
    return w


def kv_cache_view(config: CacheConfig) -> CacheConfig:
    """The attention layers of a hybrid `config` alone: what its KV pools are allocated from
    (layer j: the j-th attention layer; the same blocks, slots and null slot)."""
    w = attention_window(config)
    layers = config.window_to_layers[w]
    return CacheConfig(tokens_per_block=config.tokens_per_block, num_layers=len(layers),
                       num_kv_heads=tuple(config.kv_heads_per_layer[i] for i in layers),
                       head_dim=tuple(config.head_dim_per_layer[i] for i in layers), max_seq_len=config.max_seq_len,
                       primary_blocks=config.primary_blocks_for(w), secondary_blocks=config.secondary_blocks_for(w),
                       dtype=config.dtype, layout=config.layout, cache_type=config.cache_type)


def state_geometry(config: CacheConfig, layout: HybridLayout) -> StateGeometry:
    """The state pools of a hybrid `config`: its recurrent pool's slots, host slots and plan index."""
    (pool,) = [p for p in config.pools if p.window == RECURRENT_STATES]
    return StateGeometry.for_pool(pool, layout.fields, tokens_per_block=config.tokens_per_block)


def kv_plan(plan: TransferPlan, state_pool: int) -> TransferPlan:
    """The KV entries of a ledger plan (after `split_state_plan` took the state pool's)
    renumbered for `kv_cache_view`'s pools: the ledger's pools in order without the recurrent
    one (`state_pool`), as the view's are (the same (window, heads, dim) order)."""
    if (plan.pool == state_pool).any():
        raise InvalidArgumentError("kv_plan: the plan still holds state-pool entries (split it with split_state_plan)")
    pool = plan.pool - (plan.pool > state_pool)
    return TransferPlan(plan.kind, pool, plan.src, plan.dst, plan.num_tokens, seq=plan.seq)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridPools:
    """A hybrid model's device cache: KV pools of the attention layers, state pools of the
    recurrent layers (a pytree; donated like `KVPools`)."""

    kv: Any  # KVPools of kv_cache_view(config)
    states: StatePools


@dataclasses.dataclass(frozen=True)
class HybridGroup:
    """Rows of one shape in the flat batch (`RowGroup` plus the recurrent slots): `rows` rows of
    `q_len` tokens, the attention window's `block_table` int32 [rows, M] and `seq_lens` [rows],
    per row the state slot it reads (`read_slots`, the null slot: zeros) and writes
    (`write_slots`, -1: nothing) and its real token count `lens` (0: a padding row)."""

    rows: int
    q_len: int
    block_table: jax.Array
    seq_lens: jax.Array
    read_slots: jax.Array
    write_slots: jax.Array
    lens: jax.Array


def to_right_padding(x: Float[Array, "R T ..."], lens: Int[Array, " R"]) -> Float[Array, "R T ..."]:
    """Left-padded rows (real tokens last) -> right-padded (real tokens first)."""
    t = x.shape[1]
    idx = (jnp.arange(t)[None, :] + (t - lens)[:, None]) % t  # [R, T]
    return jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 2))), axis=1)


def to_left_padding(x: Float[Array, "R T ..."], lens: Int[Array, " R"]) -> Float[Array, "R T ..."]:
    t = x.shape[1]
    idx = (jnp.arange(t)[None, :] - (t - lens)[:, None]) % t  # [R, T]
    return jnp.take_along_axis(x, idx.reshape(*idx.shape, *([1] * (x.ndim - 2))), axis=1)


def _mixer(layer: Any, h: Float[Array, "R T D"], state: dict[str, jax.Array], lens: Int[Array, " R"]
           ) -> tuple[Float[Array, "R T D"], dict[str, jax.Array]]:
    """A recurrent layer's mixer on right-padded rows from its pool state (by field)."""
    if getattr(layer, "conv", None) is not None and hasattr(layer, "ffn_norm"):  # LFM2 short conv
        out, conv = layer.conv(h, state["conv"], lens)
        return out, {"conv": conv}
    if getattr(layer, "mamba", None) is not None:  # Granite Mamba2
        out, new = layer.mamba(h, MambaState(conv=state["conv"], ssm=state["ssm"]), lens)
        return out, {"conv": new.conv, "ssm": new.ssm}
    chunk = None if h.shape[1] == 1 else DEFAULT_CHUNK  # Qwen3.5 gated DeltaNet
    out, new = layer.linear_attn(h, DeltaNetState(state["conv"], state["recurrent"]), chunk, lens)
    return out, {"conv": new.conv, "recurrent": new.recurrent}


def _parts(layer: Any) -> tuple[Any, Any, Any]:
    """(input norm, attention module or None, `finish(x, out)`) of a layer of any family."""
    if hasattr(layer, "operator_norm"):  # LFM2
        return layer.operator_norm, layer.attn, lambda x, out: _residual(layer.mlp, layer.ffn_norm, x, out, None)
    if hasattr(layer, "input_norm"):  # Granite: residual multiplier on both branches
        return layer.input_norm, layer.attn, lambda x, out: _residual(layer.mlp, layer.post_norm, x, out, layer.residual)
    return layer.mixer_norm, layer.self_attn, lambda x, out: _residual(layer.mlp, layer.mlp_norm, x, out, None)  # Qwen3.5


def _residual(mlp: Any, norm: Any, x: jax.Array, out: jax.Array, scale: float | None) -> jax.Array:
    """`x + out`, then `+ mlp(norm(.))`, both branches scaled by `scale` (Granite's residual multiplier)."""
    if scale is None:
        x = x + out
        return x + mlp(norm(x))
    r = jnp.asarray(scale, x.dtype)
    x = x + out * r
    return x + mlp(norm(x)) * r


def paged_hidden(
    model: Any,
    tokens: Int[Array, " N"],
    positions: Int[Array, " N"],
    pools: HybridPools,
    groups: Sequence[HybridGroup],
    slot_mapping: Int[Array, " N"],
    *,
    impl: str = "auto",
) -> tuple[Float[Array, "N D"], HybridPools]:
    """Several row groups of a hybrid model through the paged KV pools and the state pools in
    one pass over the weights (the module docstring). tokens, positions, slot_mapping (the
    attention window's `slot * tokens_per_block + offset`, -1: padding): int32 [N], group after
    group, rows row-major. Returns (final hidden states [N, D] before the final norm, pools);
    `model.logits` turns the chosen ones into logits."""
    from kvjax.device import paged_attention, write_kv

    (n,) = tokens.shape
    if sum(g.rows * g.q_len for g in groups) != n or positions.shape != (n,):
        raise InvalidArgumentError(f"groups {[(g.rows, g.q_len) for g in groups]} do not cover the {n} tokens")
    kv, states = pools.kv, pools.states
    x = model.embed_tokens(tokens[None])  # [1, N, D]
    pos = positions[None]  # [1, N]
    a_idx = r_idx = 0
    for layer in model.layers:
        norm, attn, finish = _parts(layer)
        h = norm(x)  # [1, N, D]
        parts, start = [], 0
        if attn is not None:
            q, k, v = attn.project(h, pos)  # [1, N, Nh, H], [1, N, K, H] x2
            kv = write_kv(kv, a_idx, k[0], v[0], slot_mapping, impl=impl)
            for g in groups:  # attention per group: its own [rows, q_len] shape
                size = g.rows * g.q_len
                qg = q[0, start:start + size].reshape(g.rows, g.q_len, *q.shape[2:])  # [rows, q_len, Nh, H]
                out = paged_attention(qg, kv, a_idx, g.block_table, g.seq_lens, scale=attn.scale, impl=impl)
                parts.append(out.reshape(size, *q.shape[2:]))  # [size, Nh, H]
                start += size
            attended = jnp.concatenate(parts, axis=0)[None]  # [1, N, Nh, H]
            mixed = attn.output(attended) if not isinstance(model, Qwen35ForCausalLM) else attn.output(h, attended)
            a_idx += 1
        else:
            for g in groups:  # the recurrence per group: row states from the pool, right-padded rows
                size = g.rows * g.q_len
                hg = to_right_padding(h[0, start:start + size].reshape(g.rows, g.q_len, -1), g.lens)  # [rows, q_len, D]
                state = read_states(states, r_idx, g.read_slots)  # {field: [rows, ...]}
                out, new = _mixer(layer, hg, state, g.lens)  # [rows, q_len, D]
                states = write_states(states, r_idx, g.write_slots, new)
                parts.append(to_left_padding(out, g.lens).reshape(size, -1))  # [size, D]
                start += size
            mixed = jnp.concatenate(parts, axis=0)[None]  # [1, N, D]
            r_idx += 1
        x = finish(x, mixed)  # [1, N, D]
    return x[0], HybridPools(kv, states)
