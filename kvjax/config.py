"""`CacheConfig`: the geometry and policy of one paged KV cache, validated once.

Everything else (ledger, device pools, capacity maths) derives its numbers from here, so the
derived views (windows, pools, layer -> pool map, bytes per token) live on the config too.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Literal

from kvjax.errors import InvalidArgumentError
from kvjax.validation import INT32_MAX, check_bool, check_int, check_opt_int, check_sequence, is_int

CacheType = Literal["self", "cross", "self_k_only"]
Layout = Literal["block_first", "layer_first"]
EventHash = Literal["sha256", "trtllm64"]

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}

#: KV dtypes that `kvjax.device` stores with per-block scales (FP8 pools): one float32 scale per
#: (block, layer, K/V field, kv head) sits beside the pool, indexed by the same slot
#: (see docs/device.md). int8 stays a capacity-maths dtype only: the device pools reject it.
SCALED_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SCALE_BYTES = 4

#: the window of a layer whose cache is a recurrent state (Mamba conv + SSM state, a linear
#: attention's delta-rule state), not keys and values: TensorRT-LLM's `kRecurrentStates`
RECURRENT_STATES = -1

DEFAULT_PRIORITY = 35
MIN_PRIORITY = 0
MAX_PRIORITY = 100


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One device pool: the layers of one attention window sharing a (kv heads, head dim) shape.

    A pool array holds `num_slots = primary_blocks + 1` blocks; slot `primary_blocks` is the
    null slot that padding and placeholder table entries point to (never owned by a block).
    """

    index: int
    window: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[int, ...]
    primary_blocks: int
    secondary_blocks: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def null_slot(self) -> int:
        return self.primary_blocks

    @property
    def num_slots(self) -> int:
        return self.primary_blocks + 1


