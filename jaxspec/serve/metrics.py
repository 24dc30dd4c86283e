"""The server's Prometheus metrics: per-request counters and latency histograms recorded as requests end, and
the engine's own counters (scheduler, KV pool, prefix cache, speculation) read from `Engine.stats()` at each
scrape."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                         0.05, 0.1, 0.25, 0.5, 1.0)


class EngineCollector:
    """Engine counters and gauges, read when Prometheus scrapes."""

    def __init__(self, engine, model_name: str):
        self.engine, self.labels = engine, {"model_name": model_name}

    def _metric(self, family, name: str, doc: str, value: float):
        m = family(name, doc, labels=list(self.labels))
        m.add_metric(list(self.labels.values()), value)
        return m

    def collect(self):
        s = self.engine.stats()
        g, c = GaugeMetricFamily, CounterMetricFamily
        used = s["num_kv_blocks"] - s["free_kv_blocks"]
        yield self._metric(g, "jaxspec:num_requests_running", "Requests holding a slot.", s["num_running"])
        yield self._metric(g, "jaxspec:num_requests_waiting", "Requests waiting for a slot.", s["num_waiting"])
        yield self._metric(g, "jaxspec:kv_cache_usage_perc", "Share of KV blocks held by requests.",
                           used / s["num_kv_blocks"])
        yield self._metric(c, "jaxspec:num_preemptions", "Requests preempted for KV room.", s["num_preemptions"])
        yield self._metric(c, "jaxspec:engine_steps", "Steps the engine dispatched.", s["steps"])
        pc = s["prefix_cache"]
        yield self._metric(c, "jaxspec:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           pc["queried_tokens"])
        yield self._metric(c, "jaxspec:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           pc["hit_tokens"])
        yield self._metric(g, "jaxspec:prefix_cache_blocks", "KV blocks registered in the prefix cache.",
                           pc["cached_blocks"])
        if "spec" in s:
            sp = s["spec"]
            yield self._metric(c, "jaxspec:spec_decode_num_drafts", "Verification steps with drafts.", sp["drafts"])
            yield self._metric(c, "jaxspec:spec_decode_num_draft_tokens", "Draft tokens verified.",
                               sp["draft_tokens"])
            yield self._metric(c, "jaxspec:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                               sp["accepted_tokens"])


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("jaxspec:request_success", "Finished requests, by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("jaxspec:prompt_tokens", "Prompt tokens of finished requests (each prompt "
                                     "once, whatever its number of completions n).", labels, registry=self.registry)
        self.generation_tokens = Counter("jaxspec:generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry)
        self.ttft = Histogram("jaxspec:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("jaxspec:time_per_output_token_seconds", "Mean time per output token after the first.",
                              labels, buckets=TOKEN_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("jaxspec:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(EngineCollector(engine, model_name))

    def record(self, completion):
        """A completion (CompletionOutput, whole) ended."""
        m, name = completion.metrics, self.model_name
        self.requests.labels(name, completion.finish_reason or "abort").inc()
        self.generation_tokens.labels(name).inc(m["num_output_tokens"])
        if m["ttft"] is not None:
            self.ttft.labels(name).observe(m["ttft"])
        if m["tpot"] is not None:
            self.tpot.labels(name).observe(m["tpot"])
        self.e2e.labels(name).observe(m["e2e_latency"])

    def record_prompts(self, num_tokens: int):
        """An HTTP request ended: its prompts' tokens, each prompt once (its n completions share it)."""
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)
