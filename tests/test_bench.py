"""`jaxspec-bench` end to end on the CPU: the sync/async x speculation matrix, ShareGPT prompts, JSON out."""
import json

from jaxspec.bench import main


def test_compare_matrix_on_sharegpt_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["--model", "smollm2-135m-instruct", "--dtype", "float32", "--dataset", "sharegpt",
               "--num-prompts", "3", "--output-len", "6", "--max-input-len", "48", "--max-concurrency", "2",
               "--max-model-len", "128", "--max-num-batched-tokens", "32", "--spec-method", "ngram",
               "--num-spec-tokens", "2", "--compare", "--json", str(out), "--quiet"])
    assert rc == 0
    results = json.loads(out.read_text())
    assert [r["label"] for r in results] == ["sync", "async", "sync+ngram", "async+ngram"]
    for r in results:
        assert r["requests"] == 3 and r["output_tokens"] > 0 and r["recompiles"] == 0
        assert r["output_throughput"] > 0 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["median"] > 0
    assert results[2]["spec"]["draft_tokens"] == results[3]["spec"]["draft_tokens"] > 0
    # every configuration generated the same greedy tokens (not only as many)
    assert len({r["output_digest"] for r in results}) == 1
    printed = capsys.readouterr().out
    assert "Output token throughput (tok/s)" in printed and "Acceptance length" in printed
    assert "relative to sync" in printed


def test_steady_state_reports_bubble_roofline_and_speedup_bound(tmp_path):
    """--steady-state: every row decoding while timed; device-busy fraction, roofline and, with
    speculation, the speedup bound from the measured step times."""
    out = tmp_path / "steady.json"
    rc = main(["--model", "smollm2-135m-instruct", "--random-weights", "--dtype", "float32", "--num-prompts", "2",
               "--input-len", "16", "--output-len", "4", "--max-concurrency", "2", "--max-model-len", "96",
               "--max-num-batched-tokens", "16", "--steady-state", "1", "2", "--steady-steps", "3",
               "--spec-method", "ngram", "--num-spec-tokens", "2", "--compare", "--json", str(out), "--quiet"])
    assert rc == 0
    results = json.loads(out.read_text())
    for r in results:
        assert [st["batch"] for st in r["steady"]] == [1, 2]
        for st in r["steady"]:
            assert st["device_step_ms"] > 0 and st["wall_step_ms"] > 0 and 0 < st["device_busy"] <= 1
            assert 0 < st["roofline_fraction"] and st["mean_context"] > 16   # the rows kept decoding
    for r in results[2:]:
        assert [b["batch"] for b in r["speedup_bound"]] == [1, 2]
        assert all(b["bound"] > 0 and b["of_bound"] > 0 for b in r["speedup_bound"])


def test_poisson_arrivals_on_a_shared_prefix_match_the_offline_run(tmp_path):
    """--request-rate: requests arrive over time and are served by the engine on its own thread; the greedy
    tokens equal those of the all-at-once run, and the shared prefix is reused only with caching on."""
    common = ["--model", "smollm2-135m-instruct", "--random-weights", "--dtype", "float32", "--dataset", "prefix",
              "--prefix-len", "32", "--input-len", "4", "--num-prompts", "4", "--output-len", "4",
              "--max-concurrency", "2", "--max-model-len", "96", "--max-num-batched-tokens", "32", "--quiet"]
    results = {}
    for name, extra in [("offline", []), ("online", ["--request-rate", "40"]),
                        ("online-off", ["--request-rate", "40", "--no-enable-prefix-caching"])]:
        out = tmp_path / f"{name}.json"
        assert main(common + extra + ["--json", str(out)]) == 0
        (results[name],) = json.loads(out.read_text())
    assert results["online"]["request_rate"] == 40 and results["online"]["requests"] == 4
    assert results["online"]["output_digest"] == results["offline"]["output_digest"] == \
        results["online-off"]["output_digest"]
    assert results["online"]["prefix_cache"]["hit_tokens"] > 0
    assert results["online-off"]["prefix_cache"]["enabled"] is False
    assert results["online"]["ttft_ms"]["median"] > 0 and results["online"]["tpot_ms"]["median"] > 0


