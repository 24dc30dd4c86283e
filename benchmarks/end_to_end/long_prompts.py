"""Long prompts: time to first token, prompt throughput and the decode step over the prompt's context, for runs of
C requests of N prompt tokens sent at once (`--runs 1x2048 1x8192 1x32768 8x8192 32x8192`). The engine is built once
(warm-up `--warmup`, then every bucket compiled before timing); every prompt is fresh random token ids. Before each
timed run a discarded one warms its shapes: the same run for one request, C requests of 256 tokens for a batch (so
that a warm-up never prefills another 262,144 tokens).

Each run is two passes over its prompts. The prefill pass asks one token of each: TTFT (median and max over its
requests) and prompt throughput = C x N / the last request's TTFT (all arrive together, so that is when the last
prefill finished). The decode pass sends the same prompts again for `--output-len` tokens: the prefix cache holds
them, so every request starts decoding at once and the median per-request TPOT is the decode step at batch C over
that context (in one pass, the first requests' tokens would wait on the others' prefill chunks).
`benchmarks/end_to_end/vllm_long_prompts.py` runs the same prompts through vLLM and reports the same keys.

    python3 benchmarks/end_to_end/long_prompts.py --model qwen2.5-coder-1.5b-instruct --random-weights \
        --runs 1x2048 1x8192 1x32768 8x8192 --max-num-batched-tokens 2048 --json out.json

`--interference 8x32704`: 8 requests of 128-token prompts decode while one 32,704-token prompt arrives and prefills;
reported: their inter-token latency before it arrived and while it prefilled (median, p99, max: the TPOT bound of
running requests under a long prompt, chunked by the step's token budget) and its TTFT.

JAXSPEC_PREFILL_ATTENTION_FROM_TOKENS=0 keeps every step on the per-token kernel (the prefill kernel's before);
--fused-pages-per-split 0 the decode kernel's split count of short contexts; --kv-cache-dtype fp8 the fp8 KV cache.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

WARM_BATCH_TOKENS = 256
DECODER_PROMPT = 128      # --interference: the decoding requests' prompt tokens


def parse_run(text: str) -> tuple[int, int]:
    """'8x8192' -> (8 requests, 8192 prompt tokens); '2048' -> (1, 2048)."""
    c, _, n = text.rpartition("x")
    try:
        return int(c or 1), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"run {text!r}: expected REQUESTSxTOKENS such as 8x8192, or TOKENS")


def common_args(description: str) -> argparse.ArgumentParser:
    """The flags both engines' scripts take, so that one command line runs the same workload through either."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=parse_run, nargs="+", default=[(1, 2048), (1, 8192), (1, 32768)],
                   help="REQUESTSxPROMPT_TOKENS per run (a bare number is one request)")
    p.add_argument("--output-len", type=int, default=32, help="decoded tokens per request (the TPOT over the context)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the step's token budget (default: the engine's own)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="the engine's share of device memory (vLLM's sizing; jaxspec's default: half the free memory "
                        "for the KV pool, vLLM's here 0.85)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    return p


def warm_run(count: int, tokens: int) -> tuple[int, int]:
    """The discarded run before a timed one: the same for one request, else `count` short prompts."""
    return (1, tokens) if count == 1 else (count, min(tokens, WARM_BATCH_TOKENS))


def max_model_len(args) -> int:
    """Room for the longest prompt of the runs (and of --interference, where the script has it, whose decoding
    requests need their prompt and some tokens) and its output."""
    interference = getattr(args, "interference", [])
    longest = max([n for _, n in args.runs + interference] + [2 * DECODER_PROMPT for _ in interference[:1]])
    return longest + args.output_len + 16


def prompts_for(rng, vocab: int, count: int, tokens: int) -> list[dict]:
    return [{"prompt_token_ids": rng.integers(10, vocab - 10, tokens).tolist()} for _ in range(count)]


def summarise(count: int, tokens: int, ttfts: list[float], cached_ttfts: list[float], tpots: list[float],
              token_ids) -> dict:
    """One run's report from its prefill pass (`ttfts`) and its decode pass (`cached_ttfts`, `tpots`)."""
    import numpy as np
    last = max(ttfts)
    row = {"requests": count, "prompt_tokens": tokens, "ttft_s": float(np.median(ttfts)), "ttft_max_s": last,
           "prompt_tokens_per_s": count * tokens / last, "cached_ttft_s": float(np.median(cached_ttfts)),
           "tpot_ms": 1e3 * float(np.median(tpots)) if tpots else float("nan"), "token_ids": token_ids}
    print(f"{count:>3} x {tokens:>6} tokens: TTFT {row['ttft_s']:.3f} s (last {last:.3f} s, "
          f"{row['prompt_tokens_per_s']:.0f} prompt tok/s), TPOT {row['tpot_ms']:.2f} ms "
          f"(cached prompt: TTFT {row['cached_ttft_s']:.3f} s)", flush=True)
    return row


def measure_runs(runs, generate, rng, vocab: int, first, params, ttft, tpot, token_ids) -> list[dict]:
    """Every run (module docstring) through `generate(prompts, sampling_params)`, either engine's: its warm-up, the
    one-token prefill pass (`first`) and the decode pass (`params`); ttft / tpot / token_ids read one output."""
    rows = []
    for count, tokens in runs:
        generate(prompts_for(rng, vocab, *warm_run(count, tokens)), params)
        prompts = prompts_for(rng, vocab, count, tokens)
        prefill, outs = generate(prompts, first), generate(prompts, params)
        rows.append(summarise(count, tokens, [ttft(o) for o in prefill], [ttft(o) for o in outs],
                              [t for t in map(tpot, outs) if t is not None], [token_ids(o) for o in outs]))
    return rows


def interference(llm, rng, vocab: int, decoders: int, tokens: int) -> dict:
    """`decoders` requests decoding while one prompt of `tokens` tokens arrives and prefills: their inter-token
    latencies before it came and while it prefilled, and its TTFT."""
    import numpy as np

    from jaxspec import SamplingParams
    engine = llm.engine
    room = engine.step_config.max_model_len - DECODER_PROMPT - 1
    running = [engine.add_request(p["prompt_token_ids"], SamplingParams(temperature=0.0, max_tokens=room,
                                                                       ignore_eos=True))
               for p in prompts_for(rng, vocab, decoders, DECODER_PROMPT)]
    while any(len(r.output_token_ids) < 8 for r in running):
        engine.step()
    arrived = time.perf_counter()
    long = engine.add_request(prompts_for(rng, vocab, 1, tokens)[0]["prompt_token_ids"],
                              SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while not long.output_token_ids:
        engine.step()
    first = long.token_times[0]
    for r in running:
        engine.abort(r.request_id)
    engine.run_until(lambda: long.finished and all(r.finished for r in running))

    def gaps(lo, hi):
        return [b - a for r in running for a, b in zip(r.token_times, r.token_times[1:]) if lo <= b <= hi]
    before, during = gaps(0.0, arrived), gaps(arrived, first)
    stat = lambda g: {"median_ms": 1e3 * float(np.median(g)), "p99_ms": 1e3 * float(np.percentile(g, 99)),  # noqa: E731
                      "max_ms": 1e3 * float(np.max(g))} if g else None
    row = {"decoders": decoders, "prompt_tokens": tokens, "ttft_s": first - arrived, "itl_before": stat(before),
           "itl_during_prefill": stat(during)}
    print(f"{decoders} decoding while {tokens} tokens prefill: TTFT {row['ttft_s']:.3f} s; their ITL median / p99 / "
          f"max {row['itl_before']['median_ms']:.2f} / {row['itl_before']['p99_ms']:.2f} / "
          f"{row['itl_before']['max_ms']:.2f} ms before, {row['itl_during_prefill']['median_ms']:.2f} / "
          f"{row['itl_during_prefill']['p99_ms']:.2f} / {row['itl_during_prefill']['max_ms']:.2f} ms during",
          flush=True)
    return row


def main():
    p = common_args(__doc__)
    p.add_argument("--warmup", default="fast")
    p.add_argument("--interference", type=parse_run, nargs="*", default=[], metavar="DECODERSxTOKENS",
                   help="DECODERS requests decoding while one prompt of TOKENS tokens prefills (module docstring)")
    p.add_argument("--prefill-heads-per-program", type=int, default=None,
                   help="jaxspec.pallas.prefill_attention.HEADS_PER_PROGRAM (1: one program per query head)")
    p.add_argument("--fused-pages-per-split", type=int, default=None,
                   help="jaxspec.pallas.paged_attention.FUSED_PAGES_PER_SPLIT (0: decode splits as for short contexts)")
    args = p.parse_args()
    import jaxspec.pallas.paged_attention as pa
    import jaxspec.pallas.prefill_attention as prefill
    if args.fused_pages_per_split is not None:
        pa.FUSED_PAGES_PER_SPLIT = args.fused_pages_per_split
    if args.prefill_heads_per_program is not None:
        prefill.HEADS_PER_PROGRAM = args.prefill_heads_per_program

    import numpy as np

    from jaxspec import LLM, SamplingParams
    model = args.model
    if args.random_weights:
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype=args.dtype, seed=0)
    budget = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    if args.gpu_memory_utilization is not None:
        budget["gpu_memory_utilization"] = args.gpu_memory_utilization
    t0 = time.perf_counter()
    most = max([c for c, _ in args.runs] + [d + 1 for d, _ in args.interference])
    llm = LLM(model, dtype=args.dtype, max_num_seqs=most, max_model_len=max_model_len(args),
              warmup=args.warmup, kv_cache_dtype=args.kv_cache_dtype, **budget)
    llm.engine.wait_compiled()
    startup_s = time.perf_counter() - t0
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows = measure_runs(args.runs, lambda prompts, sp: llm.generate(prompts, sp, use_tqdm=False), rng, vocab, first,
                        params, lambda o: o.metrics["ttft"], lambda o: o.metrics["tpot"], lambda o: list(o.token_ids))
    interfered = [interference(llm, rng, vocab, d, n) for d, n in args.interference]
    result = {"engine": "jaxspec", "model": args.model, "random_weights": args.random_weights, "dtype": args.dtype,
              "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
              "max_model_len": llm.engine.step_config.max_model_len,
              "prefill_attention_from_tokens": llm.engine.runner.ops.prefill_attention_from_tokens,
              "fused_pages_per_split": pa.FUSED_PAGES_PER_SPLIT, "prefill_heads_per_program": prefill.HEADS_PER_PROGRAM,
              "kv_cache": llm.engine.kv_cache(), "startup_s": startup_s, "rows": rows, "interference": interfered}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
