"""The engine on FP8 KV pools (`kv_cache_dtype`): scaled pools through scheduling, offload and
onboard of blocks with their scales, and greedy tokens close to the full-precision pools'."""
import numpy as np
import pytest
from engine_helpers import TIGHT, cache, check_accounting

from kvjax.engine import ChatWorkload
from kvjax.engine.config import KV_CACHE_DTYPES

CHAT = ChatWorkload(
    users=6, turns=3, system_prompts=2, system_prompt_tokens=(36, 44), user_tokens=(4, 20),
    max_new_tokens=(4, 10), arrival_interval=1, think_steps=1, priority=80, seed=7,
)


def test_fp8_pools_serve_a_tight_pool_workload(micro):
    items = CHAT.build(micro.model.spec.vocab_size)
    engine = micro.engine()
    full = engine.run(items, cache(micro.model, primary=TIGHT))
    fp8 = engine.run(items, cache(micro.model, primary=TIGHT, kv_cache_dtype="fp8"))
    assert fp8.ledger.config.dtype == "float8_e4m3fn"
    s = fp8.metrics.summary()
    assert s["blocks_offloaded"] > 0 and s["blocks_onboarded"] > 0 and s["prefill_reused_tokens"] > 0
    check_accounting(fp8)
    # e4m3 keeps ~2 significant digits: most greedy tokens survive (0.82 measured; one flip on this
    # random-weight model changes the rest of its request), a broken scale path keeps almost none
    pairs = [(a, b) for k in full.outputs for a, b in zip(full.outputs[k], fp8.outputs[k], strict=True)]
    agreement = np.mean([a == b for a, b in pairs])
    assert len(pairs) > 100 and agreement >= 0.6, agreement


def test_kv_cache_dtype_values(micro):
    assert cache(micro.model, kv_cache_dtype="auto").dtype == micro.model.spec.dtype
    assert cache(micro.model, kv_cache_dtype="bfloat16").dtype == "bfloat16"
    assert set(KV_CACHE_DTYPES) >= {"auto", "fp8", "float8_e4m3fn"}
    from kvjax.cli import KV_CACHE_DTYPE_CHOICES

    assert set(KV_CACHE_DTYPE_CHOICES) == set(KV_CACHE_DTYPES)
    for bad in ("int8x", "FP8", 8):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            cache(micro.model, kv_cache_dtype=bad)
