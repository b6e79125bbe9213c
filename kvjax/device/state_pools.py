"""`StatePools`: the recurrent states of hybrid models (gated DeltaNet, Mamba2, short conv) as
JAX arrays, in fixed-size slots that the ledger's recurrent-state window hands out.

A slot holds one sequence's full recurrent state (every recurrent layer, every field) at one
snapshot position. A step reads a row's state from one slot and writes the next state to
another (copy-forward: a snapshot is never modified in place), so the ops are a per-layer
gather (`read_states`) and a per-layer scatter (`write_states`), plus whole-slot moves between
tiers and inside the primary tier (`apply_state_transfers`, carrying out the ledger's
`TransferPlan` entries for the recurrent pool).

Layout, per field (`StateField`: a name, a per-layer shape and a dtype), slot-major:
  primary    `[primary_slots + 1, num_layers, *field.shape]`  (the last slot: the null slot)
  secondary  `[secondary_slots, num_layers, *field.shape]`    (pinned_host; absent when 0)
Slot-major because every transfer moves whole slots: a slot is then one contiguous chunk per
field (one DMA per field for an offload or onboard, one memcpy for a copy-forward COPY),
where a layer-major `[L, N+1, ...]` array would scatter it into `num_layers` chunks. The step
ops lose nothing: reading or writing one layer of B rows touches B contiguous
`field.shape` chunks in either layout.

The null slot (`null_slot == primary_slots`) is zero forever: a row with no state yet (a fresh
sequence, a padding row) reads it and gets the zero state; no op ever writes it. Host
(numpy) slot arrays are checked eagerly with an `InvalidArgumentError` and nothing changes;
device arrays and tracers cannot be checked without a sync, so they are made harmless (reads
outside `[0, null_slot]` give zeros, writes outside `[0, primary_slots)` are dropped, never
clamped or wrapped) and reported in checked mode (`kvjax.device.checked()`).

Sizing: `StateGeometry.layer_bytes` is what the ledger's `CacheConfig.recurrent_state_bytes`
means (one layer's state); `slot_bytes` (all layers, one slot) is the unit of capacity, and
`pool_bytes(n)` / `max_slots(budget)` turn it into slot counts (docs/device.md).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from kvjax.config import PoolSpec
from kvjax.device import _checks as chk
from kvjax.device import checking
from kvjax.device.buckets import bucket
from kvjax.errors import InvalidArgumentError
from kvjax.transfer_plan import TransferKind, TransferPlan

#: Dtypes a state field may hold (SSM / delta-rule states are float32; conv states the model's).
STATE_DTYPES = ("float32", "bfloat16", "float16")


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value > chk.INT32_MAX - 1:
        raise InvalidArgumentError(f"{name}={value} does not fit an int32 slot index")
    return int(value)


@dataclasses.dataclass(frozen=True)
class StateField:
    """One named part of a layer's recurrent state, e.g. `conv` `[K-1, conv_dim]` in the model
    dtype or `ssm` `[heads, d_k, d_v]` float32."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise InvalidArgumentError(f"StateField.name must be an identifier, got {self.name!r}")
        if not isinstance(self.shape, (tuple, list)):
            raise InvalidArgumentError(f"StateField {self.name!r}: shape must be a tuple of ints, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(_check_count(f"StateField {self.name!r} dim", d, 1) for d in self.shape))
        if self.dtype not in STATE_DTYPES:
            raise InvalidArgumentError(f"StateField {self.name!r}: dtype must be one of {STATE_DTYPES}, got {self.dtype!r}")

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def layer_bytes(self) -> int:
        """Bytes of this field for one layer of one slot."""
        return math.prod(self.shape) * self.jnp_dtype.itemsize


@dataclasses.dataclass(frozen=True)
class StateGeometry:
    """Fields, recurrent layers and slots of a set of state pools (hashable: jitted ops
    specialise on it).

    `num_layers` counts the recurrent layers only (ops take the index among them, 0 ..
    num_layers - 1, not the model's global layer index). `tokens_per_block` and `plan_pool`
    say how the ledger's `TransferPlan` names this pool: its entries carry `pool == plan_pool`
    and, since a state slot moves whole, `num_tokens == tokens_per_block`.
    """

    fields: tuple[StateField, ...]
    num_layers: int
    primary_slots: int
    secondary_slots: int = 0
    tokens_per_block: int = 1
    plan_pool: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.fields, (tuple, list)) or not self.fields:
            raise InvalidArgumentError("StateGeometry.fields must be a non-empty tuple of StateField")
        if not all(isinstance(f, StateField) for f in self.fields):
            raise InvalidArgumentError(f"StateGeometry.fields must hold StateField, got {self.fields!r}")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"StateGeometry field names must be distinct, got {names}")
        object.__setattr__(self, "fields", tuple(self.fields))
        object.__setattr__(self, "num_layers", _check_count("num_layers", self.num_layers, 1))
        object.__setattr__(self, "primary_slots", _check_count("primary_slots", self.primary_slots, 1))
        object.__setattr__(self, "secondary_slots", _check_count("secondary_slots", self.secondary_slots, 0))
        object.__setattr__(self, "tokens_per_block", _check_count("tokens_per_block", self.tokens_per_block, 1))
        object.__setattr__(self, "plan_pool", _check_count("plan_pool", self.plan_pool, 0))

    @classmethod
    def for_deltanet(cls, *, num_layers: int, conv_dim: int, conv_kernel: int, value_heads: int, key_dim: int,
                     value_dim: int, dtype: str = "bfloat16", **slots) -> StateGeometry:
        """Qwen3.5's gated DeltaNet: `conv` `[K-1, conv_dim]` in the model dtype (the layout of
        `DeltaNetState.conv` without its batch axis) and `recurrent` `[Hv, Dk, Dv]` float32."""
        conv = StateField("conv", (_check_count("conv_kernel", conv_kernel, 2) - 1, conv_dim), dtype)
        rec = StateField("recurrent", (value_heads, key_dim, value_dim), "float32")
        return cls((conv, rec), num_layers, **slots)

    @classmethod
    def for_pool(cls, pool: PoolSpec, fields: tuple[StateField, ...], *, tokens_per_block: int) -> StateGeometry:
        """The geometry of the ledger's recurrent-state pool `pool` (a `CacheConfig.pools` entry
        of the `RECURRENT_STATES` window): its slots, host slots, layers (layer `j` here is the
        model's layer `pool.layers[j]`) and plan index, so slot ids from the ledger (the null
        slot included) index these arrays unchanged."""
        if not isinstance(pool, PoolSpec):
            raise InvalidArgumentError(f"pool must be a PoolSpec (a CacheConfig.pools entry), got {type(pool).__name__}")
        return cls(tuple(fields), pool.num_layers, pool.primary_blocks, pool.secondary_blocks, tokens_per_block, pool.index)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def num_slots(self) -> int:
        """Primary slots including the null slot."""
        return self.primary_slots + 1

    @property
    def null_slot(self) -> int:
        return self.primary_slots

    def shape(self, field: StateField, slots: int) -> tuple[int, ...]:
        return (slots, self.num_layers, *field.shape)

    @property
    def layer_bytes(self) -> int:
        """One layer's state, every field: the ledger's `CacheConfig.recurrent_state_bytes`."""
        return sum(f.layer_bytes for f in self.fields)

    @property
    def slot_bytes(self) -> int:
        """One slot (every recurrent layer): the unit the ledger's recurrent window counts."""
        return self.num_layers * self.layer_bytes

    def pool_bytes(self, primary_slots: int | None = None, secondary_slots: int | None = None) -> tuple[int, int]:
        """(device bytes incl. the null slot, host bytes) of pools with these slot counts
        (default: this geometry's)."""
        p = self.primary_slots if primary_slots is None else _check_count("primary_slots", primary_slots, 1)
        s = self.secondary_slots if secondary_slots is None else _check_count("secondary_slots", secondary_slots, 0)
        return (p + 1) * self.slot_bytes, s * self.slot_bytes

    def max_slots(self, budget_bytes: int) -> int:
        """Most usable primary slots that fit `budget_bytes` of device memory (the null slot
        counted); 0 when not even one fits."""
        if isinstance(budget_bytes, (bool, np.bool_)) or not isinstance(budget_bytes, (int, np.integer)) or budget_bytes < 0:
            raise InvalidArgumentError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
        return max(0, int(budget_bytes) // self.slot_bytes - 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StatePools:
    """Device state pools (a pytree: arrays are leaves, the geometry is static).

    `primary[i]` / `secondary[i]` hold `geometry.fields[i]` (secondary entries are `None`
    without a host tier). Ops that return pools donate the ones they are given: rebind
    (`pools = write_states(pools, ...)`), and inspect through copies (`jnp.copy`), as with
    `KVPools`.
    """

    primary: tuple[jax.Array, ...]
    secondary: tuple[jax.Array | None, ...]
    geometry: StateGeometry = dataclasses.field(metadata=dict(static=True))

    def replace(self, **kw) -> StatePools:
        return dataclasses.replace(self, **kw)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.primary, *self.secondary) if a is not None)


