"""The floor: the least bookkeeping a paged prefix cache can do, as a yardstick for the ledger.

A block pool, a dict from chained block hashes (Python's built-in `hash`) to cached blocks, and
an LRU of cached blocks nobody references. Nothing else: no priorities, no host tier, no events,
no windows, no beams, no validation, no partial-block reuse. kvjax's ledger does all of those,
so its speed is judged as a fraction of this one's on the same trace in the same run
(`benchmarks/ledger_bench.py`). It is a measuring stick, not a design to copy: a built-in hash
can collide, and it trusts every input.
"""
from __future__ import annotations

from collections import OrderedDict


class FloorCache:
    """`admit` a prompt (returns the cached prefix length in tokens), `append` one token at a
    time, `release` when done. Full blocks are cached as soon as they fill."""

    def __init__(self, tokens_per_block: int, num_blocks: int):
        self.tpb = tokens_per_block
        self.free = list(range(num_blocks))  # blocks holding nothing reusable
        self.by_hash: dict[int, int] = {}    # chained hash -> cached block
        self.hash_of = [None] * num_blocks   # block -> its chained hash, None if not cached
        self.refs = [0] * num_blocks
        self.idle = OrderedDict()            # cached blocks with refs == 0, least recent first
        self.live: dict[int, list] = {}      # request -> [tokens, blocks, hash of its last full block]
        self.evicted = 0

    def _take_block(self) -> int:
        if self.free:
            b = self.free.pop()
        else:
            b, _ = self.idle.popitem(last=False)
            del self.by_hash[self.hash_of[b]]
            self.hash_of[b] = None
            self.evicted += 1
        self.refs[b] = 1
        return b

    def _publish(self, b: int, h: int) -> None:
        """Make block `b` findable under `h`, unless an equal block already is."""
        if h not in self.by_hash:
            self.by_hash[h] = b
            self.hash_of[b] = h

    def admit(self, rid, prompt) -> int:
        tpb, blocks, h = self.tpb, [], None
        # reuse: walk full blocks of prompt[:-1] (the last token is always recomputed)
        for start in range(0, len(prompt) - tpb, tpb):
            nh = hash((h, tuple(prompt[start : start + tpb])))
            b = self.by_hash.get(nh)
            if b is None:
                break
            if self.refs[b] == 0:
                del self.idle[b]
            self.refs[b] += 1
            blocks.append(b)
            h = nh
        hit = len(blocks) * tpb
        # fresh blocks for the rest, each full one published
        for start in range(hit, len(prompt), tpb):
            b = self._take_block()
            blocks.append(b)
            if start + tpb <= len(prompt):
                h = hash((h, tuple(prompt[start : start + tpb])))
                self._publish(b, h)
        self.live[rid] = [list(prompt), blocks, h]
        return hit

    def append(self, rid, token) -> None:
        st = self.live[rid]
        toks, blocks = st[0], st[1]
        toks.append(token)
        n = len(toks)
        if n > len(blocks) * self.tpb:
            blocks.append(self._take_block())
        if n % self.tpb == 0:
            st[2] = hash((st[2], tuple(toks[n - self.tpb :])))
            self._publish(blocks[-1], st[2])

    def release(self, rid) -> None:
        # tail first, so a chain's tail is evicted before its head
        for b in reversed(self.live.pop(rid)[1]):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.hash_of[b] is None:
                    self.free.append(b)
                else:
                    self.idle[b] = None

    def stats(self) -> dict:
        return {"evicted_blocks": self.evicted, "cached_blocks_at_end": len(self.by_hash)}


class FloorDriver:
    """Replays the benchmark's waves through `FloorCache`, timing each phase."""

    name = "floor"

    def __init__(self, a):
        self.a = a
        self.cache = FloorCache(a.block_size, a.num_blocks)
        self.t = dict(admit=0.0, decode=0.0, finish=0.0)
        self.hit_tokens = self.prompt_tokens = 0
        self.hits: list[int] = []  # cached prefix length of each request, in trace order

    def wave(self, start, wave, clock):
        cache = self.cache
        ids = range(start, start + len(wave))
        t0 = clock()
        for rid, (_, prompt, _) in zip(ids, wave, strict=True):
            hit = cache.admit(rid, prompt)
            self.hits.append(hit)
            self.hit_tokens += hit
            self.prompt_tokens += len(prompt)
        t1 = clock()
        for step in range(self.a.gen_tokens):
            for rid, (_, _, gen) in zip(ids, wave, strict=True):
                cache.append(rid, gen[step])
        t2 = clock()
        for rid in ids:
            cache.release(rid)
        t3 = clock()
        self.t["admit"] += t1 - t0
        self.t["decode"] += t2 - t1
        self.t["finish"] += t3 - t2

    def result(self) -> dict:
        return dict(
            admit_s=self.t["admit"], decode_s=self.t["decode"], finish_s=self.t["finish"],
            hit_rate=self.hit_tokens / self.prompt_tokens, hits=self.hits, **self.cache.stats(),
        )
