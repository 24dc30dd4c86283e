"""vLLM beside benchmarks/end_to_end/long_prompts.py: the same flags, the same prompts (same seed, same order, the
same discarded warm-up runs) and the same report keys, through vLLM's offline `LLM` with dummy weights for a
KNOWN_SHAPES preset (its config.json written by vllm_startup.model_dir) or a checkpoint directory.

    PYTHONPATH=/tmp/vllm-site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/end_to_end/vllm_long_prompts.py \
        --model qwen2.5-coder-1.5b-instruct --random-weights --runs 1x2048 1x8192 8x8192 --json vllm.json

TTFT is vLLM's own per-request `first_token_latency` (arrival to first token, as jaxspec's `ttft`); TPOT is
(last token - first token) / (tokens - 1) per request. Prefix caching is on in both (their defaults): the decode pass
hits it. `--max-num-batched-tokens` left out keeps vLLM's default, which the report records.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from long_prompts import common_args, max_model_len, measure_runs  # noqa: E402


def first_token_latency(output) -> float:
    m = output.metrics
    value = getattr(m, "first_token_latency", None)
    if value:
        return float(value)
    return float(m.first_token_ts - m.queued_ts)   # engine-core clock: the same request's queue to first token


def tpot(output) -> float | None:
    m, n = output.metrics, len(output.outputs[0].token_ids)
    if n < 2 or not getattr(m, "last_token_ts", None):
        return None
    return (m.last_token_ts - m.first_token_ts) / (n - 1)


def main():
    p = common_args(__doc__)
    p.add_argument("--config-root", default="/tmp/vllm-configs")
    args = p.parse_args()

    import numpy as np
    from vllm import LLM, SamplingParams

    import vllm_startup
    model = vllm_startup.model_dir(args.model, args.config_root)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    kwargs = dict(model=model, dtype=args.dtype, max_num_seqs=max(c for c, _ in args.runs),
                  max_model_len=max_model_len(args), gpu_memory_utilization=args.gpu_memory_utilization or 0.85,
                  skip_tokenizer_init=True, seed=args.seed,
                  disable_log_stats=False)   # the per-request timings below come with the stats
    if args.random_weights:
        kwargs["load_format"] = "dummy"
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    # a preset's config may give fewer positions than the longest run needs; the weights are random either way
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    rows = measure_runs(args.runs, lambda prompts, sp: llm.generate(prompts, sp, use_tqdm=False), rng, vocab, first,
                        params, first_token_latency, tpot, lambda o: list(o.outputs[0].token_ids))
    sched = llm.llm_engine.vllm_config.scheduler_config
    result = {"engine": "vllm", "model": args.model, "random_weights": args.random_weights, "dtype": args.dtype,
              "max_num_batched_tokens": sched.max_num_batched_tokens, "max_model_len": max_model_len(args),
              "kv_cache_dtype": args.kv_cache_dtype, "startup_s": startup_s, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