@functools.cache
def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, sharding) -> Callable[[], jax.Array]:
    # Born with its final placement; host arrays through an explicit device_put inside the jit
    # (as `kvjax.device.pools` does: out_shardings alone loses the host memory space).
    if sharding.memory_kind == "pinned_host":
        return jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), jax.memory.Space.Host), out_shardings=sharding)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def allocate_state_pools(geometry: StateGeometry, device: jax.Device | None = None) -> StatePools:
    """Zero-filled state pools on `device` (default: the first), a host tier in pinned_host
    memory when `geometry.secondary_slots > 0`. Single device only: state pools are not
    sharded yet."""
    if not isinstance(geometry, StateGeometry):
        raise InvalidArgumentError(f"geometry must be a StateGeometry, got {type(geometry).__name__}")
    if device is not None and not isinstance(device, jax.Device):
        raise InvalidArgumentError(f"device must be a jax.Device or None, got {device!r}")
    device = jax.devices()[0] if device is None else device
    on_dev = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    prim = tuple(_zeros(geometry.shape(f, geometry.num_slots), f.jnp_dtype, on_dev)() for f in geometry.fields)
    sec = tuple(_zeros(geometry.shape(f, geometry.secondary_slots), f.jnp_dtype, on_host)() if geometry.secondary_slots
                else None for f in geometry.fields)
    return StatePools(prim, sec, geometry)


