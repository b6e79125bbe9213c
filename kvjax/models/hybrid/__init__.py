"""Hybrid models (recurrent layers + attention), standalone with transformers parity.

LFM2 (`Lfm2`, `load_lfm2`): gated short convolutions + attention. Granite-4.0-H dense
(`Granite`, `load_granite`): Mamba2 (`ssd_chunked` / `ssd_recurrent`) + attention. Each family has a spec parsed
strictly from config.json, `dense_forward` (no state: the oracle) and `forward_chunk` (chunks of
any size carrying a `HybridState` of per-layer states). Qwen3.5 dense text
(`Qwen35ForCausalLM`, `load_qwen3_5`): gated DeltaNet (`gated_delta_rule`, chunked and recurrent
forms) + gated attention, its own `Qwen35State`. Not served by the engine yet.
"""
from kvjax.models.hybrid.blocks import jit_forward_chunk
from kvjax.models.hybrid.conv import causal_conv1d
from kvjax.models.hybrid.deltanet import gated_delta_rule
from kvjax.models.hybrid.granite import Granite, GraniteSpec, load_granite
from kvjax.models.hybrid.lfm2 import Lfm2, Lfm2Spec, load_lfm2
from kvjax.models.hybrid.qwen3_5 import Qwen35ForCausalLM, Qwen35Spec, Qwen35State, load_qwen3_5
from kvjax.models.hybrid.ssd import ssd_chunked, ssd_recurrent
from kvjax.models.hybrid.state import ConvState, HybridState, KVState, MambaState

#: the hybrid model classes `from_pretrained` may return
HybridModel = Lfm2 | Granite | Qwen35ForCausalLM

__all__ = [
    "ConvState",
    "Granite",
    "GraniteSpec",
    "HybridModel",
    "HybridState",
    "KVState",
    "Lfm2",
    "Lfm2Spec",
    "MambaState",
    "Qwen35ForCausalLM",
    "Qwen35Spec",
    "Qwen35State",
    "causal_conv1d",
    "gated_delta_rule",
    "jit_forward_chunk",
    "load_granite",
    "load_lfm2",
    "load_qwen3_5",
    "ssd_chunked",
    "ssd_recurrent",
]
