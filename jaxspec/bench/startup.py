"""`jaxspec-bench startup`: start-up as users meet it, from process start to the first generated token.

    jaxspec-bench startup --model qwen2.5-coder-1.5b-instruct --random-weights --runs cold warm --json startup.json
    jaxspec-bench startup --model qwen2.5-coder-1.5b-instruct --random-weights --spec-method draft_model \
        --draft-model qwen2.5-coder-0.5b-instruct --num-spec-tokens 4 --adaptive-spec --baseline vllm

Each run is a fresh process with its own cache directory ($JAXSPEC_CACHE: compiled steps, XLA's autotuning results,
assembled preset files): `cold` starts from an empty one, `warm` reuses the one the last cold run left. The parent
notes the wall clock just before it starts the child ($JAXSPEC_STARTUP_T0); the child reports when each phase ended,
in seconds since then:

    import        Python started, JAX and jaxspec imported
    backend       the device backend started (jax.devices())
    weights       the model (and draft model) loaded or drawn, and placed on the device
    engine        LLM(...) returned: KV pool allocated, params placed, the compiles the constructor waits for
    first_token   generate() of one --input-len prompt with max_tokens=1 returned
    all_compiled  every step program compiled: when the last one landed (engine.wait_compiled() waits for the
                  background compiles, which may end before or after the first token), or `engine` if later

with every compiled step program (compile_log: bucket, variant, whether it was compiled or loaded from the disk
cache, its trace/lower/compile seconds and when it landed, also since the start). --baseline vllm adds vLLM's
`import vllm`, `LLM(...)` and first token, cold (empty VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR)
and warm, where --vllm-python has vLLM.

    python -m jaxspec.bench.startup --child RUN ARGS...     # one run: what the parent starts
"""
from __future__ import annotations

import time

_T_WALL, _T_PERF = time.time(), time.perf_counter()   # this process's clocks, read together (before any import)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from jaxspec.bench.args import build_parser as build_bench_parser  # noqa: E402
from jaxspec.bench.args import check_args  # noqa: E402
from jaxspec.bench.child_process import T0_ENV, run_timed_child  # noqa: E402
from jaxspec.bench.engine import engine_options, model_from_args, resolve_max_model_len, with_random_draft  # noqa: E402

RUNS = ("cold", "warm")
# The bench's flags that measure something other than start-up: refused here rather than silently ignored.
NOT_FOR_STARTUP = ("compare", "steady_state", "profile", "save_workload", "plot", "base_url", "request_rate",
                   "structured_json", "structured_regex", "structured_choice", "dataset_path")


def build_parser() -> argparse.ArgumentParser:
    p = build_bench_parser("jaxspec-bench startup", __doc__)
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="the runs, in order, each a fresh process: cold (an empty cache directory) or warm (the "
                        "cache the last cold run left)")
    p.add_argument("--wait-compiled", action=argparse.BooleanOptionalAction, default=True,
                   help="after the first token, wait for the background compiles (all_compiled); --no-wait-compiled "
                        "ends the run at its first token (all_compiled is then not measured)")
    p.add_argument("--cache-root", help="where the runs' cache directories are made (kept afterwards); default: a "
                                        "temporary directory, removed at the end")
    return p


def check_startup_args(p: argparse.ArgumentParser, args):
    given = [f"--{name.replace('_', '-')}" for name in NOT_FOR_STARTUP if getattr(args, name) != p.get_default(name)]
    if given:
        p.error(f"argument {given[0]}: not used by `jaxspec-bench startup` (it times one request's first token)")
    if args.dataset != "random":
        p.error(f"argument --dataset: {args.dataset} is not used by `jaxspec-bench startup` (one random prompt of "
                "--input-len tokens)")
    if args.baseline == "hf":
        p.error("argument --baseline: hf is not used by `jaxspec-bench startup` (vllm is)")
    if args.runs[0] != "cold":
        p.error(f"argument --runs: {args.runs[0]!r} comes before any 'cold': a warm run reuses the cache a cold run "
                "left (e.g. --runs cold warm)")
    if args.max_model_len is not None and args.input_len + 1 > args.max_model_len:
        p.error(f"argument --input-len: {args.input_len} tokens and the first token do not fit --max-model-len "
                f"{args.max_model_len}")
    check_args(p, args)
    if args.cache_root is not None and os.path.exists(args.cache_root) and not os.path.isdir(args.cache_root):
        p.error(f"argument --cache-root: {args.cache_root!r} is not a directory")


