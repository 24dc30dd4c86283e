"""Where the step's compile time goes and what each GEMM backend costs per token bucket (issue #11): each bucket
of a model's step compiled with XLA's Triton GEMMs (autotuned) and with cuBLAS (`xla_gpu_enable_triton_gemm`
off, per compile through `compiler_options`), timed to compile and to run (all-padding inputs: every matmul
runs at the bucket's full size; attention reads only the trash slot).

    python3 benchmarks/profiles/compile_probe.py --model qwen2.5-coder-1.5b-instruct --tokens 8 32 128 512
    python3 benchmarks/profiles/compile_probe.py ... --autotune-cache /tmp/xla-autotune   # then again: cache hits

Prints one JSON line per (bucket, backend).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a preset (random weights) or a file")
    p.add_argument("--tokens", type=int, nargs="+", default=[64])
    p.add_argument("--backends", nargs="+", default=["triton", "cublas"], choices=["triton", "cublas", "default"])
    p.add_argument("--autotune-cache", default=None, help="xla_gpu_per_fusion_autotune_cache_dir")
    p.add_argument("--attention", default="auto")
    p.add_argument("--label", default="")
    args = p.parse_args()
    import jax
    import numpy as np

    from jaxspec import LLM
    from jaxspec.decode.step import StepVariant, make_step

    t0 = time.perf_counter()
    if os.path.exists(args.model):
        from jaxspec.models.loader import load_model
        model = load_model(args.model, dtype="bfloat16")
    else:
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype="bfloat16", seed=0)
    llm = LLM(model, max_num_seqs=32, max_model_len=2048, max_num_batched_tokens=max(args.tokens), warmup=False,
              attention=args.attention, enable_prefix_caching=False)
    runner = llm.engine.runner
    setup = time.perf_counter() - t0
    for T in args.tokens:
        for backend in args.backends:
            opts = {} if backend == "default" else {"xla_gpu_enable_triton_gemm": backend == "triton"}
            if args.autotune_cache:
                opts["xla_gpu_per_fusion_autotune_cache_dir"] = args.autotune_cache
            fn = make_step(runner.target, runner.drafter, runner.step_config, T, runner.rows_for(T), StepVariant(),
                           compiler_options=opts)
            buf = jax.device_put(runner.new_inputs(T).pack())
            outbox = runner.new_outbox(T, StepVariant())
            t1 = time.perf_counter()
            lowered = fn.lower(runner.params, runner.drafter_params, runner.state, buf, outbox)
            t2 = time.perf_counter()
            compiled = lowered.compile()
            t3 = time.perf_counter()
            state, times = runner.state, []
            for _ in range(12):
                t4 = time.perf_counter()
                state, outbox = compiled(runner.params, runner.drafter_params, state, buf, outbox)
                jax.block_until_ready(outbox)
                times.append(time.perf_counter() - t4)
            runner.state = state
            hlo = compiled.as_text()
            print(json.dumps({"label": args.label, "tokens": T, "backend": backend, "setup_s": round(setup, 1),
                              "lower_s": round(t2 - t1, 2), "compile_s": round(t3 - t2, 2),
                              "custom_calls": hlo.count("custom-call("), "step_ms": round(
                                  float(np.median(times[3:])) * 1e3, 3)}), flush=True)


if __name__ == "__main__":
    main()
