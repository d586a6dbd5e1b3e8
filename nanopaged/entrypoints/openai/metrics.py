"""The server's Prometheus metrics (GET /metrics), named as vLLM's with a `nanopaged:` prefix.

Two kinds. The engine's state (queues, KV blocks, the prefix cache, preemptions,
generated tokens) is read from `AsyncLLM.get_stats()` at scrape time by a collector, so
it is never stale and never double counted. Per-request latencies (time to first token,
inter-token latency, end to end) and the prompt tokens served are measured by the server
around `generate` and kept in histograms and a counter. Each app has its own registry,
so two apps in one process (tests) never share series.
vLLM: `vllm/v1/metrics/loggers.py` (PrometheusStatLogger).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets (seconds) for time to first token and inter-token latency
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineCollector:
    """Gauges and counters read from engine.get_stats() when Prometheus scrapes."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.get_stats()
        label = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"nanopaged:{name}", doc, labels=["model_name"])
            g.add_metric(label, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"nanopaged:{name}", doc, labels=["model_name"])
            c.add_metric(label, value)
            return c

        total, free = s["num_total_gpu_blocks"], s["num_free_gpu_blocks"]
        queries, hits = s["prefix_cache_queries"], s["prefix_cache_hits"]
        yield gauge("num_requests_running", "Requests in the running batch.", s["num_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"])
        yield gauge("num_requests_swapped", "Requests swapped out to the CPU pool.", s.get("num_swapped", 0))
        yield gauge("kv_cache_blocks_used", "KV blocks in use in the device pool.", total - free)
        yield gauge("kv_cache_blocks_total", "KV blocks in the device pool.", total)
        yield gauge("kv_cache_usage_perc", "Fraction of device KV blocks in use (0..1).",
                    (total - free) / total if total else 0.0)
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens since start (0..1).",
                    hits / queries if queries else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield counter("num_preemptions", "Preemptions (swap or recompute).", s["num_preemptions"])
        yield counter("generation_tokens", "Tokens generated.", s["num_generated_tokens"])
        # speculative decoding (vLLM's spec_decode_* series; 0 when it is off)
        yield counter("spec_decode_num_drafts", "Verify steps: a sequence checking its drafts.",
                      s.get("spec_decode_num_drafts", 0))
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed and checked.",
                      s.get("spec_decode_num_draft_tokens", 0))
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens the model accepted.",
                      s.get("spec_decode_num_accepted_tokens", 0))
        yield gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start (0..1).",
                    s.get("spec_decode_acceptance_rate", 0.0))


class ServerMetrics:
    """One app's registry: the engine collector plus the server-side measurements.

    Args:
        engine: an AsyncLLM (anything with get_stats()).
        model_name: the served model name, the `model_name` label of every series.
    """

    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()         # a server feature adds its collector (its mount)
        self.registry.register(_EngineCollector(engine, model_name))
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.prompt_tokens = Counter("nanopaged:prompt_tokens", "Prompt tokens of requests served.",
                                     **kw).labels(model_name)
        self.ttft = Histogram("nanopaged:time_to_first_token_seconds",
                              "Seconds from request arrival to its first output.",
                              buckets=_TTFT_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram("nanopaged:inter_token_latency_seconds",
                             "Seconds between two outputs of one request.",
                             buckets=_ITL_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram("nanopaged:e2e_request_latency_seconds",
                             "Seconds from request arrival to its last output.",
                             buckets=_E2E_BUCKETS, **kw).labels(model_name)
