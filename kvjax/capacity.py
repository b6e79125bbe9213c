"""Sizing maths of a paged KV cache: TensorRT-LLM's helpers, with its argument order.

Pure Python (no JAX): the CLI, the scheduler and the engine's sizing use it on the host. It sits
above the config types (`CacheConfig`, `ModelSpec`), which never import it back.
Notation: `tpb` = tokens per block, `ceil_div(a, b) = (a + b - 1) // b`, `SWA_EXTRA_BLOCK = 1`
(TensorRT-LLM's `kSWAExtraBlock`: a sliding-window sequence that outgrew its window holds one
block more than the window covers, because the front block is released only once it is fully
out of the window).

Formulas follow TensorRT-LLM's `BaseKVCacheManager` (C++): `calculateMaxBlockRequirementsPerBeam`,
`calculateMaxBlockRequirements`, `calculateMaxAttentionWindow`, `getMaxCapacityBatchSize`,
`calculateWindowSizeToShare` and the VSWA path of `calculateMaxNumBlocks`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from kvjax._math import ceil_div
from kvjax.config import RECURRENT_STATES, CacheConfig

if TYPE_CHECKING:  # pragma: no cover
    from kvjax.model_spec import ModelSpec

SWA_EXTRA_BLOCK = 1
DEFAULT_TOKENS_PER_BLOCK = 32  # TensorRT-LLM LLM API `KvCacheConfig.tokens_per_block`

__all__ = [
    "SWA_EXTRA_BLOCK",
    "DEFAULT_TOKENS_PER_BLOCK",
    "ceil_div",
    "sink_bubble_length",
    "cache_size_per_token",
    "kv_scale_bytes_per_token",
    "window_size_shares",
    "calculate_max_num_blocks",
    "hybrid_pool_split",
    "max_block_requirements_per_beam",
    "max_block_requirements",
    "max_attention_window",
    "max_batch_size",
    "cache_config_from_memory",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "DEFAULT_ACTIVATION_TOKENS",
    "weight_bytes",
    "activation_reserve_bytes",
    "kv_cache_budget",
    "DEFAULT_HOST_KV_CACHE_BYTES",
    "serving_kv_cache_bytes",
    "check_max_seq_len_fits",
]


# --------------------------------------------------------------------------- validation
def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _bytes(name: str, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of bytes >= 0, got {value!r}")
    return value


def sink_bubble_length(sink_token_length: int, tokens_per_block: int) -> int:
    """Padding after the sink tokens so that the first non-sink token starts a block."""
    r = sink_token_length % tokens_per_block
    return 0 if r == 0 else tokens_per_block - r


# --------------------------------------------------------------------------- bytes per token
def _as_config(model: Any, **overrides: Any) -> CacheConfig:
    """A `CacheConfig` with the geometry of `model` (a CacheConfig or a ModelSpec)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(model, CacheConfig):
        if not overrides:
            return model
        for key, fallback in (("primary_blocks", 1), ("secondary_blocks", 0)):
            # per-window counts may not fit the new windows; callers that care pass their own
            if isinstance(getattr(model, key), Mapping) and key not in overrides:
                overrides[key] = fallback
        return dataclasses.replace(model, **overrides)
    if hasattr(model, "cache_config"):
        return model.cache_config(**overrides)
    raise ValueError(f"expected a CacheConfig or a ModelSpec, got {type(model).__name__}")


