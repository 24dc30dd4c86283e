"""Speculative decoding with real weights, several drafters against plain decoding, at several batch sizes, with
the target loaded once (issue #12's measurement). Each method gets one engine (max_num_seqs = the largest
concurrency, so every batch size runs the same compiled steps); each workload is then driven at each concurrency
by clients that keep that many requests in flight (jaxspec.bench.online), after every step is compiled (the engine's
warm-up) and a short untimed pass.

    python3 benchmarks/end_to_end/bench_spec_gpu.py --model /tmp/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \\
        --method none --method eagle3=/tmp/head --method ngram --method eagle3-adaptive=/tmp/head \\
        --workload humaneval=.gpu/humaneval.json --workload sharegpt=.gpu/sharegpt_heldout.json \\
        --concurrency 1 8 32 --num-prompts 16 32 96 --json /tmp/out/spec.json

A method is `none`, `ngram`, `mtp` (a hybrid target's own MTP head), `eagle3=HEAD_DIR`, `draft_model=GGUF_OR_DIR`,
any of them but `none` with `-adaptive` (SpeculativeConfig.adaptive) and with `@K` for its own speculation length
(`mtp@2`; default --num-spec-tokens), and with `LABEL:` before it for the label its reports carry
(`chain:eagle3=/tmp/chain --method parallel:eagle3@6=/tmp/parallel`). Workloads are `jaxspec-bench --save-workload` files (token ids).
Prints one line per run and writes every run's report (tokens/s, TPOT, acceptance per position, the histogram
of chosen k, steps compiled during the timed pass) to --json.
"""
import argparse
import gc
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def parse_method(text: str, k: int):
    name, _, path = text.partition("=")
    label, _, name = name.rpartition(":")   # LABEL:METHOD: the label the reports use (two heads of one method)
    label = label or name
    base, _, own_k = name.partition("@")   # NAME@K: this method's own speculation length
    adaptive = base.endswith("-adaptive")
    method = base.removesuffix("-adaptive")
    if method == "none":
        return label, None
    if method not in ("ngram", "eagle3", "eagle", "draft_model", "mtp"):
        raise SystemExit(f"--method {text!r}: expected none, ngram, mtp, eagle3=DIR, eagle=DIR or draft_model=PATH")
    spec = {"method": method, "num_speculative_tokens": int(own_k) if own_k else k, "adaptive": adaptive}
    if method == "mtp":   # the target's own MTP head (random with --random-weights, filled in by main)
        return label, spec
    if method != "ngram":
        if not path:
            raise SystemExit(f"--method {text!r} needs =PATH (the head or draft model)")
        spec["model"] = path
    return label, spec


def untrained_head(model, method: str) -> str:
    """`eagle3=random` -> `eagle3=DIR` with an untrained head of the shapes training writes."""
    name, _, path = method.partition("=")
    if path != "random":
        return method
    import tempfile

    import numpy as np

    from jaxspec.nn.eagle import EagleHead
    from jaxspec.train.eagle3 import head_config, init_head, save_head
    d2t = np.arange(min(32000, model.config.vocab_size), dtype=np.int32)   # training's default draft vocabulary
    head = EagleHead("eagle3", head_config(model.config), model.config, draft_vocab_size=len(d2t))
    out = tempfile.mkdtemp(prefix="untrained-head-")
    save_head(out, head, init_head(head, model.params, d2t, seed=0), d2t)
    return f"{name}={out}"


