"""The server's Prometheus metrics: per-request counters and latency histograms recorded as requests end, and
the engine's own counters (scheduler, KV pool, prefix cache, speculation) read from `Engine.stats()` at each
scrape.

Each is exported twice: under jaxspec's names (`jaxspec:*`, label `model_name`) and under the names vLLM's v1
engine exports (`vllm:*`, labels `model_name` and `engine`, with vLLM's types and meanings), so that what reads a
vLLM server's /metrics (vLLM's Grafana dashboards, llm-d's inference scheduler, the Gateway API Inference
Extension's endpoint picker) reads a jaxspec server unmodified. prometheus_client writes a counter called `x` as
`x_total`, as vLLM's do (`vllm:request_success_total`, ...).

With LoRA (enable_lora), `vllm:lora_requests_info` is vLLM's: a gauge of the scrape's time whose labels say max_lora,
the adapters running requests hold (running_lora_adapters) and those of queued requests without a slot yet
(waiting_lora_adapters), comma-separated; `jaxspec:lora_requests_waiting` counts requests waiting for a slot.

Where the two differ in meaning, the vLLM twin follows vLLM:
- `vllm:prompt_tokens` counts a completion's prompt once per completion that produced a token (vLLM's n
  completions of a prompt are n engine requests, each prefilling it); `jaxspec:prompt_tokens` counts each prompt
  of an HTTP request once.
- `vllm:inter_token_latency_seconds` has one observation per engine step that gave a request tokens after its
  first (the gap since the previous such step; a speculative step's several tokens are one observation), as
  vLLM's; `jaxspec:time_per_output_token_seconds` is each request's mean.

vLLM metrics left out, because the engine does not know their values (no scheduling timestamps, no per-step
token histogram): vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds,
vllm:request_inference_time_seconds, vllm:iteration_tokens_total, vllm:time_per_prefill_token_request_seconds,
vllm:cache_config_info (vLLM's CacheConfig fields), vllm:prompt_tokens_cached
and vllm:prompt_tokens_by_source (the prefix cache's hits are vllm:prefix_cache_hits), and the deprecated
vllm:gpu_cache_usage_perc / vllm:gpu_prefix_cache_* / vllm:time_per_output_token_seconds. Also left out for now:
vllm:request_params_n, vllm:request_params_max_tokens and vllm:request_max_num_generation_tokens (the request's
parameters are not recorded with its end).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
                         0.05, 0.1, 0.25, 0.5, 1.0)
# vLLM's `engine` label: the index of the engine behind the server. A jaxspec server runs one engine (its tensor
# parallelism is inside it); data-parallel replicas (jaxspec/serve/ray.py) are separate servers, each engine "0",
# told apart by the scrape's instance as vLLM's are.
ENGINE_INDEX = "0"
# vLLM's finish reasons: each vllm:request_success series exists (at 0) before the first request ends.
FINISH_REASONS = ("stop", "length", "abort")


def token_count_buckets(limit: int) -> list[int]:
    """Buckets for a histogram of token counts: 1, 2, 5, 10, 20, 50, ... up to `limit` (the longest sequence)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