# ------------------------------------------------------------------------ boundary checks
def _check_pools(pools) -> StateGeometry:
    if not isinstance(pools, StatePools):
        raise InvalidArgumentError(f"pools must be a StatePools (from allocate_state_pools), got {type(pools).__name__}")
    return pools.geometry


def _layer(geo: StateGeometry, layer) -> Int[Array, ""] | np.int32:
    """A static layer, range-checked, or a traced int scalar (out of range: reads zeros,
    writes nothing)."""
    if isinstance(layer, (bool, np.bool_)):
        raise InvalidArgumentError(f"layer must be an int, got {layer!r}")
    if isinstance(layer, (int, np.integer)) or (isinstance(layer, np.ndarray) and layer.ndim == 0
                                                and np.issubdtype(layer.dtype, np.integer)):
        static = operator.index(layer)
        if not 0 <= static < geo.num_layers:
            raise InvalidArgumentError(f"layer={static} must be a recurrent layer index in [0, {geo.num_layers})")
        return np.int32(static)
    if not isinstance(layer, jax.Array) or layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise InvalidArgumentError(f"layer must be an int or a 0-d integer array (a traced layer), got {layer!r}")
    return layer.astype(jnp.int32)


def _slots(name: str, slots, batch: int | None = None) -> np.ndarray | None:
    try:
        (n,), host = chk.int_array(name, slots, 1)
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None
    if batch is not None and n != batch:
        raise InvalidArgumentError(f"{name}.shape={tuple(slots.shape)} must be [{batch}] to match the values")
    return host


# ------------------------------------------------------------------------------- reads
def _validate_read(slots, layer, *, geo: StateGeometry) -> None:
    bad = (slots < 0) | (slots > geo.null_slot)
    checking.check(~jnp.any(bad), f"read_states: read slot {{}} is outside [0, {geo.null_slot}] (the null slot "
                   "included)", slots[jnp.argmax(bad)])
    checking.check((layer >= 0) & (layer < geo.num_layers), "read_states: layer {} is out of range", layer)


