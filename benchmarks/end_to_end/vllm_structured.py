"""vLLM 0.23 alone (jaxspec/bench/baselines/vllm.py's child, dummy weights), every request constrained to a JSON
schema (compact: xgrammar with disable_any_whitespace), a `--save-workload` file's prompts, 3 x batch requests (at
least 8) at each batch size; outputs decoded and validated as jaxspec-bench does. The vLLM half of issue #16's
side-by-side, whose jaxspec half is `benchmarks/end_to_end/bench_spec_gpu.py --structured-json`.

    PYTHONPATH=/tmp/vllm-site:$PWD python3 benchmarks/end_to_end/vllm_structured.py MODEL_DIR WORKLOAD.json \
        SCHEMA.json OUT.json 8,32,1
"""
import json, sys, types
sys.path.insert(0, ".")
from jaxspec.bench.baselines.vllm import build_request, constraint_fields, run_vllm_baseline
from jaxspec.bench.outputs import output_summary
from jaxspec.bench.workloads import structured_from_args, tokenizer_for
model, workload, schema, out = sys.argv[1:5]
batches = [int(b) for b in sys.argv[5].split(",")]
ns = types.SimpleNamespace(structured_json=schema, structured_regex=None, structured_choice=None,
                           structured_disable_any_whitespace=True)
ns.structured, ns.structured_report = structured_from_args(ns)
tok = tokenizer_for(model)
eos = set(tok.eos_token_ids)
sessions = json.load(open(workload))["sessions"]
results = []
for b in batches:
    n = max(8, 3 * b)
    prompts = [list(s[0][0]) for s in sessions[:n]]
    args = types.SimpleNamespace(spec_method=None, num_spec_tokens=0, max_concurrency=b, max_model_len=1024,
                                 max_num_batched_tokens=512, temperature=0.0, seed=0, ignore_eos=False,
                                 random_weights=True, dtype="bfloat16", vllm_memory_fraction=0.85)
    req = build_request(args, prompts, [256] * n, model, None, structured=constraint_fields(ns.structured_report),
                        tokenizer=model)
    res = run_vllm_baseline(req)
    ids = res.pop("token_ids")
    texts = [tok.decode(t[:-1] if t and t[-1] in eos else t) for t in ids]
    res.update(output_summary(ns, [len(t) for t in ids], texts, res.pop("finish_reasons", None)))
    res.update(batch=b, sample_output=texts[0])
    print("VLLM json b", b, "tok/s", round(res["output_throughput"], 1), "tpot", res["tpot_ms"],
          "valid", res["structured_outputs"]["valid_outputs"], "/", res["requests"], "len", res["output_len"], flush=True)
    results.append(res)
    json.dump(results, open(out, "w"), indent=1, default=float)