def config_of(args) -> dict:
    """What a run measured, as the report shows it."""
    spec = None
    if args.spec is not None:
        spec = {"method": args.spec_method, "num_speculative_tokens": args.num_spec_tokens,
                "adaptive": bool(args.adaptive_spec), "draft_model": args.draft_model}
    return {"model": args.model, "random_weights": args.random_weights, "dtype": args.dtype, "speculative": spec,
            "tensor_parallel_size": args.tensor_parallel_size, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_concurrency,
            "warmup": args.warmup, "input_len": args.input_len, "temperature": args.temperature,
            "quantization": args.quantization}


def prompt_ids(args, vocab_size: int) -> list[int]:
    """The first request's prompt: --input-len random token ids (--seed), the same in every run and in vLLM's."""
    import numpy as np
    return np.random.default_rng(args.seed).integers(0, vocab_size, args.input_len).tolist()


# ---- the parent ------------------------------------------------------------------------------------------
def run(argv: list[str]) -> list[dict]:
    """Runs the start-up measurement `argv` describes (the flags after `startup`); returns one dict per run."""
    p = build_parser()
    args = p.parse_args(argv)
    check_startup_args(p, args)
    vllm_missing = None
    if args.baseline == "vllm":
        from jaxspec.bench.baselines.vllm import vllm_importable
        if not vllm_importable(args.vllm_python):
            vllm_missing = f"vLLM is not installed for {args.vllm_python}: the vllm rows are skipped"
    root = args.cache_root or tempfile.mkdtemp(prefix="jaxspec-startup-")
    os.makedirs(root, exist_ok=True)
    results = []
    try:
        cache = None
        for i, kind in enumerate(args.runs):
            if kind == "cold":
                cache = tempfile.mkdtemp(dir=root, prefix=f"jaxspec-{i}-cold-")
            results.append(run_child(argv, kind, cache))
        if args.baseline == "vllm" and vllm_missing is None:
            from jaxspec.bench.baselines.vllm import startup_runs
            jaxspec_config = results[0]["config"]
            # vLLM at the length jaxspec's engine had (without --max-model-len, the engine's choice for the model)
            at_jaxspec_length = argparse.Namespace(**{**vars(args), "max_model_len": jaxspec_config["max_model_len"]})
            results += startup_runs(at_jaxspec_length, root, prompt_ids(args, jaxspec_config["vocab_size"]))
    finally:
        if args.cache_root is None:
            import shutil
            shutil.rmtree(root, ignore_errors=True)
    print_table(results, note=vllm_missing)
    checks = [tuple(r["check_tokens"]) for r in results if r.get("check_tokens") is not None]
    if args.json:
        out = {"startup": results, "args": {k: v for k, v in vars(args).items() if _plain(v)}}
        if vllm_missing:
            out["vllm"] = vllm_missing
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if len(set(checks)) > 1:
        raise SystemExit(f"jaxspec-bench startup: error: the runs decoded different tokens from one prompt: {checks}")
    return results


def _plain(value) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def run_child(argv: list[str], kind: str, cache: str) -> dict:
    """One run in a fresh process whose cache directory is `cache`; its result, labelled `kind`."""
    env = dict(os.environ, JAXSPEC_CACHE=cache, CUDA_CACHE_PATH=os.path.join(cache, "cuda"))
    if env.get("JAX_COMPILATION_CACHE_DIR"):   # the user's own JAX cache, which jaxspec then uses: this run's too
        env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(cache, "jax-compilation-cache")
    cmd = [sys.executable, "-m", "jaxspec.bench.startup", "--child", kind, *argv]
    return run_timed_child(cmd, env, f"the {kind} start-up run")


def print_table(results: list[dict], note: str | None = None):
    head = ["run", "import", "weights", "engine", "first token", "all compiled", "variants"]
    rows = []
    for r in results:
        ph = r["phases"]
        cells = [f"{ph[k]:.2f}" if ph.get(k) is not None else "-"
                 for k in ("import", "weights", "engine", "first_token", "all_compiled")]
        compiled = r.get("variants_compiled")
        variants = "-" if compiled is None else str(compiled)
        if r.get("variants_from_disk") is not None:
            variants += f" ({r['variants_from_disk']} from disk)"
        rows.append([r["run"], *cells, variants])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    print(f"Start-up, seconds since the process started ({results[0]['device'] if results else ''}):")
    for row in [head, *rows]:
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
    if note:
        print(note)