@functools.partial(jax.jit, static_argnames=("geo", "checked"))
def _read(primary, slots, layer, *, geo: StateGeometry, checked: bool):
    if checked:
        _validate_read(slots, layer, geo=geo)
    ok = (slots >= 0) & (slots <= geo.null_slot) & (layer >= 0) & (layer < geo.num_layers)  # [B]
    safe = jnp.where(ok, slots, geo.num_slots)  # [B] out of range: the gather fills zeros
    lay = jnp.where((layer >= 0) & (layer < geo.num_layers), layer, geo.num_layers)
    return {f.name: arr.at[safe, lay].get(mode="fill", fill_value=0)  # [B, *field.shape]
            for f, arr in zip(geo.fields, primary, strict=True)}


def read_states(pools: StatePools, layer: int | Int[Array, ""], read_slots: Int[Array, " B"] | Int[np.ndarray, " B"]
                ) -> dict[str, Float[Array, "B ..."]]:
    """Layer `layer`'s state of rows reading slots `read_slots` `[B]`: `{field: [B, *shape]}`
    in each field's dtype. The null slot reads zeros (a row with no state yet). Pools are not
    donated. `layer` is the recurrent-layer index, an int or a traced scalar (`lax.scan`)."""
    geo = _check_pools(pools)
    lay = _layer(geo, layer)
    host = _slots("read_slots", read_slots)
    if host is not None and host.size and (host.min() < 0 or host.max() > geo.null_slot):
        raise InvalidArgumentError(f"read_slots must be in [0, {geo.null_slot}] (the null slot {geo.null_slot} reads "
                                   f"the zero state), got min {int(host.min())}, max {int(host.max())}")
    slots = chk.as_int32(read_slots)
    checked = checking.is_checked()
    if checked and not chk.any_tracer(slots, lay, *pools.primary):
        checking.run_eager_checks(_validate_read, slots, lay, geo=geo)
        checked = False
    return _read(pools.primary, slots, lay, geo=geo, checked=checked)


def read_states_reference(pools: StatePools, layer: int, read_slots: Int[np.ndarray, " B"]) -> dict[str, np.ndarray]:
    """Oracle: numpy indexing of host copies (static layer, valid slots)."""
    slots = np.asarray(read_slots)
    return {f.name: np.array(jnp.copy(a))[slots, layer] for f, a in zip(pools.geometry.fields, pools.primary, strict=True)}


# ------------------------------------------------------------------------------ writes
def _validate_write(slots, layer, *, geo: StateGeometry) -> None:
    bad = (slots < -1) | (slots >= geo.primary_slots)
    checking.check(~jnp.any(bad), f"write_states: write slot {{}} is not -1 (skip) or in [0, {geo.primary_slots}) "
                   f"(the null slot {geo.null_slot} and beyond are never written)", slots[jnp.argmax(bad)])
    checking.check((layer >= 0) & (layer < geo.num_layers), "write_states: layer {} is out of range", layer)


@functools.partial(jax.jit, static_argnames=("geo", "checked"), donate_argnames=("primary",))
def _write(primary, slots, layer, values, *, geo: StateGeometry, checked: bool):
    if checked:
        _validate_write(slots, layer, geo=geo)
    ok = (slots >= 0) & (slots < geo.primary_slots)  # [B] -1 (skip), the null slot and beyond: dropped
    safe = jnp.where(ok, slots, geo.num_slots)  # [B]
    lay = jnp.where((layer >= 0) & (layer < geo.num_layers), layer, geo.num_layers)
    return tuple(arr.at[safe, lay].set(values[f.name].astype(arr.dtype), mode="drop")  # [B, *field.shape] in
                 for f, arr in zip(geo.fields, primary, strict=True))


