"""Where the step's compile time goes (issue #11): one token bucket of a model's step, lowered and compiled
explicitly, greedy variant then the sampling variant of the same shapes, then the device time of the compiled
greedy step. Run it once per setting to compare (XLA_FLAGS, --attention, --spec):

    python3 scripts/compile_probe.py --model qwen2.5-coder-1.5b-instruct --tokens 64 [--attention reference]
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python3 scripts/compile_probe.py ...

Prints one JSON line: seconds to trace+lower and to compile each variant, and the step's device time.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("PROBE_DUMP_AFTER", "1e9")), exit=True)
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--tokens", type=int, default=64, help="the token bucket compiled")
    p.add_argument("--attention", default="auto")
    p.add_argument("--spec", default=None, help="a speculative_config as JSON (random weights for the drafter too)")
    p.add_argument("--label", default="")
    args = p.parse_args()
    import jax
    import numpy as np

    from jaxspec import LLM
    from jaxspec.decode.step import StepVariant
    from jaxspec.models.random import random_model

    t0 = time.perf_counter()
    model = random_model(args.model, dtype="bfloat16", seed=0)
    spec = json.loads(args.spec) if args.spec else None
    llm = LLM(model, max_num_seqs=32, max_model_len=2048, max_num_batched_tokens=args.tokens, warmup=False,
              attention=args.attention, speculative_config=spec, enable_prefix_caching=False)
    runner = llm.engine.runner
    setup = time.perf_counter() - t0
    T = args.tokens
    out = {"label": args.label, "xla_flags": os.environ.get("XLA_FLAGS", ""), "attention": args.attention,
           "tokens": T, "setup_s": round(setup, 1)}
    for name, variant in (("greedy", StepVariant()), ("sample", StepVariant(sample=True))):
        fn = runner.step_fn(T, variant)
        buf = jax.device_put(runner.new_inputs(T).pack())
        t1 = time.perf_counter()
        lowered = fn.lower(runner.params, runner.drafter_params, runner.state, buf)
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3 = time.perf_counter()
        out[f"{name}_lower_s"], out[f"{name}_compile_s"] = round(t2 - t1, 2), round(t3 - t2, 2)
        if name == "greedy":
            hlo = compiled.as_text()
            out["custom_calls"] = hlo.count("custom-call(")
            out["fusions"] = hlo.count(" fusion(")
            state, times = runner.state, []
            for _ in range(8):
                t4 = time.perf_counter()
                state, res = compiled(runner.params, runner.drafter_params, state, jax.device_put(buf))
                jax.block_until_ready(res)
                times.append(time.perf_counter() - t4)
            out["step_ms"] = round(float(np.median(times[2:])) * 1e3, 3)
            runner.state = state
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