# ---- the child -------------------------------------------------------------------------------------------
CHECK_TOKENS = 16   # a greedy continuation each run decodes after its phases


def child(kind: str, argv: list[str]):
    """One run: the phases, in seconds since $JAXSPEC_STARTUP_T0 (the parent's clock just before it started this
    process), printed as one JSON line."""
    t0 = float(os.environ.get(T0_ENV, _T_WALL))

    def since(perf: float) -> float:   # a perf_counter reading of this process -> seconds since t0
        return round(perf - _T_PERF + _T_WALL - t0, 4)
    phases = {}

    def mark(name):
        phases[name] = since(time.perf_counter())

    import jax

    from jaxspec.llm import LLM
    from jaxspec.sampling_params import SamplingParams
    mark("import")
    p = build_parser()
    args = p.parse_args(argv)
    check_startup_args(p, args)
    device = jax.devices()[0].device_kind
    mark("backend")
    model = model_from_args(args)
    resolve_max_model_len(args, model.config)
    spec = with_random_draft(args, model, args.spec)
    jax.block_until_ready(model.params)
    if spec is not None and hasattr(spec.get("model"), "params"):
        jax.block_until_ready(spec["model"].params)
    mark("weights")
    llm = LLM(model, **engine_options(args, args.async_scheduling, spec))
    mark("engine")
    prompt = prompt_ids(args, model.config.vocab_size)
    out = llm.generate([prompt], SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=1,
                                                ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 1, out[0].token_ids
    mark("first_token")
    wait = getattr(llm.engine, "wait_compiled", None) if args.wait_compiled else None
    if wait is not None:
        wait()
    waited = since(time.perf_counter())
    log = compile_log(llm, since)
    # when the last program landed (the background compiles may end before the first token), not before the engine
    landed = [e["done_at"] for e in log or [] if isinstance(e.get("done_at"), (int, float))]
    if args.wait_compiled:
        phases["all_compiled"] = max([phases["engine"], *landed]) if landed else (
            waited if wait is not None else phases["engine"])
    else:
        phases["all_compiled"] = None
    result = {"run": kind, "phases": phases, "variants_compiled": len(log) if log is not None else None,
              "variants_from_disk": (sum(e.get("source") in ("disk", "store") for e in log)
                                     if log is not None and any("source" in e for e in log) else None),
              "compile_log": log, "wait_compiled_returned": waited,
              "engine_startup": _rounded(getattr(llm, "startup", None)),
              "recompiles": llm.stats().get("recompiles"),
              "config": {**config_of(args), "vocab_size": model.config.vocab_size}, "device": device,
              "backend": jax.default_backend(), "num_devices": len(jax.devices()), "jax": jax.__version__,
              "cache_dir": os.environ.get("JAXSPEC_CACHE")}
    # after the phases: a greedy continuation every run of one configuration must decode alike (a program loaded
    # from the disk computes what the compiled one does)
    check = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    result["check_tokens"] = list(check[0].token_ids)
    store = getattr(getattr(llm.engine.runner, "programs", None), "store", None)
    if store is not None:
        store.flush()   # the programs compiled so far are on disk for the next run
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    if not args.wait_compiled:   # the background compiles are not waited for: end the process where it stands
        sys.stderr.flush()
        os._exit(0)


def compile_log(llm, since) -> list[dict] | None:
    """The runner's compile log (one entry per compiled step program; None where the engine keeps none), each
    entry's done_at as seconds since the start."""
    runner = llm.engine.runner
    log = getattr(runner, "compile_log", None)
    if log is None:   # the log before the runner exposed it
        log = getattr(getattr(runner, "programs", None), "log", None)
    if log is None:
        return None
    entries = []
    for e in list(log):
        e = {k: (v if _plain(v) else str(v)) for k, v in dict(e).items()}
        if isinstance(e.get("done_at"), (int, float)):
            e["done_at"] = since(e["done_at"])
        entries.append(e)
    return entries


def _rounded(d):
    return None if d is None else {k: round(v, 4) if isinstance(v, float) else v for k, v in dict(d).items()}


def main(argv: list[str] | None = None) -> int:
    from jaxspec.cli_args import one_line_errors
    argv = sys.argv[1:] if argv is None else argv
    with one_line_errors("jaxspec-bench startup"):
        if argv[:1] == ["--child"]:
            child(argv[1], argv[2:])
        else:
            run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
