"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Counters and histograms the HTTP layer updates per request; gauges read the scheduler."""

    def __init__(self, scheduler):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("unmask_requests", "Requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("unmask_prompt_tokens", "Prompt tokens of completed requests", registry=r)
        self.completion_tokens = Counter("unmask_completion_tokens", "Generated tokens of completed requests", registry=r)
        self.nfe = Counter("unmask_nfe", "Model forwards in which a completed request had work (NFE)", registry=r)
        self.tpf = Histogram("unmask_tpf", "Tokens per forward of each completed request",
                             buckets=(0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.tps = Histogram("unmask_tps", "Tokens per second of each completed request (end to end)",
                             buckets=(1, 10, 50, 100, 250, 500, 1000, 2500, 5000), registry=r)
        self.ttft = Histogram("unmask_time_to_first_token_seconds", "Time from arrival to the first committed token",
                              buckets=_LATENCY, registry=r)
        self.latency = Histogram("unmask_request_seconds", "Time from arrival to the last token", buckets=_LATENCY,
                                 registry=r)
        Gauge("unmask_queue_depth", "Requests waiting to start", registry=r).set_function(lambda: scheduler.queue_depth)
        Gauge("unmask_running_batch_size", "Rows in the batch being decoded now",
              registry=r).set_function(lambda: scheduler.active)
        Gauge("unmask_active_requests", "Requests holding a batch slot",
              registry=r).set_function(lambda: scheduler.active)
        r.register(_Drafts(scheduler))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Drafts:
    """Drafted and accepted tokens per draft source of the AR / lossless rows (``block``, ``lookup``,
    ``suffix``; spec/draft_sources.md) and the suffix cache's size, read from the scheduler."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        drafted = CounterMetricFamily("unmask_draft_tokens", "Draft tokens the verify forwards checked, by draft source",
                                      labels=["source"])
        accepted = CounterMetricFamily("unmask_draft_accepted_tokens", "Draft tokens the verify forwards accepted, by "
                                       "draft source", labels=["source"])
        for source, n in self.scheduler.draft_tally.as_dict().items():
            drafted.add_metric([source], n["drafted"])
            accepted.add_metric([source], n["accepted"])
        cache = self.scheduler.suffix_cache
        size = GaugeMetricFamily("unmask_suffix_cache_tokens", "Token ids held by the suffix-decoding cache of recent "
                                 "requests (bounded by --suffix-cache)")
        size.add_metric([], cache.tokens if cache is not None else 0)
        return [drafted, accepted, size]
