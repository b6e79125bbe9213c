"""SGLang's `RadixCache` driven the way SGLang's scheduler drives it, on the ledger trace.

The cache is built as the scheduler builds it: a `ReqToTokenPool` (one row of KV slot indices
per running request), a `PagedTokenToKVPoolAllocator` over `num_blocks` pages of `block_size`
tokens (page 0 reserved, as SGLang reserves it), and the radix tree over both, LRU eviction.
Per wave (one extend batch admits the whole wave; then one decode batch per generated token):
  admit   per request (one extend batch each): `match_prefix` on the prompt capped at len - 1
          (as `match_kv_cache` does), `lock` the matched node, take a row, `evict_to_free_tokens`
          (the allocator evicts from the tree when short), `alloc_extend`, the prefix and the
          new slots written into the row; after the forward, `checkpoint(req, up_to=prompt)`
          (what `cache_unfinished_req` is in this version: insert, free the duplicate slots,
          re-match, re-point the row, move the lock);
  decode  per step `evict_to_free_tokens`, `alloc_decode` for the batch, the new slots written
          into the rows;
  finish  per request `checkpoint(req, up_to=prompt + generated)`, `free_kv_row` for the part
          the tree does not own, `unlock`, the row back (`release_kv_cache`'s steps).
KV events on with --events (`enable_kv_cache_events`, drained with `take_events()` each wave).
The request records carry only the fields these calls read; nothing else of the scheduler runs.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from array import array

_TORCHVISION = None  # how torchvision was found, once per process


def _import_without_torchvision():
    """Import the radix cache where torchvision is not installed.

    `sglang.srt.mem_cache` imports `sglang.srt.configs`, whose package imports every model
    config, one of which imports torchvision at module level (an image transform never used by
    the cache). A CPU torchvision from the PyTorch CPU index satisfies it; without one, what that
    import takes from `torchvision` is an inert placeholder (the finder that makes them is in
    place for that import only, and is installed after transformers has recorded torchvision as
    absent, so no library takes a placeholder for a real torchvision). Nothing the benchmark
    calls reaches them. Returns how torchvision was found, decided once per process.
    """
    global _TORCHVISION
    if _TORCHVISION is None:
        _TORCHVISION = _find_or_stand_in_for_torchvision()
    return _TORCHVISION


def _find_or_stand_in_for_torchvision():
    try:
        import torchvision  # noqa: F401

        return "installed"
    except Exception:
        sys.modules.pop("torchvision", None)

    class Placeholder:
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self

        def __call__(self, *args, **kwargs):
            return self

    def module_attr(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder()

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            m = types.ModuleType(spec.name)
            m.__path__ = []
            m.__getattr__ = module_attr
            return m

        def exec_module(self, module):
            pass

    import transformers.utils.import_utils  # noqa: F401  (records torchvision as absent)

    finder = Finder()
    sys.meta_path.insert(0, finder)
    try:
        import sglang.srt.mem_cache.radix_cache  # noqa: F401
    finally:
        sys.meta_path.remove(finder)
    return "placeholder (not installed)"


class _Kv:
    """The request's KV record: the fields `checkpoint` and `free_kv_row` read."""

    __slots__ = ("req_pool_idx", "cache_protected_len", "cache_inserted_len", "swa_evict_floor")

    def __init__(self, row: int):
        self.req_pool_idx = row
        self.cache_protected_len = 0
        self.cache_inserted_len = 0
        self.swa_evict_floor = 0

    def get_evicted_seqlen(self, _component) -> int:
        return 0

    def swa_dead_lo(self, _page_size) -> int:
        return 0


class _Req:
    """The request: the fields `checkpoint` reads, and the lock it moves."""

    __slots__ = ("kv", "full_untruncated_fill_ids", "origin_input_ids", "extra_key", "cache_salt",
                 "priority", "lock", "last_node", "seq_len")

    def __init__(self, row: int, prompt: array):
        self.kv = _Kv(row)
        self.origin_input_ids = prompt
        self.full_untruncated_fill_ids = array("q", prompt)
        self.extra_key = None
        self.cache_salt = None
        self.priority = 0
        self.lock = None
        self.last_node = None
        self.seq_len = len(prompt)


