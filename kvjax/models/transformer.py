"""The decoder: a stack of pre-norm blocks sized by a `ModelSpec`, with two forwards.

- `dense_forward(tokens)`: no cache, full recompute over the whole sequence; the oracle.
- `paged_forward(...)`: reads and writes the paged KV cache through `kvjax.device`
  (`write_kv` then `paged_attention`, per layer), for prefill chunks and decode steps alike.

Layers run under `jax.lax.scan`, so a program compiles one group of layers whatever the depth:
the weights of layers `r, r + P, r + 2P, ...` are stacked along a leading axis (one stacked
`Block` per position `r` of the model's layer period `P`, `layer_period`: 1 for Llama-like
models, the local/global pattern length for Gemma 3), the scan runs over the `L // P` whole
groups (the `P` layers of a group unrolled inside its body, each with its static window, RoPE
base and KV pool) and the `L % P` remaining layers run unrolled after it. The paged path carries
the pools through the scan and indexes them by the traced layer number. `unroll=True` runs
every layer in a Python loop over the same stacked weights: the oracle of the scanned path.

Paged conventions (the engine's contract): a batch row holds the LAST `q_len` tokens of a
sequence of `seq_lens[b]` tokens, so query `i` sits at position `seq_lens[b] - q_len + i`;
left-padded rows carry negative positions and slot `-1` (skipped by `write_kv`). Every layer
uses the block table and slot mapping of its own attention window
(`pools.geometry.layer_windows[layer]`). RoPE uses absolute token positions.
Letters: see `kvjax.models.layers`.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax.model_catalog import load_model_spec
from kvjax.model_spec import ModelSpec
from kvjax.models.attention import Attention, grouped_attention, visibility_mask
from kvjax.models.layers import MLP, RMSNorm, einsum, is_shapes_only, normal_init

_ModuleList = getattr(nnx, "List", list)


class Block(nnx.Module):
    """Pre-norm residual block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    With `spec.sandwich_norms` (Gemma 3) the attention and MLP outputs are normalised too before
    each residual add: `x + post_attn_norm(attn(attn_norm(x)))`, `x + post_mlp_norm(mlp(mlp_norm(x)))`.
    """

    def __init__(self, spec: ModelSpec, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.window = spec.layer_windows[layer]
        local = spec.uses_local_rope(layer)
        theta = spec.rope_local_theta if local else spec.rope_theta
        assert theta is not None  # a layer is local only when the model sets rope_local_theta
        d = spec.hidden_size
        norm = functools.partial(RMSNorm, eps=spec.norm_eps, dtype=dtype, offset=spec.norm_weight_offset)
        self.attn_norm = norm(d)
        self.attn = Attention(
            d,
            spec.num_attention_heads,
            spec.kv_heads_per_layer[layer],
            spec.head_dim,
            rope_theta=theta,
            rope_scaling=None if local else spec.rope_scaling,
            scale=spec.attention_scale,
            qkv_bias=spec.qkv_bias,
            out_bias=spec.out_bias,
            qk_norm=spec.qk_norm,
            norm_eps=spec.norm_eps,
            norm_offset=spec.norm_weight_offset,
            dtype=dtype,
            rngs=rngs,
        )
        self.post_attn_norm = norm(d) if spec.sandwich_norms else None
        self.mlp_norm = norm(d)
        self.mlp = MLP(d, spec.intermediate_size, dtype=dtype, rngs=rngs, activation=spec.mlp_activation)
        self.post_mlp_norm = norm(d) if spec.sandwich_norms else None

    def add_attention(self, x: jax.Array, attended: jax.Array) -> jax.Array:
        """The residual add after attention. x: [B, T, D], attended: [B, T, N, H] -> [B, T, D]."""
        out = self.attn.out(attended)  # [B, T, D]
        if self.post_attn_norm is not None:
            out = self.post_attn_norm(out)
        return x + out

    def feed_forward(self, x: jax.Array) -> jax.Array:
        """`x + mlp(norm(x))` (with the post-MLP norm when sandwiched). x: [B, T, D] -> [B, T, D]."""
        out = self.mlp(self.mlp_norm(x))  # [B, T, D]
        if self.post_mlp_norm is not None:
            out = self.post_mlp_norm(out)
        return x + out

    def dense(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        attn = self.attn
        q, k, v = attn.qkv(self.attn_norm(x), positions)  # [B, S, N, H], [B, S, K, H] x2
        mask = visibility_mask(positions, positions, self.window)  # [B, S, S]
        x = self.add_attention(x, grouped_attention(q, k, v, mask, attn.scale))  # [B, S, D]
        return self.feed_forward(x)  # [B, S, D]


class Transformer(nnx.Module):
    """Decoder-only transformer (RMSNorm, RoPE, GQA, gated MLP) shaped and styled by a `ModelSpec`.

    `from_spec` draws random weights from a seed (the demo models); `kvjax.models.from_pretrained`
    fills the same structure from a Hugging Face checkpoint. Input embeddings are scaled by
    `sqrt(D)` when `spec.embedding_scale` says so (Gemma, the demo models; the factor is rounded
    to the model dtype first, as transformers does); the output head is the embedding matrix
    when `spec.tie_embeddings`.
    """

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs, dtype: Any = None):
        self.spec = spec
        self.dtype = jnp.dtype(spec.dtype if dtype is None else dtype)
        d, vocab = spec.hidden_size, spec.vocab_size
        self.embed = nnx.Param(normal_init(rngs.params(), (vocab, d), d, self.dtype))  # [V, D]
        period = layer_period(spec)
        # stacks[r]: layers r, r + P, ... as one Block whose parameters carry a leading layer axis
        if is_shapes_only():  # shapes for a checkpoint to fill: one block per position, its shapes repeated
            counts = [len(range(r, spec.num_layers, period)) for r in range(period)]
            self.stacks = _ModuleList([_repeat(Block(spec, r, dtype=self.dtype, rngs=rngs), counts[r])
                                       for r in range(period)])
        else:
            blocks = [Block(spec, i, dtype=self.dtype, rngs=rngs) for i in range(spec.num_layers)]
            self.stacks = _ModuleList([_stack(blocks[r::period]) for r in range(period)])
            del blocks
        self.final_norm = RMSNorm(d, eps=spec.norm_eps, dtype=self.dtype, offset=spec.norm_weight_offset)
        self.lm_head = None if spec.tie_embeddings else nnx.Param(normal_init(rngs.params(), (d, vocab), d, self.dtype))

    @classmethod
    def from_spec(cls, spec: ModelSpec | str, *, seed: int = 0, dtype: Any = None) -> Transformer:
        """Build from a spec (or a model name / TOML path) with random weights; same seed, same weights."""
        if not isinstance(spec, ModelSpec):
            spec = load_model_spec(spec)
        return cls(spec, rngs=nnx.Rngs(params=seed), dtype=dtype)

    # ------------------------------------------------------------------ layers
    @property
    def period(self) -> int:
        """Layers per scanned group (`layer_period(spec)`)."""
        return len(self.stacks)

    def block(self, layer: int) -> Block:
        """Layer `layer` as a standalone `Block` holding copies of its slice of the stacked weights
        (placed like the stack, without its layer axis): for inspection, not for the forwards."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.num_layers:
            raise ValueError(f"layer={layer!r} must be an int in [0, {self.spec.num_layers})")
        graphdef, state = nnx.split(self.stacks[layer % self.period])
        return nnx.merge(graphdef, jax.tree.map(lambda a: _layer_slice(a, layer // self.period), state))

    @property
    def blocks(self) -> tuple[Block, ...]:
        """Every layer's `Block` (`block(i)`: copies of the stacked weights)."""
        return tuple(self.block(i) for i in range(self.spec.num_layers))

    def _run_layers(self, x: jax.Array, carry: Any, step: Callable[..., tuple[jax.Array, Any]],
                    unroll: bool) -> tuple[jax.Array, Any]:
        """Fold `step(block, layer, r, x, carry) -> (x, carry)` over every layer in order.

        `layer` is the global layer number (a traced int32 under the scan, a Python int otherwise)
        and `r = layer % period` its static position in the group: per-layer static facts (window,
        KV pool) must be looked up by `r`, which `layer_period` makes equivalent.
        """
        period, num_layers = self.period, self.spec.num_layers
        groups = num_layers // period
        parts = [nnx.split(stack) for stack in self.stacks]

        def run(x, carry, g, r):
            graphdef, state = parts[r]
            block = nnx.merge(graphdef, jax.tree.map(lambda a: a[g], state))  # this layer's weights
            return step(block, g * period + r, r, x, carry)

        if unroll:
            for layer in range(num_layers):
                x, carry = run(x, carry, layer // period, layer % period)
            return x, carry

        def body(state, g):
            x, carry = state
            for r in range(period):
                x, carry = run(x, carry, g, r)
            return (x, carry), None

        (x, carry), _ = jax.lax.scan(body, (x, carry), jnp.arange(groups, dtype=jnp.int32))  # groups >= 1
        for layer in range(groups * period, num_layers):  # the tail shorter than a period
            x, carry = run(x, carry, layer // period, layer % period)
        return x, carry

    # ------------------------------------------------------------------ shared pieces
    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embed[...], tokens, axis=0)  # [B, T, D]
        if self.spec.embedding_scale == "sqrt_hidden_size":
            x = x * jnp.asarray(self.spec.hidden_size**0.5, self.dtype)  # [B, T, D]
        return x

    def _logits(self, x: jax.Array) -> jax.Array:
        """x: [B, T, D] -> float32 [B, T, V]. Under tensor parallelism the head may hold more
        columns than the vocabulary (padded to a multiple of the devices,
        `kvjax.models.parallel`): those are cut off here, so nothing downstream sees them."""
        x = self.final_norm(x)  # [B, T, D]
        if self.lm_head is None:
            logits = einsum("btd,vd->btv", x, self.embed[...])  # [B, T, Vp]
        else:
            logits = einsum("btd,dv->btv", x, self.lm_head[...])  # [B, T, Vp]
        if logits.shape[-1] != self.spec.vocab_size:  # padded vocabulary rows: never a token
            logits = logits[..., : self.spec.vocab_size]  # [B, T, V]
        return logits.astype(jnp.float32)

    # ------------------------------------------------------------------ dense oracle
    def dense_forward(self, tokens: jax.Array, positions: jax.Array | None = None, *, unroll: bool = False) -> jax.Array:
        """Logits of every position with no cache. tokens: int [B, S] -> float32 [B, S, V].

        `positions` (int [B, S]) defaults to `0..S-1` in every row; `unroll` loops over the
        layers in Python instead of scanning (the oracle).
        """
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))  # [B, S]
        x = self._embed(tokens)  # [B, S, D]

        def step(block, layer, r, x, carry):
            return block.dense(x, positions), carry  # [B, S, D]

        x, _ = self._run_layers(x, None, step, unroll)
        return self._logits(x)  # [B, S, V]

    # ------------------------------------------------------------------ paged path
    def check_cache(self, config: Any) -> None:
        """Raise ValueError unless `config` (a CacheConfig, or the pools' `PoolGeometry`)
        describes this model's KV geometry."""
        spec = self.spec
        if config.num_layers != spec.num_layers:
            raise ValueError(f"cache has {config.num_layers=} but the model {spec.num_layers} layers")
        if config.kv_heads_per_layer != spec.kv_heads_per_layer:
            raise ValueError(f"cache kv heads {config.kv_heads_per_layer} != model {spec.kv_heads_per_layer}")
        if set(config.head_dim_per_layer) != {spec.head_dim}:
            raise ValueError(f"cache head dims {config.head_dim_per_layer} != model head_dim {spec.head_dim}")
        if config.kv_factor != 2:
            raise ValueError(f"the model stores K and V; cache_type={config.cache_type!r} is not supported")
        expected = tuple(min(w, config.max_seq_len) for w in spec.layer_windows)
        if config.layer_windows != expected:
            raise ValueError(f"cache layer windows {config.layer_windows} != model windows {expected}")

    def paged_forward(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        pools: Any,
        block_tables: Mapping[int, jax.Array] | jax.Array,
        seq_lens: jax.Array,
        slot_mapping: Mapping[int, jax.Array] | jax.Array,
        *,
        impl: str = "auto",
        unroll: bool = False,
    ) -> tuple[jax.Array, Any]:
        """One prefill chunk or decode step through the paged cache.

        tokens, positions: int32 [B, T]; pools: `kvjax.device.KVPools`; block_tables: window ->
        int32 [B, max_blocks] of slots (or one array for a single-window cache); seq_lens:
        int32 [B] (tokens of each sequence including this chunk); slot_mapping: window -> int32
        [B * T] (`slot * tokens_per_block + offset`, -1 for padding) or one array; `impl`
        picks the device ops' implementation ("auto" | "xla" | "pallas"); `unroll` loops over
        the layers in Python instead of scanning (the oracle).
        Returns (float32 logits [B, T, V], updated pools): `paged_hidden` with one row group,
        then the LM head on every position.
        """
        b, t = tokens.shape
        group = RowGroup(b, t, block_tables, seq_lens)
        hidden, pools = self.paged_hidden(tokens.reshape(b * t), positions.reshape(b * t), pools, (group,),
                                          slot_mapping, impl=impl, unroll=unroll)  # [B * T, D]
        return self.logits(hidden).reshape(b, t, -1), pools  # [B, T, V]

    def paged_hidden(
        self,
        tokens: Int[Array, " N"],
        positions: Int[Array, " N"],
        pools: Any,
        groups: Sequence[RowGroup],
        slot_mapping: Mapping[int, jax.Array] | jax.Array,
        *,
        impl: str = "auto",
        unroll: bool = False,
    ) -> tuple[Float[Array, "N D"], Any]:
        """Several row groups through the paged cache in one pass over the weights (the
        engine's one forward per step: a decode group `[Bd, 1]` and a prefill group `[Bp, T]`).

        The tokens of every group are one flat batch, group after group, each group's rows
        row-major (`N = sum(rows * q_len)`): embedding, projections, norms, MLP and the K/V
        write run on all `N` tokens at once, and only attention runs per group (its rows hold
        the LAST `q_len` positions of their sequences, `paged_attention`'s convention).
        tokens, positions: int32 [N]; slot_mapping: window -> int32 [N] (or one array).
        Returns (final hidden states [N, D] before the final norm, updated pools): `logits`
        turns the positions one needs into logits.
        """
        from kvjax.device import paged_attention, write_kv

        config = pools.geometry
        self.check_cache(config)
        (n,) = tokens.shape
        if sum(g.rows * g.q_len for g in groups) != n or positions.shape != (n,):
            raise ValueError(f"groups {[(g.rows, g.q_len) for g in groups]} do not cover the {n} tokens "
                             f"(positions {tuple(positions.shape)})")
        period = self.period
        pool_of = [config.layer_to_pool[layer][0] for layer in range(config.num_layers)]
        for layer in range(period, config.num_layers):  # the scan gives layer r's window and pool to r + kP
            if (config.layer_windows[layer], pool_of[layer]) != (config.layer_windows[layer % period], pool_of[layer % period]):
                raise ValueError(f"cache layer {layer} sits in pool {pool_of[layer]} (window {config.layer_windows[layer]}), "
                                 f"unlike layer {layer % period}: the model's layers repeat every {period}")
        x = self._embed(tokens[None])  # [1, N, D]
        pos = positions[None]  # [1, N]

        def step(block, layer, r, x, pools):
            window = config.layer_windows[r]
            slots = slot_mapping[window] if isinstance(slot_mapping, Mapping) else slot_mapping  # [N]
            attn = block.attn
            q, k, v = attn.qkv(block.attn_norm(x), pos)  # [1, N, Nh, H], [1, N, K, H] x2
            pools = write_kv(pools, layer, k[0], v[0], slots, impl=impl, pool=pool_of[r])
            parts, start = [], 0
            for g in groups:  # attention per group: its own [rows, q_len] shape, tables and lengths
                size = g.rows * g.q_len
                qg = q[0, start : start + size].reshape(g.rows, g.q_len, *q.shape[2:])  # [rows, q_len, Nh, H]
                table = g.block_tables[window] if isinstance(g.block_tables, Mapping) else g.block_tables  # [rows, M]
                out = paged_attention(qg, pools, layer, table, g.seq_lens, scale=attn.scale, impl=impl, pool=pool_of[r])
                parts.append(out.reshape(size, *q.shape[2:]))  # [size, Nh, H]
                start += size
            attended = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)  # [N, Nh, H]
            x = block.add_attention(x, attended[None])  # [1, N, D]
            return block.feed_forward(x), pools  # [1, N, D]

        x, pools = self._run_layers(x, pools, step, unroll)
        return x[0], pools  # [N, D]

    def logits(self, hidden: Float[Array, "R D"]) -> Float[Array, "R V"]:
        """The final norm and LM head of the chosen positions' hidden states (from
        `paged_hidden`): float32 [R, V]. The engine passes only the positions it samples."""
        return self._logits(hidden[None])[0]  # [R, V]


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """Rows of one attention shape inside `Transformer.paged_hidden`'s flat token batch:
    `rows` rows of `q_len` tokens each (the last `q_len` positions of each sequence), with
    their block tables (window -> int32 [rows, max_blocks], or one array) and `seq_lens`
    (int32 [rows])."""

    rows: int
    q_len: int
    block_tables: Mapping[int, jax.Array] | jax.Array
    seq_lens: jax.Array


# ---------------------------------------------------------------------- layer stacks
def layer_period(spec: ModelSpec) -> int:
    """The smallest `P` such that layer `i + P` has layer `i`'s window, KV heads and RoPE kind for
    every `i`: the length of the group the forwards scan over (1 when all layers are alike;
    Gemma 3's local/global pattern length; at most `num_layers`)."""
    kinds = [(spec.layer_windows[i], spec.kv_heads_per_layer[i], spec.uses_local_rope(i)) for i in range(spec.num_layers)]
    return next(p for p in range(1, len(kinds) + 1) if all(kinds[i] == kinds[i + p] for i in range(len(kinds) - p)))


def _stack(blocks: list[Block]) -> Block:
    """One `Block` whose parameters are the given blocks' stacked along a new leading axis."""
    graphdef, first = nnx.split(blocks[0])
    states = [first] + [nnx.split(block)[1] for block in blocks[1:]]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def _repeat(block: Block, count: int) -> Block:
    """`block` with every parameter given a leading axis of `count` (zeros: under `shapes_only`,
    where only the shapes matter)."""
    graphdef, state = nnx.split(block)
    return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.zeros((count, *a.shape), a.dtype), state))


