"""`jaxspec-bench` end to end on the CPU: the sync/async x speculation matrix, ShareGPT prompts, JSON out."""
import json
import os

import jsonschema
import pytest

from jaxspec.bench import main
from jaxspec.bench.measure import HBM_BANDWIDTH

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERSON = os.path.join(REPO, "benchmarks", "schemas", "person.json")   # the default schema of the GPU runs
# A person the schema allows (what the fake vLLM answers, in SmolLM2 tokens)
EXAMPLE = {"name": "Ada Lovelace", "country": "GB", "role": "analyst", "level": 5, "active": False,
           "skills": ["math", "poetry"]}


def tiny_model_dir(path, smollm2_gguf_path, vocab_size: int):
    """A tiny random llama checkpoint (an HF directory: config.json, model.safetensors) whose vocabulary is
    SmolLM2's first `vocab_size` tokens, with SmolLM2's tokenizer files: its outputs are real text, and it
    compiles and decodes in seconds."""
    from safetensors.numpy import save_file
    from conftest import random_model
    from jaxspec.models.gguf_loader import hf_tokenizer_from_gguf
    model = random_model(0, vocab_size=vocab_size, max_position_embeddings=512)
    c = model.config
    save_file(model.hf_tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}))
    hf_tokenizer_from_gguf(smollm2_gguf_path).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def json_model_dir(tmp_path_factory, smollm2_gguf_path):
    """A tiny model (tiny_model_dir) over SmolLM2's first 512 tokens (every byte and the first merges).
    Unconstrained, a random model's text is never JSON: a constraint has to do all the work."""
    return tiny_model_dir(tmp_path_factory.mktemp("json_model"), smollm2_gguf_path, 512)


