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
multi-turn dataset asks for arrivals over time (jaxspec/bench/online.py). The clock starts once every step program
of the engine is compiled, whatever --warmup says.

--structured-json / --structured-regex / --structured-choice put one constraint (structured outputs) on every
request, here and in the vLLM baseline. A constrained request ends where its automaton accepts (EOS is allowed
there only) or at --output-len, whatever --ignore-eos says: with EOS ignored the grammar would allow nothing but
EOS after a complete output (jaxspec would emit EOS until --output-len, vLLM unconstrained tokens). Output
lengths therefore differ per request and per engine; the report counts the tokens actually generated and how
many outputs match the constraint.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys

import numpy as np

from jaxspec.bench.args import build_parser as build_bench_parser
from jaxspec.bench.args import check_args
from jaxspec.bench.engine import engine_options, model_from_args, resolve_max_model_len, with_random_draft
from jaxspec.bench.measure import run_config, speedup_bounds, steady_state
from jaxspec.bench.report import plot, print_report, write_json
from jaxspec.bench.workloads import load_workload
from jaxspec.cli_args import one_line_errors

# A constraint compiles (its automaton and grammar steps) before the clock starts, however long it takes: the
# engine's default timeout (LLM's structured_compile_timeout) is a server's limit for one request.
STRUCTURED_COMPILE_TIMEOUT = 3600.0


def build_parser() -> argparse.ArgumentParser:
    """`jaxspec-bench`'s parser (jaxspec/bench/args.py), described by this module's text."""
    return build_bench_parser("jaxspec-bench", __doc__)


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
    if args.base_url:
        return run_against_server(args)
    return run_in_process(args)


# ---- --base-url: a running server -------------------------------------------------------------------------
def run_against_server(args) -> list[dict]:
    """The workload sent to the server at --base-url over HTTP (its engine, speculation and length are its own)."""
    from jaxspec.bench import online
    backend = online.http_backend(args)
    online.check_reachable(backend)
    tokenizer = None
    if args.dataset not in ("random", "prefix", "repeat"):   # text prompts, tokenized with --model's tokenizer
        model = model_from_args(args)
        resolve_max_model_len(args, model.config)
        tokenizer = model.tokenizer
    workload = nonempty(load_workload(args, tokenizer, args.vocab_size), args)
    label = "serve" + ("+" + args.structured.kind if args.structured is not None else "")
    res = online.run_online(backend, workload.as_sessions(), args, label)
    print_report(res)
    write_outputs(args, [res])
    return [res]


# ---- engines in this process ------------------------------------------------------------------------------
def run_in_process(args) -> list[dict]:
    """The workload through jaxspec's engine, one configuration after another (--compare: sync/async x speculation
    off/on), then through --baseline's engine; or, with --save-workload, the workload written and nothing run."""
    if args.baseline == "vllm":
        share_the_device_with_vllm(args)
    model = model_from_args(args)
    resolve_max_model_len(args, model.config)
    spec = with_random_draft(args, model, args.spec)
    workload = nonempty(load_workload(args, model.tokenizer, model.config.vocab_size), args)
    if args.save_workload:
        save_workload(args, model, workload)
        return []
    results = [run_configuration(args, model, workload, async_scheduling, sp, profile=(i == 0))
               for i, (async_scheduling, sp) in enumerate(configurations(args, spec))]
    speedup_bounds(results)
    print_relative_throughput(results)
    if args.baseline == "hf":
        results += run_hf_baseline(args, workload, results[-1])
    if args.baseline == "vllm":
        from jaxspec.bench.baselines.vllm import side_by_side
        results.append(side_by_side(args, model, workload, results[-1]))
    write_outputs(args, results)
    return results


def share_the_device_with_vllm(args):
    """--baseline vllm: vLLM is where --vllm-python runs, and jaxspec's allocator takes only the device memory vLLM
    leaves (set before JAX starts)."""
    from jaxspec.bench.baselines.vllm import vllm_available
    if args.vllm_python == sys.executable and not vllm_available():
        raise SystemExit("--baseline vllm needs vLLM in this Python environment (for example `pip install "
                         "vllm==0.23.0`, or the wheel set of ../shared/tools/vllm_wheels.sh), or "
                         "--vllm-python naming an interpreter that has it")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.95 - args.vllm_memory_fraction:.2f}")


