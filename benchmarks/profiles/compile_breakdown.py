"""Where a fresh engine's start-up compile time goes (issue #35): every warm-up variant of the step, traced, lowered
and compiled one by one (seconds each, the HLO's size, its Pallas/Triton kernels: call sites and distinct ones),
or all of them compiled at once from a pool of threads (lowered first, one by one: tracing holds the GIL).

    JAXSPEC_CACHE=$(mktemp -d) python3 benchmarks/profiles/compile_breakdown.py --mode serial
    JAXSPEC_CACHE=$(mktemp -d) python3 benchmarks/profiles/compile_breakdown.py --mode parallel --threads 12
    ... --draft-model qwen2.5-coder-0.5b-instruct --k 4 [--adaptive]     # the draft model's share
    ... --options triton_off                                              # no Triton GEMMs: no autotuning

Random bf16 weights of a preset. Run each mode in its own process with an empty JAXSPEC_CACHE: XLA keeps autotuning
results in memory, so a second compile of the same GEMMs in one process is cheaper. Prints one JSON line per variant
and one summary line.
"""
import argparse
import collections
import concurrent.futures
import hashlib
import json
import os
import re
import sys
import time

T_PROCESS = time.perf_counter()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def kernel_stats(hlo: str) -> dict:
    """Pallas (Triton) custom calls in a lowered module: call sites, and distinct kernels (their lines with the
    operand names and locations taken out: the kernel's serialized IR and its launch configuration)."""
    calls = [line for line in hlo.splitlines() if "__gpu$xla.gpu.triton" in line]
    bodies = {hashlib.sha1(re.sub(r"%[\w#:]+|loc\(#?[\w]+\)", "", c).encode()).hexdigest() for c in calls}
    return {"triton_call_sites": len(calls), "triton_distinct": len(bodies)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--adaptive", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--attention", default="auto")
    p.add_argument("--mode", choices=["serial", "parallel"], default="serial")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--options", choices=["engine", "triton_off"], default="engine")
    p.add_argument("--buckets", type=int, nargs="*", default=None, help="only these token buckets")
    p.add_argument("--label", default="")
    args = p.parse_args()
    import jax
    t_import = time.perf_counter() - T_PROCESS

    from jaxspec import LLM
    from jaxspec.models.random import random_model
    t0 = time.perf_counter()
    model = random_model(args.model, dtype="bfloat16", seed=0)
    spec = None
    if args.draft_model:
        spec = {"method": "draft_model", "model": random_model(args.draft_model, dtype="bfloat16", seed=1),
                "num_speculative_tokens": args.k, "adaptive": args.adaptive}
    t_weights = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=args.max_num_batched_tokens,
              warmup=False, attention=args.attention, speculative_config=spec)
    t_engine = time.perf_counter() - t0
    runner = llm.engine.runner
    todo = [(T, v) for T in runner.token_buckets for v in llm.engine._warm_variants()
            if not args.buckets or T in args.buckets]
    head = {"label": args.label, "mode": args.mode, "model": args.model, "draft": args.draft_model,
            "adaptive": args.adaptive, "options": args.options, "import_s": round(t_import, 2),
            "weights_s": round(t_weights, 2), "engine_s": round(t_engine, 2), "variants": len(todo),
            "device": jax.devices()[0].device_kind}
    print(json.dumps(head), flush=True)

    def options(T):
        opts = dict(runner.ops.compiler_options(T))
        if args.options == "triton_off":
            opts["xla_gpu_enable_triton_gemm"] = False
        return opts

    def lower(T, v):
        import jax.numpy as jnp
        from jaxspec.decode.step import make_step
        fn = make_step(runner.target, runner.drafter, runner.step_config, T, runner.rows_for(T), v,
                       compiler_options=options(T))
        buf = jnp.zeros(runner.new_inputs(T).pack().shape, jnp.int32)
        t1 = time.perf_counter()
        traced = fn.trace(runner.params, runner.drafter_params, runner.state, buf, runner.new_outbox(T, v),
                          *runner._table_args(v, None))
        t2 = time.perf_counter()
        lowered = traced.lower()
        t3 = time.perf_counter()
        return lowered, t2 - t1, t3 - t2

    def name(v):
        return ("sample" if v.sample else "greedy") + ("" if v.drafts is None else f"-k{v.drafts}")

    t_all = time.perf_counter()
    rows = []
    if args.mode == "serial":
        for T, v in todo:
            lowered, trace_s, lower_s = lower(T, v)
            text = lowered.as_text()
            t1 = time.perf_counter()
            lowered.compile()
            compile_s = time.perf_counter() - t1
            row = {"bucket": T, "variant": name(v), "trace_s": round(trace_s, 2), "lower_s": round(lower_s, 2),
                   "compile_s": round(compile_s, 2), "hlo_chars": len(text), **kernel_stats(text)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    else:
        lowered_all, t_lowering = [], time.perf_counter()
        for T, v in todo:
            lowered, trace_s, lower_s = lower(T, v)
            lowered_all.append((T, v, lowered, trace_s, lower_s))
        t_lowering = time.perf_counter() - t_lowering

        def compile_one(item):
            T, v, lowered, trace_s, lower_s = item
            t1 = time.perf_counter()
            lowered.compile()
            return {"bucket": T, "variant": name(v), "trace_s": round(trace_s, 2), "lower_s": round(lower_s, 2),
                    "compile_s": round(time.perf_counter() - t1, 2), "done_at_s": round(time.perf_counter() - t_all, 2)}
        with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
            for row in pool.map(compile_one, lowered_all):
                rows.append(row)
                print(json.dumps(row), flush=True)
        print(json.dumps({"lowering_all_s": round(t_lowering, 2)}), flush=True)
    total = time.perf_counter() - t_all
    by = collections.defaultdict(float)
    for r in rows:
        for k in ("trace_s", "lower_s", "compile_s"):
            by[k] += r[k]
    print(json.dumps({"summary": args.label, "wall_s": round(total, 1), **{f"sum_{k}": round(s, 1) for k, s in by.items()},
                      "process_s": round(time.perf_counter() - T_PROCESS, 1)}), flush=True)


if __name__ == "__main__":
    main()