def _layer_slice(a: Any, index: int) -> Any:
    """`a[index]` of a stacked parameter, keeping its placement (a mesh sharding loses the layer axis)."""
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and (len(sharding.spec) == 0 or sharding.spec[0] is None):
        spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
        out = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
        return jax.jit(lambda x: x[index], out_shardings=out)(a)
    return a[index]


# ---------------------------------------------------------------------- jitted entry points
def jit_dense_forward(model: Transformer, *, unroll: bool = False) -> Callable[..., jax.Array]:
    """`fwd(tokens [B, S], positions=None) -> logits [B, S, V]`, compiled once per shape."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, positions):
        return nnx.merge(graphdef, state).dense_forward(tokens, positions, unroll=unroll)

    def fwd(tokens, positions=None):
        return run(state, tokens, positions)

    return fwd


def jit_paged_forward(model: Transformer, *, impl: str = "auto", unroll: bool = False) -> Callable[..., tuple[jax.Array, Any]]:
    """`Transformer.paged_forward` jitted with the pools donated: always rebind the returned pools.

    Call as `logits, pools = fwd(tokens, positions, pools, block_tables, seq_lens, slot_mapping)`;
    it compiles once per (bucketed) shape.
    """
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def run(state, tokens, positions, pools, block_tables, seq_lens, slot_mapping):
        model = nnx.merge(graphdef, state)
        return model.paged_forward(tokens, positions, pools, block_tables, seq_lens, slot_mapping, impl=impl,
                                   unroll=unroll)

    def fwd(tokens, positions, pools, block_tables, seq_lens, slot_mapping):
        return run(state, tokens, positions, pools, block_tables, seq_lens, slot_mapping)

    return fwd