FAKE_VLLM = '''
"""A stand-in for vLLM's offline API (LLM, SamplingParams, get_metrics): it records what it was asked to run."""
import json, os, types


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class Counter:
    def __init__(self, name, value):
        self.name, self.value = name, value


class Vector:
    def __init__(self, name, values):
        self.name, self.values = name, values


class LLM:
    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, 0

    def generate(self, prompts, params, use_tqdm=True):
        self.calls += 1
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"llm": {k: v for k, v in self.kwargs.items()},
                                "prompts": [p["prompt_token_ids"] for p in prompts],
                                "max_tokens": [p.max_tokens for p in params],
                                "temperature": [p.temperature for p in params]}) + "\\n")
        outs = []
        for p, sp in zip(prompts, params):
            ids = (p["prompt_token_ids"] * sp.max_tokens)[:sp.max_tokens]
            metrics = types.SimpleNamespace(first_token_ts=0.0, last_token_ts=0.004 * (len(ids) - 1))
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids)], metrics=metrics))
        return outs

    def get_metrics(self):   # every generate call drafts 10 times and accepts 15 tokens (the warm-up a few more)
        n = self.calls
        return [Counter("vllm:spec_decode_num_drafts", 10 * n), Counter("vllm:spec_decode_num_draft_tokens", 30 * n),
                Counter("vllm:spec_decode_num_accepted_tokens", 15 * n + 7),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", [8 * n + 4, 5 * n + 2, 2 * n + 1]),
                Counter("vllm:prompt_tokens", 99 * n)]
'''


def test_vllm_baseline_runs_the_same_workload_in_its_own_process(tmp_path, monkeypatch, capsys):
    """--baseline vllm: the child process gets the same token ids, lengths, batch size, sampling and speculation,
    and its acceptance comes from vLLM's own counters (over the timed run only, not the warm-up)."""
    import os
    import pytest
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "vllm.log"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), repo, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.syspath_prepend(str(fake))
    out = tmp_path / "bench.json"
    args = ["--model", "smollm2-135m-instruct", "--dtype", "float32", "--dataset", "random", "--num-prompts", "3",
            "--input-len", "5", "--output-len", "4", "--max-concurrency", "2", "--max-model-len", "64",
            "--max-num-batched-tokens", "16", "--spec-method", "ngram", "--num-spec-tokens", "3",
            "--json", str(out), "--quiet", "--baseline", "vllm"]
    assert main(args) == 0
    results = json.loads(out.read_text())
    ours, theirs = results
    assert theirs["label"] == "vllm+ngram" and theirs["requests"] == 3 and theirs["output_tokens"] == 12
    assert theirs["spec"]["mean_acceptance_length"] == 2.5
    assert theirs["spec"]["per_position_acceptance"] == [0.8, 0.5, 0.2]
    assert abs(theirs["tpot_ms"]["mean"] - 4.0) < 1e-6
    warm, timed = [json.loads(line) for line in log.read_text().splitlines()]
    assert timed["llm"]["max_num_seqs"] == 2 and timed["llm"]["skip_tokenizer_init"]
    assert timed["llm"]["speculative_config"]["method"] == "ngram"
    assert timed["llm"]["speculative_config"]["num_speculative_tokens"] == 3
    assert timed["max_tokens"] == [4, 4, 4] and timed["temperature"] == [0.0] * 3
    assert all(len(p) == 5 for p in timed["prompts"]) and len(warm["prompts"]) == 2
    assert ours["input_tokens"] == sum(map(len, timed["prompts"])) == 15
    assert "x vLLM" in capsys.readouterr().out
    # without vLLM: a clear error before anything is loaded
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit, match="needs vLLM"):
        main(args)