def write_states(pools: StatePools, layer: int | Int[Array, ""], write_slots: Int[Array, " B"] | Int[np.ndarray, " B"],
                 values: Mapping[str, Float[Array, "B ..."]]) -> StatePools:
    """Write layer `layer`'s new state of B rows, `values[field]` `[B, *field.shape]` (cast to
    the field's dtype), into slots `write_slots` `[B]` (-1: skip the row). Returns the new
    pools; the old ones are donated. The null slot and out-of-range slots are never written
    (numpy slots: `InvalidArgumentError`, nothing donated); two rows writing one slot are
    refused likewise (numpy) or undefined (device arrays)."""
    geo = _check_pools(pools)
    lay = _layer(geo, layer)
    if not isinstance(values, Mapping) or set(values) != set(geo.names):
        got = sorted(values) if isinstance(values, Mapping) else type(values).__name__
        raise InvalidArgumentError(f"values must map exactly the fields {list(geo.names)}, got {got}")
    batch = None
    for f in geo.fields:
        x = values[f.name]
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise InvalidArgumentError(f"values[{f.name!r}] must be a floating array, got {type(x).__name__} {dtype}")
        if tuple(shape[1:]) != f.shape or len(shape) != len(f.shape) + 1 or (batch is not None and shape[0] != batch):
            raise InvalidArgumentError(f"values[{f.name!r}].shape={tuple(shape)} must be [B, {', '.join(map(str, f.shape))}]"
                                       f"{'' if batch is None else f' with B={batch}'}")
        batch = shape[0]
    host = _slots("write_slots", write_slots, batch)
    if host is not None and host.size:
        if host.min() < -1 or host.max() >= geo.primary_slots:
            raise InvalidArgumentError(f"write_slots must be -1 (skip) or in [0, {geo.primary_slots}) (the null slot "
                                       f"{geo.null_slot} is never written), got min {int(host.min())}, max {int(host.max())}")
        live = host[host >= 0]
        if np.unique(live).size != live.size:
            raise InvalidArgumentError(f"write_slots must not repeat a slot, got {host.tolist()}")
    slots = chk.as_int32(write_slots)
    checked = checking.is_checked()
    if checked and not chk.any_tracer(slots, lay, *pools.primary):
        checking.run_eager_checks(_validate_write, slots, lay, geo=geo)
        checked = False
    primary = _write(pools.primary, slots, lay, dict(values), geo=geo, checked=checked)
    return pools.replace(primary=primary)


def write_states_reference(pools: StatePools, layer: int, write_slots: Int[np.ndarray, " B"],
                           values: Mapping[str, Float[np.ndarray, "B ..."]]) -> StatePools:
    """Oracle (no donation): row by row on host copies; -1 skips."""
    geo = pools.geometry
    out = []
    for f, a in zip(geo.fields, pools.primary, strict=True):
        h = np.array(jnp.copy(a))
        for b, s in enumerate(np.asarray(write_slots).tolist()):
            if s >= 0:
                h[s, layer] = np.asarray(values[f.name][b]).astype(h.dtype)
        out.append(jax.device_put(h, a.sharding))
    return pools.replace(primary=tuple(out))


# --------------------------------------------------------------------------- transfers
def split_state_plan(plan: TransferPlan, plan_pool: int) -> tuple[TransferPlan, TransferPlan]:
    """(the entries of pool `plan_pool`, every other entry), each in plan order: a ledger plan
    of a hybrid cache names KV pools and the recurrent pool; they share no memory, so the two
    halves can be applied separately (`apply_state_transfers`, `apply_transfers`)."""
    if not isinstance(plan, TransferPlan):
        raise InvalidArgumentError(f"plan must be a TransferPlan, got {type(plan).__name__}")
    mine = plan.pool == plan_pool
    def part(sel: np.ndarray) -> TransferPlan:
        return TransferPlan(plan.kind[sel], plan.pool[sel], plan.src[sel], plan.dst[sel], plan.num_tokens[sel], seq=plan.seq)

    return part(mine), part(~mine)


def validate_state_plan(geo: StateGeometry, plan: TransferPlan) -> None:
    """Host checks: every entry names this pool, moves a whole slot, and its slots lie inside
    their tiers (the null slot is neither read nor written); a host tier for OFFLOAD/ONBOARD."""
    if not isinstance(plan, TransferPlan):
        raise InvalidArgumentError(f"plan must be a TransferPlan, got {type(plan).__name__}")
    if not len(plan):
        return
    if (plan.pool != geo.plan_pool).any():
        i = int(np.argmax(plan.pool != geo.plan_pool))
        raise InvalidArgumentError(f"plan entry {i} names pool {int(plan.pool[i])}, not the state pool {geo.plan_pool} "
                                   "(split a mixed plan with split_state_plan)")
    if (plan.num_tokens != geo.tokens_per_block).any():
        i = int(np.argmax(plan.num_tokens != geo.tokens_per_block))
        raise InvalidArgumentError(f"plan entry {i}: num_tokens={int(plan.num_tokens[i])}, but a state slot moves whole "
                                   f"(num_tokens == tokens_per_block={geo.tokens_per_block})")
    kind = plan.kind
    if not geo.secondary_slots and (kind != TransferKind.COPY).any():
        raise InvalidArgumentError("plan offloads or onboards state slots, but these pools have no host tier "
                                   "(secondary_slots=0)")
    src_lim = np.where(kind == TransferKind.ONBOARD, geo.secondary_slots, geo.primary_slots)
    dst_lim = np.where(kind == TransferKind.OFFLOAD, geo.secondary_slots, geo.primary_slots)
    for name, val, lim in (("src", plan.src, src_lim), ("dst", plan.dst, dst_lim)):
        bad = (val < 0) | (val >= lim)
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidArgumentError(f"plan entry {i} ({TransferKind(int(kind[i])).name}): {name}={int(val[i])} "
                                       f"is outside [0, {int(lim[i])})")


