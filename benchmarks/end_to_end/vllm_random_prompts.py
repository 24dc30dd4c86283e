"""vLLM 0.23 alone (jaxspec/bench/baselines/vllm.py's child, dummy weights) on random 128-token prompts, 256 greedy
tokens each with EOS ignored, at several batch sizes: 2 x batch requests (at least 4), max_num_seqs = batch. The side
of a side-by-side whose jaxspec half ran in benchmarks/end_to_end/bench_spec_gpu.py (one engine, no jaxspec rerun per
batch size).

    PYTHONPATH=/tmp/vllm-site:$PWD python3 benchmarks/end_to_end/vllm_random_prompts.py CONFIG_DIR OUT.json VOCAB \
        1,8,32 [mtp=K]
"""
import json, sys, types
import numpy as np
sys.path.insert(0, ".")
from jaxspec.bench.baselines.vllm import build_request, run_vllm_baseline
cfg, out, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])
batches = [int(b) for b in sys.argv[4].split(",")]
spec = sys.argv[5] if len(sys.argv) > 5 else ""
results = []
for b in batches:
    n = max(4, 2 * b)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, 128).tolist() for _ in range(n)]
    method, _, k = spec.partition("=")
    args = types.SimpleNamespace(spec_method=method or None, num_spec_tokens=int(k or 0), max_concurrency=b,
                                 max_model_len=1024, max_num_batched_tokens=512, temperature=0.0, seed=0,
                                 ignore_eos=True, random_weights=True, dtype="bfloat16", vllm_memory_fraction=0.85)
    req = build_request(args, prompts, [256] * n, cfg, None)
    res = run_vllm_baseline(req)
    res.pop("token_ids", None)
    res.update(batch=b, spec=res.get("spec"), requested_spec=spec)
    print("VLLM", spec or "plain", "b", b, "tok/s", res.get("output_throughput"), "tpot", res.get("tpot_ms"),
          res.get("spec"), flush=True)
    results.append(res)
    json.dump(results, open(out, "w"), indent=1, default=float)
