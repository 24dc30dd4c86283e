"""Several servers' /metrics as one (jaxspec/serve/metrics.py's merge_expositions, what Ray Serve's /metrics
answers): two real ServerMetrics registries with different counts, merged, parse as Prometheus text with each
family once and each server's samples labelled engine="i"."""
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxspec.serve.metrics import merge_expositions


class _Engine:   # what ServerMetrics reads at a scrape
    def __init__(self, running):
        import types
        self.running = running
        self.step_config = types.SimpleNamespace(max_model_len=64)

    def stats(self):
        return {"num_running": self.running, "num_waiting": 0, "num_kv_blocks": 8, "free_kv_blocks": 6,
                "num_preemptions": 0, "steps": 4,
                "prefix_cache": {"queried_tokens": 0, "hit_tokens": 0, "cached_blocks": 0}}


def test_two_servers_metrics_merge_into_one_exposition_labelled_by_engine():
    from jaxspec.serve.metrics import ServerMetrics
    texts = []
    for running, prompts in ((3, 10), (5, 7)):
        m = ServerMetrics(_Engine(running), "tiny")
        m.record_prompts(prompts)
        texts.append(generate_latest(m.registry).decode())
    merged = merge_expositions(texts)
    families = list(text_string_to_metric_families(merged))
    names = [f.name for f in families]
    assert len(names) == len(set(names))                      # each family once
    single = {f.name for f in text_string_to_metric_families(texts[0])}
    assert set(names) == single
    running = {s.labels["engine"]: s.value for f in families if f.name == "vllm:num_requests_running"
               for s in f.samples}
    assert running == {"0": 3, "1": 5}
    prompts = {s.labels["engine"]: s.value for f in families if f.name == "jaxspec:prompt_tokens"
               for s in f.samples if s.name.endswith("_total")}
    assert prompts == {"0": 10, "1": 7}
