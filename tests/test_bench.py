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
    # every configuration generated the same greedy tokens
    assert len({r["output_tokens"] for r in results}) == 1
    printed = capsys.readouterr().out
    assert "Output token throughput (tok/s)" in printed and "Acceptance length" in printed
    assert "relative to sync" in printed