def test_compare_matrix_on_sharegpt_writes_json(tmp_path, capsys, optimized_steps):
    """SmolLM2 itself: on real text its n-gram drafts match the prompt's n-grams and are rejected (a random model
    proposes none), so the configurations' equal tokens say that rejected drafts change nothing. (Its steps compiled
    with LLVM's optimisation, conftest.optimized_steps: the same tokens, half the CPU time.)"""
    out = tmp_path / "bench.json"
    rc = main(["--model", "smollm2-135m-instruct", "--dtype", "float32", "--dataset", "sharegpt",
               "--num-prompts", "3", "--output-len", "6", "--max-input-len", "48", "--max-concurrency", "2",
               "--max-model-len", "128", "--max-num-batched-tokens", "8", "--spec-method", "ngram",
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


def test_steady_state_reports_bubble_roofline_and_speedup_bound(tmp_path, json_model_dir):
    """--steady-state: every row decoding while timed; device-busy fraction, roofline and, with
    speculation, the speedup bound from the measured step times."""
    out = tmp_path / "steady.json"
    rc = main(["--model", str(json_model_dir), "--random-weights", "--dtype", "float32", "--num-prompts", "2",
               "--input-len", "16", "--output-len", "4", "--max-concurrency", "2", "--max-model-len", "96",
               "--max-num-batched-tokens", "8", "--steady-state", "1", "2", "--steady-steps", "3",
               "--spec-method", "ngram", "--num-spec-tokens", "2", "--compare", "--json", str(out), "--quiet"])
    assert rc == 0
    results = json.loads(out.read_text())
    for r in results:
        assert [st["batch"] for st in r["steady"]] == [1, 2]
        for st in r["steady"]:
            assert st["device_step_ms"] > 0 and st["wall_step_ms"] > 0 and 0 < st["device_busy"] <= 1
            assert 0 < st["roofline_fraction"] and st["mean_context"] > 16   # the rows kept decoding
            assert st["hbm_bandwidth"] == HBM_BANDWIDTH   # off a GPU: an H100's
    for r in results[2:]:
        assert [b["batch"] for b in r["speedup_bound"]] == [1, 2]
        assert all(b["bound"] > 0 and b["of_bound"] > 0 for b in r["speedup_bound"])


def test_the_roofline_takes_the_gpus_own_bandwidth(monkeypatch):
    """On a GPU the roofline divides by that GPU's measured copy bandwidth (once per kind of GPU), unless
    --hbm-bandwidth names one; the copy's bytes are those read plus those written."""
    import jax
    from jaxspec.bench import measure
    kinds = iter(["NVIDIA H200", "NVIDIA H200", "NVIDIA H100 80GB HBM3"])
    measured = []
    gpu = lambda: [type("D", (), {"platform": "gpu", "device_kind": next(kinds)})()]   # noqa: E731
    monkeypatch.setattr(jax, "devices", gpu)
    monkeypatch.setattr(measure, "_measured_bandwidth", {})
    monkeypatch.setattr(measure, "copy_bandwidth", lambda: measured.append(1) or 4.0e12 + len(measured))
    assert [measure.hbm_bandwidth(None) for _ in range(3)] == [4.0e12 + 1, 4.0e12 + 1, 4.0e12 + 2]
    assert measure.hbm_bandwidth(1.5e12) == 1.5e12
    monkeypatch.undo()
    assert 0 < measure.copy_bandwidth(num_bytes=1 << 20, passes=2, repeats=2) < 1e15


def test_poisson_arrivals_on_a_shared_prefix_match_the_offline_run(tmp_path, json_model_dir):
    """--request-rate: requests arrive over time and are served by the engine on its own thread; the greedy
    tokens equal those of the all-at-once run, and the shared prefix is reused only with caching on."""
    common = ["--model", str(json_model_dir), "--random-weights", "--dtype", "float32", "--dataset", "prefix",
              "--prefix-len", "32", "--input-len", "4", "--num-prompts", "4", "--output-len", "4",
              "--max-concurrency", "2", "--max-model-len", "96", "--max-num-batched-tokens", "8", "--quiet"]
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


FAKE_SAMPLING_PARAMS = '''
class StructuredOutputsParams:   # vllm.sampling_params.StructuredOutputsParams: the constraint it was given
    def __init__(self, **kwargs):
        self.kwargs = kwargs
'''

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
        tokenizer = kwargs.get("tokenizer")   # a directory that exists while the child runs
        self.tokenizer_files = sorted(os.listdir(tokenizer)) if tokenizer else None

    def generate(self, prompts, params, use_tqdm=True):
        self.calls += 1
        structured = [getattr(sp, "structured_outputs", None) for sp in params]
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"llm": {k: v for k, v in self.kwargs.items()},
                                "tokenizer_files": self.tokenizer_files,
                                "prompts": [p["prompt_token_ids"] for p in prompts],
                                "max_tokens": [p.max_tokens for p in params],
                                "temperature": [p.temperature for p in params],
                                "ignore_eos": [getattr(p, "ignore_eos", None) for p in params],
                                "structured": [None if so is None else so.kwargs for so in structured]}) + "\\n")
        outs = []
        for p, sp, so in zip(prompts, params, structured):
            if so is not None and "FAKE_VLLM_OUTPUT" in os.environ:   # what a constrained run emits
                ids = json.loads(os.environ["FAKE_VLLM_OUTPUT"])[:sp.max_tokens]
            else:
                ids = (p["prompt_token_ids"] * sp.max_tokens)[:sp.max_tokens]
            metrics = types.SimpleNamespace(first_token_ts=0.0, last_token_ts=0.004 * (len(ids) - 1))
            finish = "stop" if so is not None and "FAKE_VLLM_OUTPUT" in os.environ else "length"
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, finish_reason=finish)],
                                              metrics=metrics))
        return outs

    def get_metrics(self):   # every generate call drafts 10 times and accepts 15 tokens (the warm-up a few more)
        n = self.calls
        return [Counter("vllm:spec_decode_num_drafts", 10 * n), Counter("vllm:spec_decode_num_draft_tokens", 30 * n),
                Counter("vllm:spec_decode_num_accepted_tokens", 15 * n + 7),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", [8 * n + 4, 5 * n + 2, 2 * n + 1]),
                Counter("vllm:prompt_tokens", 99 * n)]