def save_workload(args, model, workload):
    """--save-workload: the workload's token ids (text prompts tokenized) as a JSON file --dataset file reads."""
    if any(isinstance(p, str) for p in workload.prompts):
        workload = dataclasses.replace(workload, prompts=[model.tokenizer.encode(p) if isinstance(p, str) else p
                                                          for p in workload.prompts], sessions=None)
    with open(args.save_workload, "w") as f:
        json.dump({"sessions": workload.as_sessions()}, f)
    print(f"wrote {sum(len(s) for s in workload.as_sessions())} requests to {args.save_workload}")


def configurations(args, spec: dict | None) -> list[tuple[bool, dict | None]]:
    """(async scheduling, speculative configuration) of each run: the flags' own, or with --compare sync and async
    without speculation, then with it."""
    if not args.compare:
        return [(args.async_scheduling, spec)]
    return [(a, s) for s in ([None, spec] if spec else [None]) for a in (False, True)]


def run_configuration(args, model, workload, async_scheduling: bool, spec: dict | None, profile: bool) -> dict:
    """One configuration: its engine built and every step program compiled before the clock starts, the workload
    run through it (--profile: traced), its report printed."""
    from jaxspec import LLM
    from jaxspec.decode.sampling import is_random
    llm = LLM(model, **engine_options(args, async_scheduling, spec),
              structured_compile_timeout=STRUCTURED_COMPILE_TIMEOUT)
    llm.engine.wait_compiled()   # steady speed: every program at its best tier before the clock starts
    label = f"{'async' if async_scheduling else 'sync'}{'+' + spec['method'] if spec else ''}"
    if not args.enable_prefix_caching:
        label += "+no-prefix-cache"
    adapters = len(args.lora_modules) + args.random_loras
    if adapters:
        label += f"+{adapters}-lora{'-mix' if args.lora_mix else ''}"
    if args.structured is not None:
        label += "+" + args.structured.kind
        # its automaton and grammar steps, compiled before the clock starts
        llm.engine.warmup_structured(args.structured, sample=is_random(args.temperature))
    with device_trace(args.profile if profile else None):
        res = run_workload(llm, workload, args, label)
        res["prefix_cache"] = llm.stats()["prefix_cache"]
        res["quantization"] = llm.stats()["quantization"]
    if args.quantization:
        res["label"] += "+" + args.quantization
    if args.steady_state:
        res["steady"] = [steady_state(llm, args, b) for b in args.steady_state]
    print_report(res)
    return res


@contextlib.contextmanager
def device_trace(path: str | None):
    """A device trace (jax.profiler) of what runs inside, written to `path`; nothing where it is None."""
    if path is None:
        yield
        return
    import jax
    jax.profiler.start_trace(path)
    try:
        yield
    finally:
        jax.profiler.stop_trace()


def run_workload(llm, workload, args, label: str) -> dict:
    """All requests at once through LLM.generate (jaxspec/bench/measure.py), or, for --request-rate and multi-turn
    workloads, arriving over time at the engine on its own thread (jaxspec/bench/online.py)."""
    if workload.sessions is None and not np.isfinite(args.request_rate):
        return run_config(llm, workload, args, label)
    from jaxspec.bench import online
    res = online.run_online(online.LocalBackend(llm), workload.as_sessions(), args, label)
    res["recompiles"] = llm.stats()["recompiles"]
    return res


def print_relative_throughput(results: list[dict]):
    if len(results) > 1:
        base = results[0]["output_throughput"]
        print("Output tokens/s relative to " + results[0]["label"] + ": " +
              ", ".join(f"{r['label']} {r['output_throughput'] / base:.2f}x" for r in results))


def run_hf_baseline(args, workload, ours: dict) -> list[dict]:
    """--baseline hf: the prompts through transformers, each row printed against jaxspec's last configuration."""
    from jaxspec.bench.baselines.hf import run_hf_baseline as run_hf
    hf = run_hf(args, workload)
    for r in hf:
        same_batch = r.get("batch") == args.max_concurrency
        ratio = (f"jaxspec {ours['label']} at batch {args.max_concurrency}: "
                 f"{ours['output_throughput'] / r['output_throughput']:.2f}x" if same_batch else
                 "(other batch size: compare with a jaxspec run at that --max-concurrency)")
        print(f"{r['label']:<28}{r['output_throughput']:>10.2f} tok/s   {ratio}")
    return hf


def write_outputs(args, results: list[dict]):
    if args.json:
        write_json(results, args.json)
    if args.plot:
        plot(results, args.plot)


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
