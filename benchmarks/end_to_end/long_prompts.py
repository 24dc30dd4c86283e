"""Long prompts, one request at a time: time to first token and the decode step over the prompt's context, per
prompt length. The engine is built once (warm-up `--warmup`, then every bucket compiled before timing), and each
length runs `--repeats` requests of fresh random token ids (no prefix-cache hit); the first request of each length
is discarded (a bucket's first run).

    python3 benchmarks/end_to_end/long_prompts.py --model qwen2.5-coder-1.5b-instruct --random-weights \
        --lengths 2048 8192 32768 --max-num-batched-tokens 2048 --json out.json

JAXSPEC_PREFILL_ATTENTION_FROM_TOKENS=256 runs steps of 256 tokens or more on the prefill kernel's query tiles
(jaxspec.nn.ops.Ops.prefill_attention_from_tokens; off by default until timed on a GPU), 0 on the per-token kernel:
the before/after. --kv-cache-dtype fp8 for the fp8 KV cache.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--output-len", type=int, default=32, help="decoded tokens per request (the TPOT over the context)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--warmup", default="fast")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--json")
    args = p.parse_args()

    import numpy as np

    from jaxspec import LLM, SamplingParams
    model = args.model
    if args.random_weights:
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype=args.dtype, seed=0)
    max_len = max(args.lengths) + args.output_len + 16
    t0 = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, max_num_seqs=1, max_model_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens, warmup=args.warmup,
              kv_cache_dtype=args.kv_cache_dtype)
    llm.engine.wait_compiled()
    startup_s = time.perf_counter() - t0
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for n in args.lengths:
        runs = []
        for _ in range(args.repeats + 1):
            prompt = {"prompt_token_ids": rng.integers(10, vocab - 10, n).tolist()}
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            runs.append((out.metrics["ttft"], out.metrics["tpot"], list(out.token_ids)))
        ttft = [r[0] for r in runs[1:]]
        tpot = [r[1] for r in runs[1:]]
        row = {"prompt_tokens": n, "ttft_s": float(np.median(ttft)), "ttft_all_s": ttft,
               "prompt_tokens_per_s": n / float(np.median(ttft)), "tpot_ms": 1e3 * float(np.median(tpot)),
               "first_run_ttft_s": runs[0][0], "token_ids": [r[2] for r in runs]}
        rows.append(row)
        print(f"{n:>6} tokens: TTFT {row['ttft_s']:.3f} s ({row['prompt_tokens_per_s']:.0f} tok/s), "
              f"TPOT {row['tpot_ms']:.2f} ms", flush=True)
    result = {"model": args.model, "random_weights": args.random_weights, "dtype": args.dtype,
              "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": max_len,
              "prefill_attention_from_tokens": llm.engine.runner.ops.prefill_attention_from_tokens,
              "kv_cache": llm.engine.kv_cache(), "startup_s": startup_s, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