@functools.partial(jax.jit, static_argnames=("kind",), donate_argnames=("dst_tier",))
def _run(dst_tier, src_tier, ops, count, *, kind: int):
    """Entries `ops[:, :count]` (`[2, bucket]` src/dst) of one kind, in order: one slot per
    field sliced from `src_tier` (None: `dst_tier` itself, for COPY), moved across memory
    spaces when the tiers differ, and updated into the donated `dst_tier`."""

    def move(x):
        if kind == TransferKind.OFFLOAD:
            return jax.device_put(x, jax.memory.Space.Host)
        if kind == TransferKind.ONBOARD:
            return jax.device_put(x, jax.memory.Space.Device)
        return x

    def body(i, dst):
        src = dst if src_tier is None else src_tier
        return tuple(jax.lax.dynamic_update_slice_in_dim(d, move(jax.lax.dynamic_slice_in_dim(s, ops[0, i], 1, 0)),
                                                          ops[1, i], 0)  # one slot [1, L, *field.shape]
                     for d, s in zip(dst, src, strict=True))

    return jax.lax.fori_loop(0, count, body, dst_tier)


def apply_state_transfers(pools: StatePools, plan: TransferPlan) -> StatePools:
    """Apply the state pool's `plan` entries one by one, in order (OFFLOAD primary -> host,
    ONBOARD host -> primary, COPY primary -> primary; whole slots, every layer and field).
    Returns the new pools; the old ones are donated. The plan is validated first: a rejected
    plan changes nothing. Runs of same-kind entries are one jitted loop each (counts bucketed
    to powers of two); a slot is one contiguous chunk per field, so each move is one copy."""
    geo = _check_pools(pools)
    validate_state_plan(geo, plan)
    if not len(plan):
        return pools
    prim, sec = pools.primary, pools.secondary
    cuts = np.flatnonzero(np.diff(plan.kind)) + 1
    for run in np.split(np.arange(len(plan)), cuts):
        ops = np.zeros((2, bucket(run.size)), np.int32)
        ops[0, : run.size], ops[1, : run.size] = plan.src[run], plan.dst[run]
        kind = int(plan.kind[run[0]])
        count = np.int32(run.size)
        if kind == TransferKind.OFFLOAD:
            sec = _run(sec, prim, ops, count, kind=kind)
        elif kind == TransferKind.ONBOARD:
            prim = _run(prim, sec, ops, count, kind=kind)
        else:
            prim = _run(prim, None, ops, count, kind=kind)
    return pools.replace(primary=prim, secondary=sec)


def apply_state_transfers_reference(pools: StatePools, plan: TransferPlan) -> StatePools:
    """Oracle: entry by entry on host copies, then back onto the original placement."""
    validate_state_plan(pools.geometry, plan)
    prim = [np.array(jnp.copy(a)) for a in pools.primary]
    sec = [None if a is None else np.array(jnp.copy(a)) for a in pools.secondary]
    for op in plan:
        for i in range(len(prim)):
            src = sec[i] if op.kind == TransferKind.ONBOARD else prim[i]
            dst = sec[i] if op.kind == TransferKind.OFFLOAD else prim[i]
            assert src is not None and dst is not None  # validate_state_plan: a host tier exists
            dst[op.dst] = src[op.src].copy()
    put = lambda xs, like: tuple(None if a is None else jax.device_put(x, a.sharding)  # noqa: E731
                                 for x, a in zip(xs, like, strict=True))
    return pools.replace(primary=put(prim, pools.primary), secondary=put(sec, pools.secondary))
