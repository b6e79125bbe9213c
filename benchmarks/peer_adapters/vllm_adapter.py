"""vLLM v1's `KVCacheManager` driven the way vLLM's scheduler drives it, on the ledger trace.

Per wave (one scheduler step admits the whole wave; then one step per generated token):
  admit   `Request(...)` with vLLM's block hasher (the engine core builds it on arrival; its
          constructor hashes every full prompt block with the default `sha256` algorithm),
          `get_computed_blocks` (longest cached prefix, capped at num_tokens - 1),
          `allocate_slots(req, new tokens, hit tokens, hit blocks)` (touches the hit blocks,
          allocates the rest, caches every full block), then `num_computed_tokens` = prompt;
  decode  per step `new_step_starts()`, then per request `append_output_token_ids(token)`
          (hashes a block when it fills) and `allocate_slots(req, 1)`; the step ends with
          `take_new_block_ids()` as the scheduler drains it every step;
  finish  `free(req)` (blocks back to the free queue, tail first).
One group of full attention, `num_blocks` blocks (vLLM keeps block 0 as its null block),
prefix caching on, KV events on with --events (drained with `take_events()` each wave).
Imports only the installed `vllm` package (docs/benchmarks.md says how to create its venv).
"""
from __future__ import annotations


class VllmDriver:
    name = "vllm_v1_kv_cache_manager"

    def __init__(self, a):
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        self.a = a
        self.Request = Request
        hash_fn = get_hash_fn_by_name("sha256")  # CacheConfig.prefix_caching_hash_algo's default
        init_none_hash(hash_fn)  # as EngineCore does at start-up
        self.block_hasher = get_request_block_hasher(a.block_size, hash_fn)
        spec = FullAttentionSpec(block_size=a.block_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
        config = KVCacheConfig(
            num_blocks=a.num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
        )
        max_len = a.system_tokens + a.unique_tokens + a.gen_tokens + a.block_size
        self.m = KVCacheManager(
            config, max_model_len=max_len, scheduler_block_size=a.block_size,
            hash_block_size=a.block_size, enable_caching=True, enable_kv_cache_events=a.events,
        )
        # the client's SamplingParams arrive with the request; built once here, outside timing
        self.sampling = SamplingParams(max_tokens=a.gen_tokens)
        self.t = dict(admit=0.0, decode=0.0, finish=0.0)
        self.hit_tokens = self.prompt_tokens = self.stored_blocks = 0
        self.hits: list[int] = []

    def wave(self, start, wave, clock):
        m, a, Request = self.m, self.a, self.Request
        t0 = clock()
        m.new_step_starts()
        reqs = []
        for i, (_, prompt, _) in enumerate(wave):
            req = Request(str(start + i), prompt, self.sampling, None, block_hasher=self.block_hasher)
            blocks, hit, _ = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
                raise RuntimeError("vLLM: the pool cannot hold the wave (raise --num-blocks)")
            req.num_computed_tokens = req.num_tokens
            reqs.append(req)
            self.hit_tokens += hit
            self.hits.append(hit)
            self.prompt_tokens += len(prompt)
        m.take_new_block_ids()
        t1 = clock()
        for step in range(a.gen_tokens):
            m.new_step_starts()
            for req, (_, _, gen) in zip(reqs, wave, strict=True):
                req.append_output_token_ids(gen[step])
                if m.allocate_slots(req, 1) is None:
                    raise RuntimeError("vLLM: out of blocks during decode")
                req.num_computed_tokens += 1
            m.take_new_block_ids()
        t2 = clock()
        for req in reqs:
            m.free(req)
        if a.events:
            for e in m.take_events():
                self.stored_blocks += len(getattr(e, "block_hashes", ()) or ()) if type(e).__name__ == "BlockStored" else 0
        t3 = clock()
        self.t["admit"] += t1 - t0
        self.t["decode"] += t2 - t1
        self.t["finish"] += t3 - t2

    def result(self) -> dict:
        return dict(
            admit_s=self.t["admit"], decode_s=self.t["decode"], finish_s=self.t["finish"],
            hit_rate=self.hit_tokens / self.prompt_tokens, stored_blocks=self.stored_blocks,
        )