'''


def test_vllm_baseline_runs_the_same_workload_in_its_own_process(tmp_path, monkeypatch, capsys, json_model_dir):
    """--baseline vllm: the child process gets the same token ids, lengths, batch size, sampling and speculation,
    and its acceptance comes from vLLM's own counters (over the timed run only, not the warm-up). With
    --structured-json every request of the child (the warm-up's too) carries the schema as vLLM's
    StructuredOutputsParams(json=...), EOS is not ignored, vLLM loads a tokenizer (jaxspec's, saved for it), and
    the report checks vLLM's outputs against the schema as it checks jaxspec's."""
    import os
    import pytest
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (fake / "vllm" / "sampling_params.py").write_text(FAKE_SAMPLING_PARAMS)
    log = tmp_path / "vllm.log"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), repo, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.syspath_prepend(str(fake))
    out = tmp_path / "bench.json"
    args = ["--model", str(json_model_dir), "--dtype", "float32", "--dataset", "random", "--num-prompts", "3",
            "--input-len", "5", "--output-len", "4", "--max-concurrency", "2", "--max-model-len", "64",
            "--max-num-batched-tokens", "8", "--spec-method", "ngram", "--num-spec-tokens", "3",
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
    assert timed["structured"] == [None] * 3 and timed["ignore_eos"] == [True] * 3 and "tokenizer" not in timed["llm"]
    assert "x vLLM" in capsys.readouterr().out

    # A JSON schema on every request (the tiny model with SmolLM2's tokenizer; the fake vLLM answers every
    # constrained request with EXAMPLE's tokens and EOS)
    from jaxspec.bench.workloads import tokenizer_for
    example = tokenizer_for(str(json_model_dir)).encode(json.dumps(EXAMPLE)) + [2]
    monkeypatch.setenv("FAKE_VLLM_OUTPUT", json.dumps(example))
    log.unlink()
    with open(PERSON) as f:
        schema = json.load(f)
    assert main(["--model", str(json_model_dir), "--dtype", "float32", "--dataset", "random", "--num-prompts", "3",
                 "--input-len", "5", "--output-len", "200", "--max-concurrency", "2", "--max-model-len", "256",
                 "--max-num-batched-tokens", "8", "--spec-method", "ngram", "--num-spec-tokens", "2",
                 "--structured-json", PERSON, "--structured-disable-any-whitespace", "--json", str(out), "--quiet",
                 "--baseline", "vllm"]) == 0
    ours, theirs = json.loads(out.read_text())
    warm, timed = [json.loads(line) for line in log.read_text().splitlines()]
    constraint = {"json": schema, "disable_any_whitespace": True}
    assert timed["structured"] == [constraint] * 3 and warm["structured"] == [constraint] * 2
    assert timed["ignore_eos"] == [False] * 3 and timed["max_tokens"] == [200] * 3
    assert timed["llm"]["skip_tokenizer_init"] is False and "tokenizer.json" in timed["tokenizer_files"]
    # vLLM's grammar backends take the whitespace choice from the engine's config only, and vLLM accepts it there
    # only beside an explicit xgrammar or guidance backend
    assert timed["llm"]["structured_outputs_config"] == {"backend": "xgrammar", "disable_any_whitespace": True}
    assert ours["label"] == "async+ngram+json" and theirs["label"] == "vllm+ngram+json"
    for r in (ours, theirs):
        assert r["structured_outputs"] == {"kind": "json", "json": schema, "source": PERSON, "ignore_eos": False,
                                           "disable_any_whitespace": True, "valid_outputs": 3}, r["label"]
        assert r["finish_reasons"] == {"stop": 3}, r["label"]
    assert theirs["output_tokens"] == 3 * len(example) and theirs["output_len"]["mean"] == len(example)
    assert "3/3 outputs match the constraint" in capsys.readouterr().out
    # without vLLM: a clear error before anything is loaded
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit, match="needs vLLM"):
        main(args)


def test_person_schema_is_a_bounded_json_schema():
    """benchmarks/schemas/person.json: a valid JSON schema that outlines-core compiles (the one engine-side
    compiler) into a regex with no unbounded repetition (every output has a bounded length, whatever the model:
    a random model ends too), and an example instance validates."""
    import re
    from outlines_core.json_schema import build_regex_from_schema
    with open(PERSON) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(EXAMPLE, schema)
    regex = build_regex_from_schema(json.dumps(schema))
    assert not re.search(r"(?<!\\)[*+]|\{\d+,\}", regex), regex
    assert re.fullmatch(regex, json.dumps(EXAMPLE))


def test_structured_json_on_every_request_validates_offline_and_online(tmp_path, json_model_dir):
    """--structured-json (the person schema file) on every request, all at once and arriving over time: every
    output validates against the schema, ends where its automaton accepts (finish reason stop, before
    --output-len, although --ignore-eos is on by default), and the report records the constraint, the tokens
    actually generated and how many outputs match. (With speculation: the --baseline vllm test below.)"""
    # One token bucket (8): few compilations.
    common = ["--model", str(json_model_dir), "--dtype", "float32", "--dataset", "random", "--num-prompts", "3",
              "--input-len", "6", "--output-len", "200", "--max-concurrency", "2", "--max-model-len", "256",
              "--max-num-batched-tokens", "8", "--structured-json", PERSON, "--quiet"]
    results = {}
    for name, extra in [("offline", []), ("online", ["--request-rate", "50"])]:
        out = tmp_path / f"{name}.json"
        assert main(common + extra + ["--json", str(out)]) == 0
        (results[name],) = json.loads(out.read_text())
    with open(PERSON) as f:
        schema = json.load(f)
    for name, r in results.items():
        assert r["label"] == "async+json", name
        assert r["structured_outputs"] == {"kind": "json", "json": schema, "source": PERSON, "ignore_eos": False,
                                           "valid_outputs": 3}, name
        assert r["finish_reasons"] == {"stop": 3} and r["output_len"]["max"] < 200, (name, r["output_len"])
        assert r["output_tokens"] == round(3 * r["output_len"]["mean"]) and r["output_len"]["min"] > 20, name
        assert r["recompiles"] == 0, name   # the grammar steps were compiled before the clock started
    assert results["offline"]["output_digest"] == results["online"]["output_digest"]


def test_the_report_of_an_engine_without_warm_up(capsys):
    """--warmup none leaves no warm-up to count recompiles from (stats()["recompiles"] is None): the report prints
    "-" there instead of failing on the None."""
    from jaxspec.bench.report import print_report
    stats = {"mean": 1.0, "median": 1.0, "p99": 1.0}
    print_report({"label": "async", "requests": 1, "duration_s": 1.0, "input_tokens": 16, "output_tokens": 4,
                  "request_throughput": 1.0, "output_throughput": 4.0, "total_throughput": 20.0, "steps": 5,
                  "recompiles": None, "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats})
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Recompiles after warm-up"))
    assert row.split()[-1] == "-"


def test_saturated_throughput_counts_the_tokens_before_the_last_request_is_sent():
    """Closed loop at concurrency 2, three requests: the third is sent when the second finishes (t = 2.5 s). Until
    then two requests were in flight; the tokens that arrived by then over those 2.5 s is the saturated rate (the
    drain after it, C alone, is left out). Paced arrivals, no more requests than the concurrency, and chunks
    without token counts (HTTP) give nothing."""
    from jaxspec.bench.online import Sent, saturated_throughput

    def sent(at, times, counts):
        return Sent(4, sum(counts), times[0] - at, times, times[-1] - at, None, "", "length", at, counts)
    a = sent(0.0, [1.0, 2.0, 3.0], [2, 1, 1])
    b = sent(0.0, [1.5, 2.5], [3, 1])
    c = sent(2.5, [3.5, 4.5], [1, 1])
    got = saturated_throughput([a, b, c], 0.0, float("inf"), 2)
    assert got == {"saturated_s": 2.5, "saturated_output_throughput": (2 + 1 + 3 + 1) / 2.5}
    assert saturated_throughput([a, b, c], 0.0, 40.0, 2) == {}
    assert saturated_throughput([a, b], 0.0, float("inf"), 2) == {}
    http = sent(2.5, [3.5, 4.5], [1, 1])
    http.chunk_tokens = None
    assert saturated_throughput([a, b, http], 0.0, float("inf"), 2) == {}
