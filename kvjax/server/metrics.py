"""The server's Prometheus metrics (one registry per server).

Only the engine thread writes them (`publish` after every step, `request_*` as requests move),
from the ledger and the engine's counters it owns; `/metrics` only renders the registry, so an
HTTP handler never reads the ledger. Counters are cumulative since the server started;
ledger totals are published as increments of the last values seen.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ("model_name",)
        self.model_name = model_name

        def gauge(name, doc, extra=()):
            return Gauge(name, doc, labels + extra, registry=r)

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + extra, registry=r)

        self.blocks_used = gauge(
            "kvjax_kv_blocks_used",
            "KV cache blocks referenced by requests (primary) or holding offloaded KV (secondary)",
            ("tier",),
        )
        self.blocks_free = gauge(
            "kvjax_kv_blocks_free",
            "KV cache blocks free for allocation (cached but unreferenced blocks count as free)",
            ("tier",),
        )
        self.running = gauge("kvjax_num_requests_running", "Requests in the ledger (prefill or decode)")
        self.waiting = gauge("kvjax_num_requests_waiting", "Requests queued for admission (new or paused)")
        self.hit_rate = gauge(
            "kvjax_prefix_cache_hit_rate", "Prompt tokens reused from the prefix cache / prompt tokens admitted, since start"
        )
        self.block_hit_rate = gauge(
            "kvjax_prefix_cache_block_hit_rate", "Ledger block hit rate: reused / (reused + missed) blocks, since start"
        )
        self.reused = counter("kvjax_prompt_tokens_reused", "Prompt tokens whose KV came from the prefix cache")
        self.computed = counter("kvjax_prompt_tokens_computed", "Prompt tokens run through the model (prefill)")
        self.generated = counter("kvjax_generation_tokens", "Tokens generated")
        self.offloaded = counter("kvjax_kv_blocks_offloaded", "Blocks copied from device to host memory")
        self.onboarded = counter("kvjax_kv_blocks_onboarded", "Blocks copied back from host to device memory")
        self.evicted = counter("kvjax_kv_blocks_evicted", "Cached blocks evicted")
        self.finished = counter("kvjax_requests_finished", "Requests finished, by finish reason", ("finish_reason",))
        self.rejected = counter("kvjax_requests_rejected", "Requests refused before reaching the engine", ("reason",))
        self.resets = counter("kvjax_prefix_cache_resets", "Prefix cache resets")
        # disaggregated prefill/decode (kvjax.engine.remote_kv); 0 without --kv-transfer-config
        self.kv_received = counter("kvjax_kv_transfer_tokens_received",
                                   "Prompt tokens whose KV was pulled from a prefill engine (never computed here)")
        self.kv_offers = counter("kvjax_kv_transfer_offers", "Prompts whose KV this prefill engine offered")
        self.kv_pull_failures = counter("kvjax_kv_transfer_pull_failures", "KV pulls that failed or missed their deadline")
        # the third tier (--kv-store): series appear once an engine with a store publishes
        self.store_blocks = counter("kvjax_kv_store_blocks",
                                    "KV store (third tier) blocks by event: hit / miss (gets), lookup_hit, restored "
                                    "(into the host tier), written, write_failed, write_dropped (worker full)", ("event",))
        self.store_bytes = counter("kvjax_kv_store_bytes", "Bytes written to / read from the KV store", ("direction",))
        self.store_lookups = counter("kvjax_kv_store_lookups", "Requests that consulted the KV store")
        self.ttft = Histogram("kvjax_time_to_first_token_seconds", "From the request's arrival at the server to its first token",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kvjax_inter_token_latency_seconds", "Time between two tokens of a request", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvjax_e2e_request_latency_seconds", "From arrival to the last token", labels,
                             buckets=E2E_BUCKETS, registry=r)
        self._last: dict[str, int] = {}
        for metric in (self.running, self.waiting, self.hit_rate, self.block_hit_rate, self.reused, self.computed,
                       self.generated, self.offloaded, self.onboarded, self.evicted, self.resets, self.ttft, self.itl, self.e2e,
                       self.kv_received, self.kv_offers, self.kv_pull_failures):
            metric.labels(model_name)  # every series exists (at 0) from the start
        for tier in ("primary", "secondary"):
            self.blocks_used.labels(model_name, tier)
            self.blocks_free.labels(model_name, tier)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(model_name, reason)
        for reason in ("queue_full", "invalid", "shutting_down"):
            self.rejected.labels(model_name, reason)

    def _inc(self, counter, key: str, value: int) -> None:
        delta = value - self._last.get(key, 0)
        if delta > 0:
            counter.labels(self.model_name).inc(delta)
        self._last[key] = value

    def publish(self, core) -> None:
        """Gauges and counters from the engine core and its ledger (engine thread only)."""
        m = self.model_name
        st = core.ledger.stats()
        self.blocks_used.labels(m, "primary").set(st.used_num_blocks)
        self.blocks_free.labels(m, "primary").set(st.free_num_blocks)
        self.blocks_used.labels(m, "secondary").set(st.max_secondary_blocks - st.free_secondary_blocks)
        self.blocks_free.labels(m, "secondary").set(st.free_secondary_blocks)
        self.running.labels(m).set(core.num_running)
        self.waiting.labels(m).set(core.num_waiting)
        c = core.counters
        self.hit_rate.labels(m).set(c.reused_prompt_tokens / c.admitted_prompt_tokens if c.admitted_prompt_tokens else 0.0)
        self.block_hit_rate.labels(m).set(st.cache_hit_rate)
        self._inc(self.reused, "reused", c.reused_prompt_tokens)
        self._inc(self.computed, "computed", c.computed_prompt_tokens)
        self._inc(self.generated, "generated", c.generated_tokens)
        self._inc(self.offloaded, "offloaded", st.offloaded_blocks)
        self._inc(self.onboarded, "onboarded", st.onboarded_blocks)
        self._inc(self.evicted, "evicted", st.evicted_blocks)
        remote = getattr(core, "remote_kv", None)
        if remote is not None:
            rc = remote.counters
            self._inc(self.kv_received, "kv_received", rc.transferred_tokens)
            self._inc(self.kv_offers, "kv_offers", rc.offers)
            self._inc(self.kv_pull_failures, "kv_pull_failures", rc.pull_failures)
        if core.store_tier is not None:
            self._publish_store(core.store_tier.stats())

    #: `StoreTierDriver.stats()` keys -> (metric attribute, label value or None)
    _STORE_SERIES = {
        "store_hits": ("store_blocks", "hit"), "store_misses": ("store_blocks", "miss"),
        "driver_lookup_hit_blocks": ("store_blocks", "lookup_hit"), "driver_restored_blocks": ("store_blocks", "restored"),
        "store_puts": ("store_blocks", "written"), "store_put_failures": ("store_blocks", "write_failed"),
        "puts_dropped": ("store_blocks", "write_dropped"), "store_bytes_written": ("store_bytes", "written"),
        "store_bytes_read": ("store_bytes", "read"), "driver_lookups": ("store_lookups", None),
    }

    def _publish_store(self, stats: dict[str, int]) -> None:
        for key, (attr, label) in self._STORE_SERIES.items():
            if key not in stats:  # a user store without StoreStats
                continue
            metric = getattr(self, attr)
            series = metric.labels(self.model_name) if label is None else metric.labels(self.model_name, label)
            delta = stats[key] - self._last.get(key, 0)
            if delta > 0:
                series.inc(delta)
            else:
                series.inc(0)  # the series exists from the first publish
            self._last[key] = stats[key]

    def request_tokens(self, first: bool, since_last: float, new_tokens: int) -> None:
        """A request produced `new_tokens` tokens `since_last` seconds after its arrival
        (`first`) or its previous tokens."""
        if first:
            self.ttft.labels(self.model_name).observe(since_last)
        elif new_tokens:
            per = since_last / new_tokens
            for _ in range(new_tokens):
                self.itl.labels(self.model_name).observe(per)

    def request_finished(self, reason: str, latency: float) -> None:
        self.finished.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(latency)

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
