"""The server's Prometheus metrics (prometheus-client), in a registry of the app's own.

Latencies and counts are observed by the engine loop as requests progress and applied here
when its step's message lands (engine_client.py); the engine's state (requests running and
waiting, cache pages, prefix-cache counters, speculation) is the snapshot that message
carries (`EngineSnapshot`), read by a collector at scrape time, so a scrape never touches the
engine's structures while a step changes them. The KV tiers' counters (per tier: hits,
misses, bytes, evictions, expirations, prefetch latency) are read at scrape time from the
tiers' own locked counters (host/kv_tiers/), or, with the engine in a process of its own,
from the latest reports it shipped."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from deepinfer_jax.api.server.messages import EngineSnapshot

# seconds: from a few ms (a decode step on a GPU) to minutes (a long queue on a CPU)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)


class _EngineCollector:
    def __init__(self):
        self.snapshot = EngineSnapshot()
        # the KV tiers' reports by tier (TierWorker.stats), or None: no tiers configured
        self.kv_tiers: Callable[[], dict] | None = None

    def collect(self):
        s = self.snapshot
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch", s.running),
                ("num_requests_waiting", "Requests waiting to join the batch", s.waiting),
                ("cache_pages_total", "Pages of the KV cache pool", s.pages_total),
                ("cache_pages_free", "Free pages of the KV cache pool", s.pages_free),
                ("cache_pages_used", "Pages of the KV cache pool in use (sequences and "
                 "prefix-cache blocks)", s.pages_total - s.pages_free)):
            yield GaugeMetricFamily("deepinfer_" + name, doc, value=value)
        for name, doc, value in (
                ("prefix_cache_queries", "Admissions that looked the prefix cache up",
                 s.prefix_queries),
                ("prefix_cache_hits", "Admissions that reused a cached block", s.prefix_hits),
                ("prefix_cache_hit_tokens", "Prompt tokens not computed thanks to the prefix "
                 "cache", s.prefix_hit_tokens),
                ("spec_decode_draft_tokens", "Speculative draft tokens verified", s.spec_drafted),
                ("spec_decode_accepted_tokens", "Speculative draft tokens accepted",
                 s.spec_accepted),
                ("engine_steps", "Engine steps launched", s.steps)):
            yield CounterMetricFamily("deepinfer_" + name, doc, value=value)
        if self.kv_tiers is not None:
            yield from kv_tier_families(self.kv_tiers())


# (name, help, TierStats field) of the per-tier counters and gauges
_TIER_COUNTERS = (
    ("hits", "Block sets served by the tier", "hits"),
    ("misses", "Lookups the tier could not serve", "misses"),
    ("bytes_in", "Bytes stored into the tier (disk: whole files)", "bytes_written"),
    ("bytes_out", "Bytes served from the tier (disk: whole files)", "bytes_read"),
    ("evictions", "Block sets pushed out by the tier's byte budget", "evictions"),
    ("expirations", "Block sets dropped after the retention time unused", "expirations"),
    ("corrupt_dropped", "Tier files that failed their checks (never served)", "corrupt_dropped"),
    ("write_errors", "Tier writes that failed (not kept)", "write_errors"))
_TIER_GAUGES = (("entries", "Block sets the tier holds", "entries"),
                ("bytes", "Bytes the tier holds", "bytes"))


def kv_tier_families(reports: dict) -> list:
    """Prometheus families of the KV tiers' reports ({tier: TierReport}), labelled by tier."""
    families = []
    for suffix, doc, field in _TIER_COUNTERS:
        family = CounterMetricFamily("deepinfer_kv_tier_" + suffix, doc, labels=["tier"])
        for tier, report in reports.items():
            family.add_metric([tier], getattr(report.counters, field))
        families.append(family)
    for suffix, doc, field in _TIER_GAUGES:
        family = GaugeMetricFamily("deepinfer_kv_tier_" + suffix, doc, labels=["tier"])
        for tier, report in reports.items():
            family.add_metric([tier], getattr(report.counters, field))
        families.append(family)
    latency = HistogramMetricFamily(
        "deepinfer_kv_tier_prefetch_latency_seconds", "From a block set asked for to its being "
        "in host memory, ready for its device copy", labels=["tier"])
    quantiles = GaugeMetricFamily("deepinfer_kv_tier_prefetch_latency_quantile_seconds",
                                  "Prefetch latency quantiles over the recent block sets",
                                  labels=["tier", "quantile"])
    for tier, report in reports.items():
        lat = report.prefetch_latency
        buckets = [("+Inf" if b == float("inf") else repr(b), c) for b, c in lat.buckets]
        latency.add_metric([tier], buckets, lat.sum_s)
        for q, value in (("0.5", lat.p50_s), ("0.99", lat.p99_s)):
            if value is not None:
                quantiles.add_metric([tier, q], value)
    return [*families, latency, quantiles]


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector()
        self.registry.register(self.engine)
        r = self.registry
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds",
                              "From the request's arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("deepinfer_inter_token_latency_seconds",
                             "Between a request's consecutive tokens", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds",
                             "From the request's arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of admitted "
                                     "requests", registry=r)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Tokens generated",
                                         registry=r)
        self.finished = Counter("deepinfer_request_success", "Requests finished, by reason",
                                ["finished_reason"], registry=r)
        self.errors = Counter("deepinfer_request_errors", "Requests refused or failed, by kind",
                              ["kind"], registry=r)
        self.aborted = Counter("deepinfer_requests_aborted", "Requests aborted because their "
                               "client went away", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