class SglangDriver:
    name = "sglang_radix_cache"

    def __init__(self, a):
        self.torchvision = _import_without_torchvision()
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.torch, self.RadixKey, self.MatchPrefixParams = torch, RadixKey, MatchPrefixParams
        self.a = a
        B = a.block_size
        max_len = a.system_tokens + a.unique_tokens + a.gen_tokens + B
        self.rows = ReqToTokenPool(size=a.concurrency, max_context_len=max_len, device="cpu", enable_memory_saver=False)
        # num_blocks pages of B slots; the allocator hands out pages 1..num_blocks-1
        self.alloc = PagedTokenToKVPoolAllocator(
            size=(a.num_blocks - 1) * B, page_size=B, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False,
        )
        self.cache = RadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc, page_size=B,
            enable_kv_cache_events=a.events,
        ))
        self.t = dict(admit=0.0, decode=0.0, finish=0.0)
        self.hit_tokens = self.prompt_tokens = self.stored_blocks = 0
        self.hits: list[int] = []

    def _reserve(self, num_tokens: int) -> None:
        self.alloc.evict_to_free_tokens(self.cache, num_tokens)

    def wave(self, start, wave, clock):
        torch, cache, alloc, rows, a = self.torch, self.cache, self.alloc, self.rows, self.a
        table = rows.req_to_token
        t0 = clock()
        reqs = []
        for _, prompt, _ in wave:
            # one extend batch per request, so each sees what the one before it inserted (as
            # kvjax's and vLLM's admissions do; SGLang's scheduler gets the same effect by
            # deferring a request whose prefix an earlier one of its batch is computing)
            tokens = array("q", prompt)
            match = cache.match_prefix(self.MatchPrefixParams(
                key=self.RadixKey(tokens, None, limit=len(tokens) - 1)))
            req = _Req(rows.alloc_rows(1)[0], tokens)
            req.last_node = match.last_device_node
            req.lock = cache.lock(req.last_node)
            hit = match.device_prefix_len
            row = req.kv.req_pool_idx
            req.kv.cache_protected_len = hit
            table[row, :hit] = cache.path_device_indices(req.last_node)
            n = req.seq_len - hit
            self._reserve(n + a.block_size)
            prefix = torch.tensor([hit], dtype=torch.int64)
            seq = torch.tensor([req.seq_len], dtype=torch.int64)
            last_loc = table[row, hit - 1 : hit].to(torch.int64) if hit else torch.tensor([-1], dtype=torch.int64)
            out = alloc.alloc_extend(prefix, prefix, seq, seq, last_loc, n)
            if out is None:
                raise RuntimeError("SGLang: the pool cannot hold the wave (raise --num-blocks)")
            table[row, hit : req.seq_len] = out.to(table.dtype)
            cache.checkpoint(req, up_to=req.seq_len)  # after the forward: cache_unfinished_req
            reqs.append(req)
            self.hit_tokens += hit
            self.hits.append(hit)
            self.prompt_tokens += len(prompt)
        row_ids = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        seq = torch.tensor([r.seq_len for r in reqs], dtype=torch.int64)
        t1 = clock()
        for step in range(a.gen_tokens):
            seq += 1
            self._reserve(len(reqs) * a.block_size)
            last_loc = table[row_ids, seq - 2].to(torch.int64)
            out = alloc.alloc_decode(seq, seq, last_loc)
            if out is None:
                raise RuntimeError("SGLang: out of pages during decode")
            table[row_ids, seq - 1] = out.to(table.dtype)
            for req, (_, _, gen) in zip(reqs, wave, strict=True):
                req.full_untruncated_fill_ids.append(gen[step])
                req.seq_len += 1
        t2 = clock()
        for req in reqs:
            cache.checkpoint(req, up_to=req.seq_len)
            cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, req.seq_len)])
            cache.unlock(req.lock)
            req.lock = None
            rows.free_rows([req.kv.req_pool_idx])
        if a.events:
            for e in cache.take_events():
                if type(e).__name__ == "BlockStored":
                    self.stored_blocks += len(e.block_hashes)
        t3 = clock()
        self.t["admit"] += t1 - t0
        self.t["decode"] += t2 - t1
        self.t["finish"] += t3 - t2

    def result(self) -> dict:
        return dict(
            admit_s=self.t["admit"], decode_s=self.t["decode"], finish_s=self.t["finish"],
            hit_rate=self.hit_tokens / self.prompt_tokens, stored_blocks=self.stored_blocks,
            cached_tokens_at_end=self.cache.evictable_size() + self.cache.protected_size(),
            torchvision=self.torchvision,
        )