def _per_layer(name: str, value: int | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    if is_int(value):
        values = (int(value),) * num_layers
    elif isinstance(value, tuple):
        values = value
        if len(values) != num_layers:
            raise InvalidArgumentError(f"{name} has {len(values)} entries but num_layers={num_layers}")
    else:
        raise InvalidArgumentError(f"{name} must be an int or one int per layer, got {value!r}")
    return tuple(check_int(f"{name} entry", v, 1) for v in values)


def _window_key(name: str, key: object) -> int:
    """A window of a per-window mapping: a window size, or `RECURRENT_STATES`."""
    if isinstance(key, str) and key.lstrip("-").isdigit():
        key = int(key)
    if is_int(key) and key == RECURRENT_STATES:
        return RECURRENT_STATES
    return check_int(f"{name} window", key, 1)


def _canonical(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted(value.items()))
    if isinstance(value, list):
        return tuple(value)
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Geometry and policy of a paged KV cache (TensorRT-LLM `KvCacheConfig` + model shape).

    `primary_blocks` / `secondary_blocks` are per attention window: an int gives every window
    that many blocks, a dict maps window -> blocks. `attention_windows` is a per-layer cycle
    (layer i gets `attention_windows[i % len]`), clamped to `max_seq_len`. `event_hash` picks
    the block-hash formula of KV events: "sha256" (default; 32-byte hashes) or "trtllm64"
    (TensorRT-LLM's 64-bit `BlockKeyHasher`, int hashes; see docs/semantics.md).

    Hybrid models: a layer whose window is `RECURRENT_STATES` (-1) keeps a recurrent state of
    `recurrent_state_bytes` bytes (its conv and SSM / delta-rule state); every such layer
    shares the one recurrent window, whose blocks each hold all of them for one position.
    With reuse on, a sequence keeps a state snapshot every `snapshot_interval` tokens (a
    multiple of `tokens_per_block`; default `tokens_per_block`) and at its prompt's last block
    boundary (docs/semantics.md, "Recurrent states").
    """

    tokens_per_block: int
    num_layers: int
    num_kv_heads: int | tuple[int, ...]
    head_dim: int | tuple[int, ...]
    max_seq_len: int
    primary_blocks: int | Mapping[int, int]
    secondary_blocks: int | Mapping[int, int] = 0
    dtype: str = "bfloat16"
    attention_windows: tuple[int, ...] | None = None
    max_beam_width: int = 1
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    onboard_blocks: bool = True
    secondary_offload_min_priority: int = 30
    sink_token_length: int = 0
    cache_type: CacheType = "self"
    event_buffer_max_size: int = 0
    max_num_tokens: int | None = None
    layout: Layout = "block_first"
    event_hash: EventHash = "sha256"
    recurrent_state_bytes: int = 0
    snapshot_interval: int | None = None

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        err = InvalidArgumentError
        tpb = check_int("tokens_per_block", self.tokens_per_block, 1)
        if tpb & (tpb - 1):
            raise err(f"tokens_per_block must be a positive power of two, got {tpb!r}")
        set_("tokens_per_block", tpb)
        for name in ("num_layers", "max_seq_len", "max_beam_width"):
            set_(name, check_int(name, getattr(self, name), 1))
        for name in ("num_kv_heads", "head_dim"):
            v = getattr(self, name)
            set_(name, check_int(name, v, 1) if is_int(v) else check_sequence(name, v))
        _per_layer("num_kv_heads", self.num_kv_heads, self.num_layers)
        _per_layer("head_dim", self.head_dim, self.num_layers)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise err(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        for name in ("enable_block_reuse", "enable_partial_reuse", "copy_on_partial_reuse", "onboard_blocks"):
            set_(name, check_bool(name, getattr(self, name)))
        raw = self.attention_windows
        windows = (self.max_seq_len,) if raw is None else check_sequence("attention_windows", raw)
        if not windows:
            raise err("attention_windows must not be empty")
        windows = tuple(
            RECURRENT_STATES if is_int(w) and w == RECURRENT_STATES else check_int("attention_windows entry", w, 1)
            for w in windows
        )
        windows = tuple(min(w, self.max_seq_len) for w in windows)
        set_("attention_windows", windows)
        if not isinstance(self.cache_type, str) or self.cache_type not in ("self", "cross", "self_k_only"):
            raise err(f"cache_type must be 'self', 'cross' or 'self_k_only', got {self.cache_type!r}")
        if self.cache_type == "cross" and len(set(windows)) != 1:
            raise err("a cross-attention cache has exactly one attention window")
        if not isinstance(self.layout, str) or self.layout not in ("block_first", "layer_first"):
            raise err(f"layout must be 'block_first' or 'layer_first', got {self.layout!r}")
        distinct = sorted(set(windows))
        for name in ("primary_blocks", "secondary_blocks"):
            value = getattr(self, name)
            # slots are int32 and a pool holds one null slot after the primary blocks
            minimum, maximum = (1, INT32_MAX - 1) if name == "primary_blocks" else (0, INT32_MAX)
            if isinstance(value, Mapping):
                value = {
                    # TOML tables can only have string keys: "512" names window 512 ("-1": the recurrent one)
                    _window_key(name, k): check_int(f"{name}[{k!r}]", v, minimum, maximum)
                    for k, v in value.items()
                }
                missing = [w for w in distinct if w not in value]
                extra = [w for w in value if w not in distinct]
                if missing or extra:
                    raise err(f"{name} must give every window {distinct}; missing {missing}, unknown {extra}")
                set_(name, value)
            else:
                set_(name, check_int(name, value, minimum, maximum))
        set_(
            "secondary_offload_min_priority",
            check_int("secondary_offload_min_priority", self.secondary_offload_min_priority, MIN_PRIORITY, MAX_PRIORITY + 1),
        )
        set_("sink_token_length", check_int("sink_token_length", self.sink_token_length))
        set_("event_buffer_max_size", check_int("event_buffer_max_size", self.event_buffer_max_size))
        set_("max_num_tokens", check_opt_int("max_num_tokens", self.max_num_tokens, 1))
        if self.event_hash not in ("sha256", "trtllm64"):
            raise err(f"event_hash must be 'sha256' or 'trtllm64', got {self.event_hash!r}")
        self._check_recurrent(windows)

    def _check_recurrent(self, windows: tuple[int, ...]) -> None:
        """A recurrent window needs its state size and a snapshot interval that is a multiple
        of the block; it serves self-attention caches of one beam without sink tokens."""
        set_ = functools.partial(object.__setattr__, self)
        err = InvalidArgumentError
        set_("recurrent_state_bytes", check_int("recurrent_state_bytes", self.recurrent_state_bytes))
        interval = check_opt_int("snapshot_interval", self.snapshot_interval, 1)
        if RECURRENT_STATES not in windows:
            if self.recurrent_state_bytes or interval is not None:
                raise err("recurrent_state_bytes and snapshot_interval need a RECURRENT_STATES (-1) window")
            return
        if self.recurrent_state_bytes < 1:
            raise err("a RECURRENT_STATES (-1) window needs recurrent_state_bytes >= 1")
        interval = self.tokens_per_block if interval is None else interval
        if interval % self.tokens_per_block:
            raise err(f"snapshot_interval must be a multiple of tokens_per_block={self.tokens_per_block}, got {interval}")
        set_("snapshot_interval", interval)
        if len(set(windows)) < 2:
            raise err("a RECURRENT_STATES (-1) window needs an attention window beside it (a hybrid model)")
        if self.cache_type != "self" or self.max_beam_width != 1 or self.sink_token_length:
            raise err("a RECURRENT_STATES (-1) window needs cache_type='self', max_beam_width=1 and no sink tokens")

    def __hash__(self) -> int:
        return hash(tuple(_canonical(getattr(self, f.name)) for f in dataclasses.fields(self)))

    # ----------------------------------------------------------------- derived geometry
    @property
    def kv_factor(self) -> int:
        """2 for K and V, 1 for K-only (MLA-style) caches."""
        return 1 if self.cache_type == "self_k_only" else 2

    @property
    def dtype_bytes(self) -> float:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_scaled(self) -> bool:
        """True for FP8 KV: the device keeps a float32 scale per (block, layer, field, kv head)."""
        return self.dtype in SCALED_DTYPES

    @functools.cached_property
    def kv_scale_bytes_per_token(self) -> dict[int, float]:
        """Bytes of block scales per token in each window (0 unless `is_scaled`): a block's
        scales spread over its `tokens_per_block` tokens."""
        out = {w: 0.0 for w in self.windows}
        if self.is_scaled:
            for layer in range(self.num_layers):
                if self.layer_windows[layer] == RECURRENT_STATES:
                    continue
                out[self.layer_windows[layer]] += (
                    self.kv_factor * self.kv_heads_per_layer[layer] * SCALE_BYTES / self.tokens_per_block
                )
        return out

    @functools.cached_property
    def kv_heads_per_layer(self) -> tuple[int, ...]:
        return _per_layer("num_kv_heads", self.num_kv_heads, self.num_layers)

    @functools.cached_property
    def head_dim_per_layer(self) -> tuple[int, ...]:
        return _per_layer("head_dim", self.head_dim, self.num_layers)

    @functools.cached_property
    def layer_windows(self) -> tuple[int, ...]:
        """Attention window of every layer (the per-layer cycle unrolled)."""
        w = self.attention_windows
        assert w is not None  # __post_init__ always sets the tuple
        return tuple(w[i % len(w)] for i in range(self.num_layers))

    @functools.cached_property
    def windows(self) -> tuple[int, ...]:
        """Distinct attention windows, ascending: one window manager each."""
        return tuple(sorted(set(self.layer_windows)))

    @functools.cached_property
    def window_to_layers(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {w: [] for w in self.windows}
        for layer, w in enumerate(self.layer_windows):
            out[w].append(layer)
        return out

    @property
    def is_variable_window(self) -> bool:
        return len(self.windows) > 1

    def is_swa(self, window: int) -> bool:
        return 0 < window < self.max_seq_len

    @property
    def has_recurrent(self) -> bool:
        """A hybrid model's cache: one window holds recurrent states."""
        return RECURRENT_STATES in self.windows

    @property
    def partial_reuse(self) -> bool:
        """Partial-block reuse: a recurrent state exists at snapshot points only, so a hybrid
        cache reuses whole blocks only."""
        return self.enable_partial_reuse and not self.has_recurrent

    @functools.cached_property
    def recurrent_block_bytes(self) -> int:
        """Bytes of one recurrent-state block: every recurrent layer's state at one position."""
        return len(self.window_to_layers.get(RECURRENT_STATES, ())) * self.recurrent_state_bytes

    def primary_blocks_for(self, window: int) -> int:
        v = self.primary_blocks
        return v[window] if isinstance(v, Mapping) else v

    def secondary_blocks_for(self, window: int) -> int:
        v = self.secondary_blocks
        return v[window] if isinstance(v, Mapping) else v

    @functools.cached_property
    def pools(self) -> tuple[PoolSpec, ...]:
        """Pools ordered by (window, kv heads, head dim); pool indices are absolute across windows."""
        groups: dict[tuple[int, int, int], list[int]] = {}
        for layer in range(self.num_layers):
            key = (self.layer_windows[layer], self.kv_heads_per_layer[layer], self.head_dim_per_layer[layer])
            groups.setdefault(key, []).append(layer)
        return tuple(
            PoolSpec(i, w, h, d, tuple(layers), self.primary_blocks_for(w), self.secondary_blocks_for(w))
            for i, ((w, h, d), layers) in enumerate(sorted(groups.items()))
        )

    @functools.cached_property
    def window_pools(self) -> dict[int, tuple[int, ...]]:
        """Window -> indices of its pools."""
        out: dict[int, list[int]] = {w: [] for w in self.windows}
        for p in self.pools:
            out[p.window].append(p.index)
        return {w: tuple(v) for w, v in out.items()}

    @functools.cached_property
    def layer_to_pool(self) -> tuple[tuple[int, int], ...]:
        """Layer -> (pool index, layer index inside the pool)."""
        out: list[tuple[int, int]] = [(0, 0)] * self.num_layers
        for p in self.pools:
            for j, layer in enumerate(p.layers):
                out[layer] = (p.index, j)
        return tuple(out)

    @functools.cached_property
    def cache_size_per_token(self) -> dict[int, float]:
        """Bytes of KV one token occupies in each window (all that window's layers, K and V),
        FP8 block scales included (`kv_scale_bytes_per_token`)."""
        out = dict(self.kv_scale_bytes_per_token)
        for layer in range(self.num_layers):
            if self.layer_windows[layer] == RECURRENT_STATES:  # a state block's bytes, spread over its block
                out[RECURRENT_STATES] = self.recurrent_block_bytes / self.tokens_per_block
                continue
            out[self.layer_windows[layer]] += (
                self.kv_factor * self.kv_heads_per_layer[layer] * self.head_dim_per_layer[layer] * self.dtype_bytes
            )
        return out

    @property
    def sink_bubble_length(self) -> int:
        """Tokens of padding after the sink tokens so that generation starts on a block boundary."""
        r = self.sink_token_length % self.tokens_per_block
        return 0 if r == 0 else self.tokens_per_block - r

    def temporary_window(self, window: int) -> int:
        """Extra tokens a chunked context may need beyond `window` (TRT-LLM's temp attention window)."""
        if self.max_num_tokens is None or window == RECURRENT_STATES or self.max_seq_len <= window:
            return 0
        return max(0, min(self.max_num_tokens, self.max_seq_len - window))

    def max_token_num(self, window: int) -> int:
        """Most tokens a sequence may hold in `window`'s manager."""
        return max(window, self.max_seq_len) + self.sink_bubble_length

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table width one sequence can need (SWA blocks are linear: out-of-window ones
        become placeholders but keep their position)."""
        return math.ceil((self.max_seq_len + self.sink_bubble_length) / self.tokens_per_block)