class EngineCollector:
    """Engine counters and gauges, read when Prometheus scrapes, under jaxspec's names and vLLM's."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}
        self.vllm_labels = {"model_name": model_name, "engine": ENGINE_INDEX}

    def _metric(self, family, name: str, doc: str, value: float):
        m = family(name, doc, labels=list(self.labels))
        m.add_metric(list(self.labels.values()), value)
        return m

    def _both(self, family, name: str, doc: str, value: float):
        """`jaxspec:<name>` and `vllm:<name>` with the same value."""
        yield self._metric(family, f"jaxspec:{name}", doc, value)
        m = family(f"vllm:{name}", doc, labels=list(self.vllm_labels))
        m.add_metric(list(self.vllm_labels.values()), value)
        yield m

    def collect(self):
        s = self.engine.stats()
        g, c = GaugeMetricFamily, CounterMetricFamily
        used = s["num_kv_blocks"] - s["free_kv_blocks"]
        yield from self._both(g, "num_requests_running", "Requests holding a slot.", s["num_running"])
        yield from self._both(g, "num_requests_waiting", "Requests waiting for a slot.", s["num_waiting"])
        yield from self._both(g, "kv_cache_usage_perc", "Share of KV blocks held by requests (0 to 1).",
                              used / s["num_kv_blocks"])
        yield from self._both(c, "num_preemptions", "Requests preempted for KV room.", s["num_preemptions"])
        yield self._metric(c, "jaxspec:engine_steps", "Steps the engine dispatched.", s["steps"])
        pc = s["prefix_cache"]
        yield from self._both(c, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                              pc["queried_tokens"])
        yield from self._both(c, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                              pc["hit_tokens"])
        yield self._metric(g, "jaxspec:prefix_cache_blocks", "KV blocks registered in the prefix cache.",
                           pc["cached_blocks"])
        if "lora" in s:
            lora = s["lora"]
            info = g("vllm:lora_requests_info", "Running stats on LoRA requests.",
                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            info.add_metric([str(lora["max_loras"]), ",".join(lora["queued"]), ",".join(lora["running"])], time.time())
            yield info
            yield self._metric(g, "jaxspec:lora_requests_waiting", "Queued requests waiting for an adapter slot.",
                               lora["waiting_for_slot"])
        if "spec" in s:
            sp = s["spec"]
            yield from self._both(c, "spec_decode_num_drafts", "Verifications of a request's drafts.",
                                  sp["drafts"])
            yield from self._both(c, "spec_decode_num_draft_tokens", "Draft tokens verified.", sp["draft_tokens"])
            yield from self._both(c, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                  sp["accepted_tokens"])
            per_pos = c("vllm:spec_decode_num_accepted_tokens_per_pos",
                        "Draft tokens accepted, by their position among a verification's drafts.",
                        labels=[*self.vllm_labels, "position"])
            # the stats give each position's acceptance rate over `drafts` verifications: back to its count
            for pos, rate in enumerate(sp["per_position_acceptance"]):
                per_pos.add_metric([*self.vllm_labels.values(), str(pos)], round(rate * sp["drafts"]))
            yield per_pos
            # requests with SamplingParams.speculative false (vLLM has no such option, so no twin)
            yield self._metric(c, "jaxspec:spec_decode_opted_out_requests", "Requests that asked not to speculate.",
                               sp["opted_out_requests"])
            yield self._metric(c, "jaxspec:spec_decode_opted_out_tokens", "Tokens generated by requests that asked "
                               "not to speculate (no drafts verified).", sp["opted_out_tokens"])


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        j, v = ["model_name"], ["model_name", "engine"]
        max_model_len = engine.step_config.max_model_len
        # ---- jaxspec's names --------------------------------------------------------------------------------
        self.requests = Counter("jaxspec:request_success", "Finished requests, by finish reason.",
                                j + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("jaxspec:prompt_tokens", "Prompt tokens of finished requests (each prompt "
                                     "once, whatever its number of completions n).", j, registry=r)
        self.generation_tokens = Counter("jaxspec:generation_tokens", "Tokens generated.", j, registry=r)
        self.ttft = Histogram("jaxspec:time_to_first_token_seconds", "Time to first token.", j,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jaxspec:time_per_output_token_seconds", "Mean time per output token after the first.",
                              j, buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxspec:e2e_request_latency_seconds", "Arrival to last token.", j,
                             buckets=LATENCY_BUCKETS, registry=r)
        # ---- vLLM's names (labels bound: one engine per server) ------------------------------------------------
        lv = (model_name, ENGINE_INDEX)
        success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                          v + ["finished_reason"], registry=r)
        self.vllm_requests = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
        self.vllm_success = success
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled (each completion's).", v,
                                          registry=r).labels(*lv)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", v,
                                              registry=r).labels(*lv)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token, in seconds.", v,
                                   buckets=LATENCY_BUCKETS, registry=r).labels(*lv)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's successive "
                                  "steps that gave it tokens, in seconds.", v, buckets=TOKEN_LATENCY_BUCKETS,
                                  registry=r).labels(*lv)
        self.vllm_tpot = Histogram("vllm:request_time_per_output_token_seconds", "A request's mean time per "
                                   "output token after its first, in seconds.", v, buckets=TOKEN_LATENCY_BUCKETS,
                                   registry=r).labels(*lv)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token, in seconds.", v,
                                  buckets=LATENCY_BUCKETS, registry=r).labels(*lv)
        self.vllm_decode_time = Histogram("vllm:request_decode_time_seconds", "First token to last token, in "
                                          "seconds.", v, buckets=LATENCY_BUCKETS, registry=r).labels(*lv)
        counts = token_count_buckets(max_model_len)
        self.vllm_request_prompt = Histogram("vllm:request_prompt_tokens", "A finished request's prompt tokens.",
                                             v, buckets=counts, registry=r).labels(*lv)
        self.vllm_request_generation = Histogram("vllm:request_generation_tokens", "A finished request's "
                                                 "generated tokens.", v, buckets=counts, registry=r).labels(*lv)
        r.register(EngineCollector(engine, model_name))

    def record(self, completion):
        """A completion (CompletionOutput, whole) ended."""
        m, name = completion.metrics, self.model_name
        reason = completion.finish_reason or "abort"
        n_out = m["num_output_tokens"]
        self.requests.labels(name, reason).inc()
        self.generation_tokens.labels(name).inc(n_out)
        if m["ttft"] is not None:
            self.ttft.labels(name).observe(m["ttft"])
        if m["tpot"] is not None:
            self.tpot.labels(name).observe(m["tpot"])
        self.e2e.labels(name).observe(m["e2e_latency"])
        # vLLM's
        (self.vllm_requests.get(reason) or self.vllm_success.labels(name, ENGINE_INDEX, reason)).inc()
        self.vllm_generation_tokens.inc(n_out)
        if m["ttft"] is not None:   # it was prefilled and gave a token
            self.vllm_prompt_tokens.inc(m["num_prompt_tokens"])
            self.vllm_ttft.observe(m["ttft"])
        # inter_token_latencies: per token after the first, the gap since the one before; a step's further tokens
        # have 0 (they came with the first): one observation per step, as vLLM's
        for gap in m["inter_token_latencies"]:
            if gap > 0:
                self.vllm_itl.observe(gap)
        if m["tpot"] is not None:
            self.vllm_tpot.observe(m["tpot"])
        self.vllm_decode_time.observe(m["tpot"] * (n_out - 1) if m["tpot"] is not None else 0.0)
        self.vllm_e2e.observe(m["e2e_latency"])
        self.vllm_request_prompt.observe(m["num_prompt_tokens"])
        self.vllm_request_generation.observe(n_out)

    def record_prompts(self, num_tokens: int):
        """An HTTP request ended: its prompts' tokens, each prompt once (its n completions share it)."""
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)


