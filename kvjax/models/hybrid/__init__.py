"""Hybrid models: recurrent layers mixed with attention, computed standalone (not served by the engine yet).

- `kvjax.models.hybrid.qwen3_5`: Qwen3.5 dense text (gated DeltaNet + gated attention);
- `kvjax.models.hybrid.deltanet`: the gated delta rule (chunked and recurrent forms).
"""
