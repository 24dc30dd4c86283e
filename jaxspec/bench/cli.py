"""`jaxspec-bench`: throughput, latency, speculation and bubble measurements, in the shape of `vllm bench`.

    jaxspec-bench --model smollm2-135m-instruct --dataset random --num-prompts 8 --input-len 32 --output-len 32
    jaxspec-bench --model qwen2.5-coder-1.5b-instruct --dataset humaneval --spec-method draft_model \
        --draft-model qwen2.5-coder-0.5b-instruct --num-spec-tokens 4 --temperature 0 --compare
    jaxspec-bench --dataset prefix --prefix-len 1024 --input-len 32 --request-rate 4     # arrivals over time
    jaxspec-bench --base-url http://127.0.0.1:8000 --dataset random --max-concurrency 32  # a running server
    jaxspec-bench --structured-json benchmarks/schemas/person.json --max-concurrency 8 --baseline vllm  # JSON outputs

All requests are submitted at once and served by `LLM.generate`, unless --request-rate, --base-url or a
multi-turn dataset asks for arrivals over time (jaxspec/bench/online.py).

--structured-json / --structured-regex / --structured-choice put one constraint (structured outputs) on every
request, here and in the vLLM baseline. A constrained request ends where its automaton accepts (EOS is allowed
there only) or at --output-len, whatever --ignore-eos says: with EOS ignored the grammar would allow nothing but
EOS after a complete output (jaxspec would emit EOS until --output-len, vLLM unconstrained tokens). Output
lengths therefore differ per request and per engine; the report counts the tokens actually generated and how
many outputs match the constraint.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from jaxspec.bench.measure import HBM_BANDWIDTH, run_config, speedup_bounds, steady_state
from jaxspec.bench.report import plot, print_report, write_json
from jaxspec.bench.workloads import DATASETS, load_workload, structured_from_args, tokenizer_for


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU, float32 on CPU), bfloat16, float32")
    p.add_argument("--random-weights", action="store_true",
                   help="the model's (and draft model's) shapes with random weights: step times without "
                        "the checkpoints (acceptance is meaningless)")
    p.add_argument("--spec-method", choices=["draft_model", "eagle", "eagle3", "mtp", "ngram"])
    p.add_argument("--draft-model")
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--adaptive-spec", action="store_true",
                   help="choose the speculation length per step in 0..--num-spec-tokens (SpeculativeConfig.adaptive)")
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--prefix-len", type=int, default=1024, help="prefix: tokens of the shared system prompt")
    p.add_argument("--max-turns", type=int, default=4, help="sharegpt-multiturn: user turns per conversation")
    p.add_argument("--dataset-path", help="--dataset file: a JSON workload written by --save-workload")
    p.add_argument("--save-workload", help="write the workload's token ids here (JSON) and exit")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=512, help="sharegpt: longest prompt kept")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--attention", default="auto", choices=["auto", "pallas", "reference"],
                   help="paged attention: the Pallas kernel or the jnp gather (auto: the kernel on a GPU)")
    p.add_argument("--delta-rule", default="auto", choices=["auto", "reference", "pallas"],
                   help="hybrid models' Gated DeltaNet recurrence: the JAX scan or the Pallas kernel")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="devices to split the model over")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests (conversations) per second, Poisson arrivals; inf: all at once")
    p.add_argument("--base-url", help="benchmark a running `jaxspec serve` (or any OpenAI-compatible server)")
    p.add_argument("--served-model-name", help="--base-url: the model id to send (default: --model)")
    p.add_argument("--api-key", help="--base-url: bearer key (default: $JAXSPEC_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="--base-url with random prompts: token ids are drawn below this (no model is loaded)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="requests run to --output-len (not for constrained requests: they end where their "
                        "constraint is complete)")
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--structured-json", metavar="SCHEMA",
                            help="structured outputs: every request's output is JSON matching this schema (a "
                                 "file, e.g. benchmarks/schemas/person.json, or the schema's JSON text)")
    constraint.add_argument("--structured-regex", metavar="REGEX",
                            help="structured outputs: every request's output matches this regular expression")
    constraint.add_argument("--structured-choice", metavar="CHOICE", nargs="+",
                            help="structured outputs: every request's output is one of these strings")
    p.add_argument("--structured-disable-any-whitespace", action="store_true",
                   help="--structured-json: no whitespace between JSON tokens, in jaxspec and vLLM alike (by "
                        "default jaxspec allows one optional space there and vLLM's xgrammar any whitespace, "
                        "which a model with random weights may spend its --output-len on)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--async", dest="async_scheduling", action="store_true", default=True)
    mode.add_argument("--sync", dest="async_scheduling", action="store_false")
    p.add_argument("--compare", action="store_true", help="sync/async x speculation off/on, with ratios")
    p.add_argument("--steady-state", type=int, nargs="*", metavar="BATCH",
                   help="also measure steady-state decode step time, device-busy fraction and HBM roofline "
                        "at these batch sizes (unconstrained requests, also with --structured-*)")
    p.add_argument("--steady-steps", type=int, default=32)
    p.add_argument("--hbm-bandwidth", type=float, default=HBM_BANDWIDTH, help="bytes/s for the roofline")
    p.add_argument("--baseline", choices=["hf", "vllm"],
                   help="also run the prompts through transformers (hf) or vLLM's offline LLM (vllm: the same "
                        "token ids, lengths, batch size, sampling and speculation, in a process of its own)")
    p.add_argument("--vllm-memory-fraction", type=float, default=0.45,
                   help="--baseline vllm: the share of device memory vLLM gets (jaxspec keeps the rest)")
    p.add_argument("--vllm-model", default=None,
                   help="--baseline vllm: the model path vLLM loads (default: --model's file or directory; with "
                        "--random-weights a directory holding the model's config.json is enough)")
    p.add_argument("--vllm-tokenizer", default=None,
                   help="--baseline vllm with --structured-*: the tokenizer vLLM loads (vLLM needs one to build "
                        "its grammar; default: jaxspec's own tokenizer of the model, saved to a temporary directory)")
    p.add_argument("--vllm-python", default=sys.executable,
                   help="--baseline vllm: the Python interpreter that has vLLM (default: this one)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a PNG of tokens/s and TPOT per configuration")
    p.add_argument("--profile", help="write a device trace (jax.profiler) of the first configuration here")
    p.add_argument("--quiet", action="store_true")
    return p


def model_from_args(args):
    """The model --model names, in --dtype: its checkpoint, or its shapes with random weights (--random-weights)."""
    from jaxspec.llm import _resolve_dtype
    from jaxspec.models.loader import load_model
    dtype = _resolve_dtype(args.dtype)
    if args.random_weights:
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype=dtype, seed=args.seed)
        if getattr(args, "structured", None) is not None:   # the constraint is compiled over the vocabulary
            model.tokenizer = tokenizer_for(args.model)
            if model.tokenizer is None:
                raise SystemExit(f"--structured-* needs a tokenizer, and --model {args.model!r} has none")
        return model
    return load_model(args.model, dtype=dtype)



def run(argv=None) -> list[dict]:
    """Runs the benchmark the arguments describe and returns its results (one dict per configuration)."""
    args = build_parser().parse_args(argv)
    args.structured, args.structured_report = structured_from_args(args)
    from jaxspec import LLM
    from jaxspec.bench import online
    from jaxspec.decode.sampling import is_random
    if args.base_url:
        tokenizer = None
        if args.dataset not in ("random", "prefix", "repeat"):
            tokenizer = model_from_args(args).tokenizer
        workload = load_workload(args, tokenizer, args.vocab_size)
        label = "serve" + ("+" + args.structured.kind if args.structured is not None else "")
        res = online.run_online(online.http_backend(args), workload.as_sessions(), args, label)
        print_report(res)
        if args.json:
            write_json([res], args.json)
        return [res]
    if args.baseline == "vllm":
        if args.dataset == "sharegpt-multiturn" or np.isfinite(args.request_rate):
            raise SystemExit("--baseline vllm runs offline workloads (all requests at once, no --request-rate, "
                             "no multi-turn dataset)")
        if not 0 < args.vllm_memory_fraction < 0.9:
            raise SystemExit(f"--vllm-memory-fraction={args.vllm_memory_fraction} is invalid; use a value in (0, 0.9)")
        from jaxspec.bench.baselines.vllm import vllm_available
        if args.vllm_python == sys.executable and not vllm_available():
            raise SystemExit("--baseline vllm needs vLLM in this Python environment (for example `pip install "
                             "vllm==0.23.0`, or the wheel set of ../shared/tools/vllm_wheels.sh), or "
                             "--vllm-python naming an interpreter that has it")
        # Both engines share the device: jaxspec's allocator takes only what vLLM leaves (set before JAX starts).
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.95 - args.vllm_memory_fraction:.2f}")
    model = model_from_args(args)
    spec = None
    if args.spec_method:
        spec = {"method": args.spec_method, "num_speculative_tokens": args.num_spec_tokens,
                "adaptive": args.adaptive_spec}
        if args.spec_method == "mtp" and args.random_weights:   # the head's shapes, random too
            from jaxspec.decode.drafters.mtp import random_mtp_params
            spec["model"] = random_mtp_params(model.config, model.params["embed"].dtype.name, args.seed + 1)
        elif args.spec_method == "mtp" and args.draft_model:   # mtp.* tensors elsewhere than the target's directory
            spec["model"] = args.draft_model
        elif args.spec_method not in ("ngram", "mtp"):
            if not args.draft_model:
                raise SystemExit(f"--spec-method {args.spec_method} needs --draft-model")
            spec["model"] = args.draft_model
            if args.random_weights and args.spec_method == "draft_model":   # the draft's shapes, random too
                from jaxspec.models.random import random_model
                spec["model"] = random_model(args.draft_model, dtype=model.params["embed"].dtype.name,
                                             seed=args.seed + 1)
    workload = load_workload(args, model.tokenizer, model.config.vocab_size)
    if args.save_workload:
        if any(isinstance(p, str) for p in workload.prompts):
            workload = dataclasses.replace(workload, prompts=[model.tokenizer.encode(p) if isinstance(p, str) else p
                                                              for p in workload.prompts], sessions=None)
        with open(args.save_workload, "w") as f:
            json.dump({"sessions": workload.as_sessions()}, f)
        print(f"wrote {sum(len(s) for s in workload.as_sessions())} requests to {args.save_workload}")
        return []
    configs = [(args.async_scheduling, spec)]
    if args.compare:
        configs = [(a, s) for s in ([None, spec] if spec else [None]) for a in (False, True)]
    results = []
    for i, (async_mode, sp) in enumerate(configs):
        label = f"{'async' if async_mode else 'sync'}{'+' + sp['method'] if sp else ''}"
        llm = LLM(model, max_num_seqs=args.max_concurrency, max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=async_mode,
                  speculative_config=sp, seed=args.seed, attention=args.attention, delta_rule=args.delta_rule,
                  enable_prefix_caching=args.enable_prefix_caching, tensor_parallel_size=args.tensor_parallel_size,
                  structured_compile_timeout=3600.0)
        if not args.enable_prefix_caching:
            label += "+no-prefix-cache"
        if args.structured is not None:
            label += "+" + args.structured.kind
            # its automaton and grammar steps, compiled before the clock starts
            llm.engine.warmup_structured(args.structured, sample=is_random(args.temperature))
        if args.profile and i == 0:
            import jax
            jax.profiler.start_trace(args.profile)
        if workload.sessions is not None or np.isfinite(args.request_rate):
            res = online.run_online(online.LocalBackend(llm), workload.as_sessions(), args, label)
            res["recompiles"] = llm.stats()["recompiles"]
        else:
            res = run_config(llm, workload, args, label)
        res["prefix_cache"] = llm.stats()["prefix_cache"]
        if args.profile and i == 0:
            jax.profiler.stop_trace()
        if args.steady_state:
            res["steady"] = [steady_state(llm, args, b) for b in args.steady_state]
        print_report(res)
        results.append(res)
        del llm
    speedup_bounds(results)
    if len(results) > 1:
        base = results[0]["output_throughput"]
        print("Output tokens/s relative to " + results[0]["label"] + ": " +
              ", ".join(f"{r['label']} {r['output_throughput'] / base:.2f}x" for r in results))
    if args.baseline == "hf":
        from jaxspec.bench.baselines.hf import run_hf_baseline
        hf = run_hf_baseline(args, workload)
        ours = results[-1]
        for r in hf:
            same_batch = r.get("batch") == args.max_concurrency
            ratio = (f"jaxspec {ours['label']} at batch {args.max_concurrency}: "
                     f"{ours['output_throughput'] / r['output_throughput']:.2f}x" if same_batch else
                     "(other batch size: compare with a jaxspec run at that --max-concurrency)")
            print(f"{r['label']:<28}{r['output_throughput']:>10.2f} tok/s   {ratio}")
        results += hf
    if args.baseline == "vllm":
        from jaxspec.bench.baselines.vllm import side_by_side
        results.append(side_by_side(args, model, workload, results[-1]))
    if args.json:
        write_json(results, args.json)
    if args.plot:
        plot(results, args.plot)
    return results


def main(argv=None) -> int:
    """The `jaxspec-bench` console script."""
    run(argv)
    return 0