def timed_run(llm, sessions, run_args, label, spec, run_label) -> dict:
    """One timed pass with the engine's speculation counters and compile count read around it."""
    import numpy as np

    from jaxspec.bench.online import LocalBackend, run_online
    engine = llm.engine
    before = {k: np.copy(v) for k, v in engine.counts.spec.items()}
    compiled = engine.runner.num_compiled()
    res = run_online(LocalBackend(llm), sessions, run_args, run_label)
    d = {k: engine.counts.spec[k] - before[k] for k in engine.counts.spec}
    res.update(method=label, compiled_during_run=engine.runner.num_compiled() - compiled)
    if spec is not None:
        drafts = int(d["drafts"])
        res["spec"] = {"drafts": drafts, "accepted_tokens": int(d["accepted_tokens"]),
                       "mean_acceptance_length": 1 + int(d["accepted_tokens"]) / max(drafts, 1),
                       "per_position_acceptance": (d["accepted_per_position"] / max(drafts, 1)).tolist(),
                       "chosen_k": d["chosen_k"].tolist()}
        if engine.k_chooser is not None:   # adaptive k's view at the end of the pass: [k, bucket, ms, step] rows
            res["spec"]["chooser"] = engine.k_chooser.snapshot()
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--method", action="append", required=True)
    p.add_argument("--workload", action="append", required=True, help="NAME=PATH (a --save-workload file)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, nargs="+", default=None,
                   help="prompts per concurrency (default: 4 x concurrency, at least 16)")
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="default: requests stop at EOS, as real ones do")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--random-weights", action="store_true",
                   help="--model is a preset or config directory with weights drawn at random, and eagle3=random "
                        "an untrained head: the same compiled steps as the real weights (fills the compile caches)")
    p.add_argument("--structured-json", default=None, metavar="SCHEMA",
                   help="structured outputs (issue #16): each run is made twice, every request constrained to this "
                        "JSON schema (compact JSON), then unconstrained with EOS ignored at the constrained run's "
                        "mean output length: the same prompts and tokens per request, like for like")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed runs per (method, workload, concurrency), back to back (with --structured-json: "
                        "constrained / unconstrained pairs); the summary compares medians")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    num_prompts = args.num_prompts or [max(16, 4 * c) for c in args.concurrency]
    if len(num_prompts) != len(args.concurrency):
        raise SystemExit(f"--num-prompts has {len(num_prompts)} values for {len(args.concurrency)} concurrencies")

    import numpy as np

    from jaxspec import LLM
    from jaxspec.bench.online import LocalBackend, run_online
    from jaxspec.models.loader import load_model

    t0 = time.perf_counter()
    if args.random_weights:
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype=args.dtype)
        if args.structured_json:   # the constraint is compiled over the tokenizer's vocabulary
            from jaxspec.bench.workloads import tokenizer_for
            model.tokenizer = tokenizer_for(args.model)
            if model.tokenizer is None:
                raise SystemExit(f"--structured-json needs a tokenizer, and --model {args.model!r} has none")
        args.method = [untrained_head(model, m) for m in args.method]
    else:
        model = load_model(args.model, dtype=args.dtype)
    print(f"target loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    workloads = {}
    for w in args.workload:
        name, _, path = w.partition("=")
        with open(path) as f:
            sessions = json.load(f)["sessions"]
        # prompts that leave room for the whole output (the engine refuses longer ones)
        workloads[name] = [(list(turns[0][0]), args.output_len) for turns in sessions
                           if len(turns[0][0]) + args.output_len <= args.max_model_len]
    structured = structured_report = None
    if args.structured_json:
        from jaxspec.bench.workloads import structured_from_args
        structured, structured_report = structured_from_args(types.SimpleNamespace(
            structured_json=args.structured_json, structured_regex=None, structured_choice=None,
            structured_disable_any_whitespace=True))
    results = []
    for text in args.method:
        label, spec = parse_method(text, args.num_spec_tokens)
        if spec is not None and spec["method"] == "mtp" and args.random_weights:   # the head's shapes, random too
            from jaxspec.decode.drafters.mtp import random_mtp_params
            spec["model"] = random_mtp_params(model.config, args.dtype, seed=1)
        t0 = time.perf_counter()
        llm = LLM(model, max_num_seqs=max(args.concurrency), max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, speculative_config=spec,
                  warmup=False, enable_prefix_caching=False, structured_compile_timeout=3600.0)
        engine = llm.engine
        # every bucket (and every width of adaptive k) compiled before the clock: a short untimed pass does not
        # meet every bucket the timed one does (on 2026-11-24 plain and n-gram runs at batch 8 compiled 1-2 steps
        # inside their timed pass, adaptive widths and structured runs too). Greedy runs only: the greedy
        # variants (half the programs; on 2026-11-28 an EAGLE-3 engine's full warm-up took ~3 minutes).
        engine.warmup(sample=False)
        if structured is not None:   # the schema's automaton and the grammar's steps, before any clock starts
            engine.warmup_structured(structured, sample=False)
        print(f"{label}: engine built in {time.perf_counter() - t0:.0f} s", flush=True)
        for wname, prompts in workloads.items():
            for c, n in zip(args.concurrency, num_prompts):
                # the workload's prompts again from its first where n asks for more (HumanEval holds 164)
                sessions = [[prompts[i % len(prompts)]] for i in range(n)]
                run_args = types.SimpleNamespace(temperature=0.0, ignore_eos=args.ignore_eos, seed=0,
                                                 request_rate=float("inf"), max_concurrency=c, quiet=True,
                                                 structured=structured, structured_report=structured_report)
                t0 = time.perf_counter()   # untimed: first requests through the engine (and adaptive k's acceptance)
                # adaptive k: steps for its acceptance estimates (its step times are measured at warm-up)
                warm_tokens = 48 if spec is not None and spec["adaptive"] else 8
                run_online(LocalBackend(llm), [[(p, warm_tokens)] for (p, _), in sessions], run_args, "warm")
                warm_s = time.perf_counter() - t0
                runs = []
                for rep in range(args.repeat):
                    res = timed_run(llm, sessions, run_args, label, spec, f"{label}/{wname}/b{c}")
                    res.update(workload=wname, concurrency=c, warm_s=warm_s, repeat=rep)
                    runs.append(res)
                    if structured is not None:   # like for like: unconstrained, each request as many tokens
                        same = [[(p, max(2, n))] for ((p, _),), n in zip(sessions, res["output_lens"])]
                        plain_args = types.SimpleNamespace(**{**vars(run_args), "structured": None,
                                                              "structured_report": None, "ignore_eos": True})
                        if rep == 0:
                            run_online(LocalBackend(llm), same, plain_args, "warm")
                        free = timed_run(llm, same, plain_args, label, spec, f"{label}/{wname}/b{c}/unconstrained")
                        free.update(workload=wname, concurrency=c, warm_s=0.0, repeat=rep)
                        runs.append(free)
                for r in runs:
                    results.append(r)
                    acc = (f"  acceptance length {r['spec']['mean_acceptance_length']:.2f} "
                           f"per position {[round(x, 2) for x in r['spec']['per_position_acceptance']]}"
                           f" chosen k {r['spec']['chosen_k']}" if spec else "")
                    valid = (f"  valid {r['structured_outputs']['valid_outputs']}/{r['requests']}"
                             if "structured_outputs" in r else "")
                    sat = (f"  saturated {r['saturated_output_throughput']:.1f} tok/s over {r['saturated_s']:.2f} s"
                           if "saturated_output_throughput" in r else "")
                    print(f"{r['label']:<44} {r['output_throughput']:8.1f} tok/s{sat}  TPOT {r['tpot_ms']['mean']:.2f} ms"
                          f"  {r['output_tokens']} tokens  digest {r.get('output_digest')}{valid}"
                          f"  compiled during run {r['compiled_during_run']}  (warm {warm_s:.0f} s){acc}", flush=True)
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1, default=float)
        del llm, engine
        gc.collect()
    def medians(key):   # label -> the median of its repeats' `key`
        by_label = {}
        for r in results:
            if key in r:
                by_label.setdefault(r["label"], []).append(r[key])
        return {k: float(np.median(v)) for k, v in by_label.items()}

    def against_plain(values, label, method, rest):
        plain = values.get(f"none/{rest}")
        return f"  {values[label] / plain:.3f}x plain" if plain and method != "none" else ""
    median, saturated = medians("output_throughput"), medians("saturated_output_throughput")
    for label, tps in median.items():
        method, rest = label.split("/", 1)
        line = f"{label:<44} {tps:8.1f} tok/s (median of {args.repeat})" + against_plain(median, label, method, rest)
        if label in saturated:   # while the batch was full (jaxspec.bench.online.saturated_throughput)
            line += f"  saturated {saturated[label]:.1f} tok/s" + against_plain(saturated, label, method, rest)
        if f"{label}/unconstrained" in median:
            line += f"  {tps / median[label + '/unconstrained']:.3f}x unconstrained"
        print(line)


if __name__ == "__main__":
    main()