# The samples of a family called x: x itself, and a counter's, histogram's or summary's parts.
SAMPLE_SUFFIXES = ("", "_total", "_created", "_bucket", "_sum", "_count", "_gsum", "_gcount", "_info")


def merge_expositions(texts: list[str]) -> str:
    """Several servers' /metrics (Prometheus text) as one, as vLLM's data-parallel engines export theirs: server
    i's samples carry `engine="i"` (replacing the `engine` label its vLLM twins have, added to the others), and each
    family's HELP and TYPE come once, followed by every server's samples of it."""
    families: dict[str, dict] = {}
    for i, text in enumerate(texts):
        family_name, family = "", None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family_name = parts[2]
                    family = families.setdefault(family_name, {"HELP": None, "TYPE": None, "samples": []})
                    family[parts[1]] = family[parts[1]] or line
                continue
            name = line.split("{")[0].split()[0]
            if family is None or not any(name == family_name + suffix for suffix in SAMPLE_SUFFIXES):
                family_name, family = name, families.setdefault(name, {"HELP": None, "TYPE": None, "samples": []})
            family["samples"].append(_with_engine(line, i))
    out = []
    for family in families.values():
        out += [h for h in (family["HELP"], family["TYPE"]) if h] + family["samples"]
    return "\n".join(out) + "\n"


def _with_engine(sample: str, index: int) -> str:
    label = f'engine="{index}"'
    name, brace, rest = sample.partition("{")
    if not brace:   # name value [timestamp]
        name, _, value = sample.partition(" ")
        return f"{name}{{{label}}} {value}"
    labels, close, value = rest.partition("} ")
    pairs = [p for p in _split_labels(labels) if not p.startswith("engine=")]
    return f"{name}{{{','.join(pairs + [label])}}} {value}"


def _split_labels(labels: str) -> list[str]:
    """`a="x",b="y,z"` -> ['a="x"', 'b="y,z"'] (commas and escaped quotes inside values kept)."""
    pairs, start, quoted, escaped = [], 0, False, False
    for j, ch in enumerate(labels):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            pairs.append(labels[start:j])
            start = j + 1
    if labels[start:].strip():
        pairs.append(labels[start:])
    return [p.strip() for p in pairs if p.strip()]
