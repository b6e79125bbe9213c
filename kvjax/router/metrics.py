"""The router front's Prometheus metrics (one registry per router).

Counters move as requests are routed; the per-replica gauges (availability, requests in
flight, blocks in the index) and the KV-event counters (batches, gaps, lost batches,
restarts) are read from the replica set when `/metrics` is scraped, so they are never stale.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

OVERLAP_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


class _ReplicaCollector:
    def __init__(self, replicas) -> None:
        self.replicas = replicas  # a ReplicaSet

    def collect(self):
        rs = self.replicas
        available = GaugeMetricFamily("kvjax_router_replica_available", "1 while the replica is routed to", labels=["replica"])
        in_flight = GaugeMetricFamily(
            "kvjax_router_replica_requests_in_flight", "Requests routed to the replica and not finished", labels=["replica"]
        )
        blocks = GaugeMetricFamily("kvjax_router_index_blocks", "Cached blocks the router's index holds for the replica "
                                   "(learned from its KV events)", labels=["replica"])
        restarts = CounterMetricFamily("kvjax_router_replica_restarts", "Replica restarts seen by health checks",
                                       labels=["replica"])
        downs = CounterMetricFamily("kvjax_router_replica_marked_down", "Times the replica was taken out of routing",
                                    labels=["replica"])
        ev = {k: CounterMetricFamily(f"kvjax_router_kv_event_{k}", doc, labels=["replica"]) for k, doc in (
            ("batches", "KV-event batches applied to the index (live or replayed)"),
            ("replayed_batches", "KV-event batches recovered through the replica's replay socket"),
            ("gaps", "Jumps in the replica's KV-event sequence numbers"),
            ("unrecovered_gaps", "Gaps that replay could not fill (the replica's blocks were forgotten)"),
            ("missed_batches", "KV-event batches lost for good"),
            ("stream_restarts", "Times the replica's event sequence went back (a restarted publisher)"),
        )}
        for url, rep in rs.replicas.items():
            available.add_metric([url], 1.0 if rep.available else 0.0)
            in_flight.add_metric([url], rs.router.loads[url])
            blocks.add_metric([url], rs.router.index.num_blocks(url))
            restarts.add_metric([url], rep.restarts)
            downs.add_metric([url], rep.marked_down)
            st = rep.event_stats()
            for key, stat in (("batches", "received"), ("replayed_batches", "replayed"), ("gaps", "gaps"),
                              ("unrecovered_gaps", "unrecovered_gaps"), ("missed_batches", "missed_batches"),
                              ("stream_restarts", "restarts")):
                ev[key].add_metric([url], st[stat])
        yield from (available, in_flight, blocks, restarts, downs, *ev.values())


class RouterMetrics:
    def __init__(self, replicas) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("kvjax_router_requests_routed", "Requests sent to each replica (a retry counts again)",
                              ["replica"], registry=r)
        self.prompt_tokens = Counter("kvjax_router_prompt_tokens", "Prompt tokens of the requests sent to each replica",
                                     ["replica"], registry=r)
        self.predicted = Counter("kvjax_router_predicted_cached_tokens",
                                 "Prompt tokens the index said the chosen replica had cached, at routing time",
                                 ["replica"], registry=r)
        self.overlap = Histogram("kvjax_router_predicted_overlap", "Share of each routed prompt predicted to be cached "
                                 "on the chosen replica", buckets=OVERLAP_BUCKETS, registry=r)
        self.retried = Counter("kvjax_router_requests_retried", "Requests sent again elsewhere after a replica could not "
                               "take them (nothing had been streamed yet)", ["replica", "reason"], registry=r)
        self.failed = Counter("kvjax_router_requests_failed", "Requests the router could not place or finish",
                              ["reason"], registry=r)
        self.pd_prefills = Counter("kvjax_router_pd_prefills", "P/D mode: prefill steps answered, with or without "
                                   "kv_transfer_params for the decode step", ["outcome"], registry=r)
        r.register(_ReplicaCollector(replicas))
        for url in replicas.replicas:
            for c in (self.routed, self.prompt_tokens, self.predicted):
                c.labels(url)
        for outcome in ("with_kv", "without_kv"):
            self.pd_prefills.labels(outcome)
        for reason in ("no_replica", "stream_broken", "timeout"):
            self.failed.labels(reason)

    def request_routed(self, replica: str, prompt_tokens: int, predicted_tokens: int) -> None:
        self.routed.labels(replica).inc()
        self.prompt_tokens.labels(replica).inc(prompt_tokens)
        self.predicted.labels(replica).inc(predicted_tokens)
        if prompt_tokens:
            self.overlap.observe(min(1.0, predicted_tokens / prompt_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)
