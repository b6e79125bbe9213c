"""The per-sequence state of a hybrid model between chunks: one entry per layer.

Each layer's state is its own pytree node (`state.layers[i]`), so a serving engine can keep each
kind in its own pool (`[L_rec, slots, ...]`) and read / write one layer-set at a time:

- `ConvState` (LFM2 short convolution): the last K-1 inputs of the convolution, `[B, K-1, C]`
  in the model dtype;
- `MambaState` (Mamba2): the convolution's last K-1 inputs `[B, K-1, C]` (C = inner width
  + 2 * groups * state size) and the SSM state `[B, heads, head_dim, state size]` in float32;
- `KVState` (attention): keys and values of every position so far, contiguous `[B, S_max, K, H]`
  (the paged cache replaces it when the engine serves these models).

`length` counts the tokens already consumed (the same for every row: rows advance together).
"""
from __future__ import annotations

from flax import struct
from jaxtyping import Array, Float, Int


@struct.dataclass
class ConvState:
    conv: Float[Array, "B Km1 C"]  # last K-1 conv inputs (zeros at the start)


@struct.dataclass
class MambaState:
    conv: Float[Array, "B Km1 C"]  # last K-1 conv inputs: C = inner + 2 * groups * state
    ssm: Float[Array, "B NH P N"]  # float32 SSM state per head: [heads, head_dim, state]


@struct.dataclass
class KVState:
    k: Float[Array, "B S K H"]  # RoPE'd keys at positions [0, S_max), valid below `length`
    v: Float[Array, "B S K H"]


LayerState = ConvState | MambaState | KVState


@struct.dataclass
class HybridState:
    layers: tuple[LayerState, ...]  # one per decoder layer, in layer order
    length: Int[Array, ""]  # tokens consumed so far (int32 scalar)

    @property
    def capacity(self) -> int:
        """Tokens the attention caches hold (0: no attention layer, any length fits)."""
        caps = [s.k.shape[1] for s in self.layers if isinstance(s, KVState)]
        return min(caps) if caps else 0
