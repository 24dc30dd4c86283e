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