def _exact(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def cache_size_per_token(
    model: CacheConfig | ModelSpec,
    *,
    dtype: str | None = None,
    max_seq_len: int | None = None,
    cache_type: str | None = None,
) -> dict[int, int | float]:
    """Window -> bytes of KV one token occupies over that window's layers.

    `kv_factor * sum over the window's layers of kv_heads * head_dim * dtype_bytes` (TensorRT-LLM
    `cacheSizeBytesPerToken`). Windows are the per-layer cycle clamped to `max_seq_len`, so a model
    whose sliding window exceeds `max_seq_len` has a single window. `dtype`, `max_seq_len`,
    `cache_type` override the model's values (e.g. an fp8 cache). FP8 caches also count their
    block scales (`kv_scale_bytes_per_token`), which TensorRT-LLM's per-tensor scales do not have.
    """
    config = _as_config(model, dtype=dtype, max_seq_len=max_seq_len, cache_type=cache_type)
    return {w: _exact(b) for w, b in config.cache_size_per_token.items()}


def kv_scale_bytes_per_token(
    model: CacheConfig | ModelSpec,
    *,
    dtype: str | None = None,
    tokens_per_block: int | None = None,
    max_seq_len: int | None = None,
    cache_type: str | None = None,
) -> dict[int, int | float]:
    """Window -> bytes of FP8 block scales per token (already inside `cache_size_per_token`).

    An FP8 pool keeps one float32 scale per (block, layer, K/V field, kv head), so a token
    costs `kv_factor * kv_heads * 4 / tokens_per_block` bytes per layer on top of its KV
    bytes; 0 for 16- and 32-bit caches.
    """
    config = _as_config(model, dtype=dtype, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                        cache_type=cache_type)
    return {w: _exact(b) for w, b in config.kv_scale_bytes_per_token.items()}


# --------------------------------------------------------------------------- window shares
def _check_windows(window_to_layers: Mapping[int, Sequence[int]], cache_size_per_token: Mapping[int, float]) -> None:
    if not window_to_layers:
        raise ValueError("window_to_layers must not be empty")
    for w, layers in window_to_layers.items():
        _int("window", w, 1)
        if len(layers) == 0:
            raise ValueError(f"window {w} has no layers")
    if set(window_to_layers) != set(cache_size_per_token):
        raise ValueError(
            f"window_to_layers windows {sorted(window_to_layers)} != cache_size_per_token windows "
            f"{sorted(cache_size_per_token)}"
        )
    for w, b in cache_size_per_token.items():
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0:
            raise ValueError(f"cache_size_per_token[{w}] must be > 0 bytes, got {b!r}")


def _exact_shares(
    window_to_layers: Mapping[int, Sequence[int]], cache_size_per_token: Mapping[int, float]
) -> dict[int, Fraction]:
    _check_windows(window_to_layers, cache_size_per_token)
    weight = {w: w * Fraction(cache_size_per_token[w]) for w in sorted(window_to_layers)}
    total = sum(weight.values())
    return {w: c / total for w, c in weight.items()}


def window_size_shares(
    window_to_layers: Mapping[int, Sequence[int]], cache_size_per_token: Mapping[int, float]
) -> dict[int, float]:
    """Window -> fraction of the memory budget, proportional to `window * cache_size_per_token[window]`.

    TensorRT-LLM's `calculateWindowSizeToShare`: a window that attends over more tokens, or
    whose layers hold more bytes per token, gets a proportionally larger pool. Sums to 1.
    """
    return {w: float(s) for w, s in _exact_shares(window_to_layers, cache_size_per_token).items()}


def calculate_max_num_blocks(
    window_to_layers: Mapping[int, Sequence[int]],
    cache_size_per_token: Mapping[int, float],
    tokens_per_block: int,
    primary_bytes: int | float,
    secondary_bytes: int | float = 0,
    max_tokens: int | None = None,
) -> dict[int, tuple[int, int]]:
    """Window -> (primary blocks, secondary blocks) for the given byte budgets.

    TensorRT-LLM's VSWA `calculateMaxNumBlocks`, per window `w` with share `s_w` and `b_w` bytes/token:
    `primary = ceil_div(min(max_tokens, floor(primary_bytes * s_w / b_w)), tpb)` and
    `secondary = floor(secondary_bytes * s_w / b_w) // tpb`. `max_tokens` (TensorRT-LLM's
    `KvCacheConfig.max_tokens`) caps each window's primary tokens. The products are computed
    exactly (rationals), where TensorRT-LLM uses doubles; they agree except at rounding edges.
    """
    tpb = _int("tokens_per_block", tokens_per_block, 1)
    primary_bytes = _bytes("primary_bytes", primary_bytes)
    secondary_bytes = _bytes("secondary_bytes", secondary_bytes)
    if max_tokens is not None:
        _int("max_tokens", max_tokens, 0)
    shares = _exact_shares(window_to_layers, cache_size_per_token)
    out: dict[int, tuple[int, int]] = {}
    for w, share in shares.items():
        per_token = Fraction(cache_size_per_token[w])
        primary_tokens = math.floor(Fraction(primary_bytes) * share / per_token)
        if max_tokens is not None:
            primary_tokens = min(max_tokens, primary_tokens)
        secondary_tokens = math.floor(Fraction(secondary_bytes) * share / per_token)
        out[w] = (ceil_div(primary_tokens, tpb), secondary_tokens // tpb)
    return out


def hybrid_pool_split(
    budget_bytes: int | float,
    attention_bytes_per_token: int | float,
    state_block_bytes: int | float,
    snapshot_interval: int,
    max_batch_size: int,
    enable_block_reuse: bool = True,
) -> tuple[int, int]:
    """(tokens the attention windows get, recurrent-state blocks) of a hybrid model's budget.

    TensorRT-LLM's rule: a token costs its attention bytes plus a state block per
    `snapshot_interval` tokens (the snapshots), and the running requests' live states cost a
    fixed `max_batch_size` blocks more; the ledger's copy-forward steps hold a live and a
    write block per request, so that term is `2 * max_batch_size` here. With reuse off
    there are no snapshots and each request updates one block in place: the recurrent pool
    is `max_batch_size` static slots and the rest is attention.
    """
    budget = _bytes("budget_bytes", budget_bytes)
    attn = _bytes("attention_bytes_per_token", attention_bytes_per_token)
    state = _bytes("state_block_bytes", state_block_bytes)
    interval = _int("snapshot_interval", snapshot_interval, 1)
    batch = _int("max_batch_size", max_batch_size, 1)
    if not attn > 0 or not state > 0:
        raise ValueError("attention_bytes_per_token and state_block_bytes must be > 0")
    working = 2 if enable_block_reuse else 1
    fixed = Fraction(state) * working * batch
    if budget < fixed:
        raise ValueError(f"budget_bytes={budget} is less than the {working} state blocks of each of {batch} requests ({fixed})")
    if not enable_block_reuse:
        return math.floor((Fraction(budget) - fixed) / Fraction(attn)), batch
    tokens = math.floor((Fraction(budget) - fixed) / (Fraction(attn) + Fraction(state) / interval))
    return tokens, tokens // interval + working * batch


# --------------------------------------------------------------------------- block requirements
def max_block_requirements_per_beam(seq_len: int, sink_token_length: int, window: int, tokens_per_block: int) -> int:
    """Blocks one beam of a `seq_len`-token sequence holds at most in `window`'s manager.

    `ceil_div(min(seq_len, window) + sink_bubble, tpb) + (SWA_EXTRA_BLOCK if seq_len > window else 0)`.
    """
    _int("seq_len", seq_len, 0)
    sink = _int("sink_token_length", sink_token_length, 0)
    window = _int("window", window, 1)
    tpb = _int("tokens_per_block", tokens_per_block, 1)
    bubble = sink_bubble_length(sink, tpb)
    extra = SWA_EXTRA_BLOCK if seq_len > window else 0
    return ceil_div(min(seq_len, window) + bubble, tpb) + extra


def max_block_requirements(
    input_len: int, output_len: int, sink_token_length: int, window: int, beam_width: int, tokens_per_block: int
) -> int:
    """Blocks one request (all beams) holds at most: context blocks shared by the beams, generation blocks per beam.

    beam 1: `per_beam(in + out)`; `window <= out`: `per_beam(in + out) * beam` (the context has
    left the window by the end); otherwise `ctx = min(window, in + out) - out` context tokens in
    the window, `ctx_blocks = (ctx + bubble) // tpb` full shared blocks, `left = ctx - ctx_blocks * tpb`
    tokens in the last (per-beam) block: `ctx_blocks + (ceil_div(out + left, tpb) + SWA_EXTRA_BLOCK) * beam`.
    """
    _int("input_len", input_len, 0)
    _int("output_len", output_len, 0)
    sink = _int("sink_token_length", sink_token_length, 0)
    _int("window", window, 1)
    beam = _int("beam_width", beam_width, 1)
    tpb = _int("tokens_per_block", tokens_per_block, 1)
    total = input_len + output_len
    if beam == 1:
        return max_block_requirements_per_beam(total, sink, window, tpb)
    if window <= output_len:
        return max_block_requirements_per_beam(total, sink, window, tpb) * beam
    bubble = sink_bubble_length(sink, tpb)
    ctx_tokens = min(window, total) - output_len
    ctx_blocks = (ctx_tokens + bubble) // tpb
    left = ctx_tokens - ctx_blocks * tpb
    return ctx_blocks + (ceil_div(output_len + left, tpb) + SWA_EXTRA_BLOCK) * beam


def max_attention_window(
    input_len: int, output_len: int, sink_token_length: int, capacity_blocks: int, beam_width: int, tokens_per_block: int
) -> int:
    """Largest attention window one request can use when `capacity_blocks` blocks are available.

    `out_req = max_block_requirements(0, out, sink, out, beam, tpb)`; if it exceeds the capacity:
    `(capacity // beam) * tpb`; else `min(out + (capacity - out_req) * tpb, in + out)`.
    """
    _int("input_len", input_len, 0)
    _int("output_len", output_len, 0)
    sink = _int("sink_token_length", sink_token_length, 0)
    capacity = _int("capacity_blocks", capacity_blocks, 0)
    beam = _int("beam_width", beam_width, 1)
    tpb = _int("tokens_per_block", tokens_per_block, 1)
    if output_len > 0:
        out_req = max_block_requirements(0, output_len, sink, output_len, beam, tpb)
    else:  # TensorRT-LLM's window = output_len = 0: per_beam(0) = ceil_div(sink_bubble, tpb), per beam
        out_req = ceil_div(sink_bubble_length(sink, tpb), tpb) * beam
    if out_req > capacity:
        return (capacity // beam) * tpb
    return min(output_len + (capacity - out_req) * tpb, input_len + output_len)


def max_batch_size(config: CacheConfig, input_len: int, output_len: int, beam_width: int | None = None) -> int:
    """Most concurrent requests of this shape the primary pools hold (TensorRT-LLM `getMaxCapacityBatchSize`).

    Min over windows of `primary_blocks(window) // max_block_requirements(in, out, sink, window, beam, tpb)`.
    `beam_width` defaults to the config's `max_beam_width`.
    """
    if not isinstance(config, CacheConfig):
        raise ValueError(f"max_batch_size needs a CacheConfig, got {type(config).__name__}")
    beam = config.max_beam_width if beam_width is None else _int("beam_width", beam_width, 1)
    _int("input_len", input_len, 0)
    _int("output_len", output_len, 0)
    if input_len + output_len == 0:
        raise ValueError("input_len + output_len must be > 0")
    return min(
        config.primary_blocks_for(w)
        // max_block_requirements(input_len, output_len, config.sink_token_length, w, beam, config.tokens_per_block)
        for w in config.windows
    )


# --------------------------------------------------------------------------- from memory
def cache_config_from_memory(
    model_spec: ModelSpec | CacheConfig,
    primary_bytes: int | float,
    secondary_bytes: int | float = 0,
    *,
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK,
    max_seq_len: int | None = None,
    dtype: str | None = None,
    max_tokens: int | None = None,
    max_batch_size: int | None = None,
    **overrides: Any,
) -> CacheConfig:
    """A `CacheConfig` whose per-window primary/secondary pools fill the given byte budgets.

    Memory is split between windows with `window_size_shares`, then `calculate_max_num_blocks`
    turns each window's bytes into blocks. `model_spec` is a `ModelSpec` (or a `CacheConfig`
    whose geometry is reused); `overrides` are further `CacheConfig` fields (e.g.
    `max_beam_width`, `enable_block_reuse`, `cache_type`). A single-window model gets int
    block counts, a multi-window one a dict window -> blocks. A hybrid model (a
    `RECURRENT_STATES` window) needs `max_batch_size`: `hybrid_pool_split` sizes its state
    pool and the attention windows share the rest (the secondary budget without the fixed
    term).
    """
    _bytes("primary_bytes", primary_bytes)
    _bytes("secondary_bytes", secondary_bytes)
    for key in ("primary_blocks", "secondary_blocks"):
        if key in overrides:
            raise ValueError(f"{key} is computed from the byte budgets; do not pass it to from_memory")
    geometry = _as_config(
        model_spec, tokens_per_block=tokens_per_block, max_seq_len=max_seq_len, dtype=dtype, **overrides
    )
    if geometry.has_recurrent:
        blocks = _hybrid_blocks(geometry, primary_bytes, secondary_bytes, max_tokens, max_batch_size)
    else:
        blocks = calculate_max_num_blocks(
            geometry.window_to_layers,
            geometry.cache_size_per_token,
            geometry.tokens_per_block,
            primary_bytes,
            secondary_bytes,
            max_tokens,
        )
    empty = [w for w, (p, _) in blocks.items() if p < 1]
    if empty:
        need = {w: geometry.cache_size_per_token[w] * geometry.tokens_per_block for w in empty}
        raise ValueError(
            f"primary_bytes={primary_bytes} gives no block for window(s) {empty}; "
            f"one block needs {need} bytes (times the inverse of the window's share)"
        )
    if geometry.is_variable_window:
        primary: int | dict[int, int] = {w: p for w, (p, _) in blocks.items()}
        secondary: int | dict[int, int] = {w: s for w, (_, s) in blocks.items()}
    else:
        ((primary, secondary),) = blocks.values()
    return dataclasses.replace(geometry, primary_blocks=primary, secondary_blocks=secondary)


def _hybrid_blocks(
    geometry: CacheConfig,
    primary_bytes: int | float,
    secondary_bytes: int | float,
    max_tokens: int | None,
    max_batch_size: int | None,
) -> dict[int, tuple[int, int]]:
    """`cache_config_from_memory`'s pools of a hybrid model (`hybrid_pool_split`)."""
    if max_batch_size is None:
        raise ValueError("a hybrid model (a RECURRENT_STATES window) needs max_batch_size to size its state pool")
    per_token = {w: b for w, b in geometry.cache_size_per_token.items() if w != RECURRENT_STATES}
    layers = {w: v for w, v in geometry.window_to_layers.items() if w != RECURRENT_STATES}
    attn = sum(per_token.values())
    state, interval = geometry.recurrent_block_bytes, geometry.snapshot_interval
    assert interval is not None  # set by CacheConfig for a recurrent window
    reuse = geometry.enable_block_reuse
    tokens, states = hybrid_pool_split(primary_bytes, attn, state, interval, max_batch_size, reuse)
    sec_tokens = math.floor(Fraction(secondary_bytes) / (Fraction(attn) + (Fraction(state) / interval if reuse else 0)))
    tpb = geometry.tokens_per_block
    blocks = calculate_max_num_blocks(layers, per_token, tpb, tokens * attn, sec_tokens * attn, max_tokens)
    blocks[RECURRENT_STATES] = (states, sec_tokens // interval if reuse else 0)
    return blocks


# --------------------------------------------------------------------------- weights and activations
# What the KV cache gets of a device: like vLLM's gpu_memory_utilization, a fraction of the
# device's memory is the engine's, and the weights and the forward pass's activations come out
# of it first.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_ACTIVATION_TOKENS = 8192  # tokens per forward step the activation reserve is sized for


def weight_bytes(model_spec: ModelSpec, dtype: str | None = None) -> int:
    """Bytes of the model's parameters in `dtype` (default: the spec's), from its parameter count."""
    from kvjax.config import DTYPE_BYTES

    dtype = model_spec.dtype if dtype is None else dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    return int(model_spec.num_parameters * DTYPE_BYTES[dtype])


def activation_reserve_bytes(model_spec: ModelSpec, max_num_tokens: int = DEFAULT_ACTIVATION_TOKENS,
                             dtype: str | None = None) -> int:
    """An estimate of the peak activation memory of one forward step of `max_num_tokens` tokens.

    One layer's transients at a time (layers run in sequence): the residual and its norm
    (2 D), queries and attention output (2 N H), keys and values (2 K H), the gated MLP's gate,
    up and product (3 F), all in the model dtype; plus float32 logits over the vocabulary for
    every token. It leaves out attention scores (a fused / paged kernel never materialises
    them) and allocator fragmentation: pass a measured value where it matters.
    """
    from kvjax.config import DTYPE_BYTES

    _int("max_num_tokens", max_num_tokens, 1)
    s = model_spec
    b = DTYPE_BYTES[s.dtype if dtype is None else dtype]
    kv = max(s.kv_heads_per_layer)
    per_token = (2 * s.hidden_size + 2 * s.num_attention_heads * s.head_dim + 2 * kv * s.head_dim
                 + 3 * s.intermediate_size) * b + 4 * s.vocab_size
    return int(max_num_tokens * per_token)


def kv_cache_budget(device_bytes: int | float, utilization: float, weights: int | float, activations: int | float) -> int:
    """Bytes left for the KV cache: `device_bytes * utilization - weights - activations`.

    Raises ValueError when nothing is left, saying whether the weights alone already exceed the
    usable memory (the model does not fit on this device at all).
    """
    _bytes("device_bytes", device_bytes)
    _bytes("weights", weights)
    _bytes("activations", activations)
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    usable = int(device_bytes * utilization)
    gib = 2**30
    if weights >= usable:
        raise ValueError(
            f"the weights alone ({weights / gib:.2f} GiB) do not fit in {utilization:g} x {device_bytes / gib:.2f} GiB "
            f"= {usable / gib:.2f} GiB of device memory: this model needs more memory (or tensor parallelism over more devices)"
        )
    left = usable - int(weights) - int(activations)
    if left <= 0:
        raise ValueError(
            f"nothing is left for the KV cache: {usable / gib:.2f} GiB usable - weights {weights / gib:.2f} GiB "
            f"- activation reserve {activations / gib:.2f} GiB = {left / gib:.2f} GiB"
        )
    return left


# --------------------------------------------------------------------------- a server's cache
# A CPU backend reports no device memory (JAX's `memory_stats()` is None), so the cache gets a
# stated budget instead, like vLLM's CPU backend (`VLLM_CPU_KVCACHE_SPACE`).
DEFAULT_HOST_KV_CACHE_BYTES = 1 << 30


def serving_kv_cache_bytes(
    *,
    utilization: float,
    activations: int | float,
    memory_stats: Mapping[str, Any] | None = None,
    kv_cache_bytes: int | None = None,
    num_devices: int = 1,
    host_default: int = DEFAULT_HOST_KV_CACHE_BYTES,
) -> tuple[int, str]:
    """(bytes of the whole KV cache, how they were chosen) for a server on `num_devices` devices
    whose pools are sharded over them (each holds 1 / num_devices of every block).

    Per device, in order: `kv_cache_bytes` if given (vLLM's `kv_cache_memory_bytes`); else,
    when the device reports its memory (JAX's `memory_stats()`: `bytes_limit` is what its
    allocator may use, `bytes_in_use` the weights loaded so far), `kv_cache_budget(bytes_limit,
    utilization, bytes_in_use, activations)`; else (a CPU backend) `host_default`.
    """
    _int("num_devices", num_devices, 1)
    gib = 2**30
    if kv_cache_bytes is not None:
        per_device = _int("kv_cache_bytes", kv_cache_bytes, 1)
        how = f"--kv-cache-memory-bytes {per_device / gib:.2f} GiB per device"
    elif memory_stats is not None and "bytes_limit" in memory_stats:
        limit = memory_stats["bytes_limit"]
        in_use = memory_stats.get("bytes_in_use", 0)
        per_device = kv_cache_budget(limit, utilization, in_use, activations)
        how = (f"{utilization:g} x {limit / gib:.2f} GiB device memory - {in_use / gib:.2f} GiB in use (weights) "
               f"- {activations / gib:.2f} GiB activation reserve = {per_device / gib:.2f} GiB per device")
    else:
        per_device = _int("host_default", host_default, 1)
        how = (f"{per_device / gib:.2f} GiB per device: this backend reports no device memory "
               "(CPU); set it with --kv-cache-memory-bytes")
    return per_device * num_devices, how


def check_max_seq_len_fits(config: CacheConfig) -> None:
    """Raise ValueError unless one request of `config.max_seq_len` tokens fits in the primary
    pool of every window (as vLLM refuses a `max_model_len` its KV cache cannot hold). A
    sliding window holds the whole prompt until decoding releases its front blocks, as the
    engine's admission check counts it."""
    tpb = config.tokens_per_block
    n = config.max_seq_len
    short = []
    for w in config.windows:
        if w == RECURRENT_STATES:  # state blocks: a hybrid request's own are checked at admission (its snapshots)
            continue
        need = max(ceil_div(n, tpb), max_block_requirements(n, 0, config.sink_token_length, w, 1, tpb))
        have = config.primary_blocks_for(w)
        if have < need:
            short.append(f"window {w}: {have} blocks of {tpb} tokens, {need} needed")
    if short:
        fits = min(config.primary_blocks_for(w) for w in config.windows if w != RECURRENT_STATES) * tpb
        raise ValueError(
            f"the KV cache cannot hold one request of the maximum length {n} (--max-model-len) ({'; '.join(short)}): "
            f"lower --max-model-len (to at most {fits}) or give the cache more memory (--gpu-memory-utilization, "
            "--kv-cache-memory-bytes or --primary-blocks)"
        )
