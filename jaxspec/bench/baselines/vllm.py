"""`jaxspec-bench --baseline vllm`: the same prompts (token ids), output lengths, batch size, sampling and
speculation through vLLM's offline `LLM`, in a process of its own, for the side-by-side.

The child process gets one JSON request (model, prompts, settings) and writes one JSON result: output tokens,
wall time, TPOT where vLLM reports per-request times, and with speculation vLLM's own acceptance counters
(`vllm:spec_decode_*` from `LLM.get_metrics()`). It runs before jaxspec touches the GPU, with a share of the
device memory each (`--vllm-memory-fraction`), so the two never hold the same memory.

With a constraint (`jaxspec-bench --structured-json/-regex/-choice`) every request carries vLLM's
`SamplingParams(structured_outputs=StructuredOutputsParams(json=... | regex=... | choice=...))`; vLLM then needs
a tokenizer (it builds its grammar from one, so `skip_tokenizer_init` is off and `tokenizer` names it), EOS is
not ignored (after a complete output vLLM stops masking: ignored, it would generate unconstrained tokens), and
the warm-up runs constrained too, so that vLLM compiles the grammar before the timed run.

    python -m jaxspec.bench.baselines.vllm REQUEST.json RESULT.json     # what the bench runs

`jaxspec-bench startup --baseline vllm` (`startup_runs`) times vLLM's own start instead: `import vllm`, `LLM(...)`
and the first token, in a fresh process per run (`python -c`: nothing of jaxspec imported there), cold and warm.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

# What `--spec-method` is called in vLLM's speculative_config
_VLLM_METHOD = {"draft_model": "draft_model", "eagle": "eagle", "eagle3": "eagle3", "ngram": "ngram", "mtp": "mtp"}


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def build_request(args, prompts: list[list[int]], output_lens: list[int], model_path: str,
                  draft_path: str | None, structured: dict | None = None, tokenizer: str | None = None) -> dict:
    """What the child runs: everything as plain JSON (token ids, not text: vLLM skips its tokenizer unless a
    constraint needs it). `structured`: {kind: constraint} (kind json, regex or choice), on every request;
    `tokenizer`: the tokenizer vLLM loads for it."""
    spec = None
    if args.spec_method:
        spec = {"method": _VLLM_METHOD[args.spec_method], "num_speculative_tokens": args.num_spec_tokens}
        if args.spec_method == "ngram":
            spec.update(prompt_lookup_max=4, prompt_lookup_min=1)
        elif args.spec_method == "mtp":   # vLLM reads the mtp.* layers from the target's own checkpoint
            pass
        else:
            spec["model"] = draft_path
    return {"model": model_path, "prompts": prompts, "output_lens": output_lens,
            "max_num_seqs": args.max_concurrency, "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens, "temperature": args.temperature,
            "seed": args.seed, "ignore_eos": args.ignore_eos and structured is None,
            "random_weights": args.random_weights, "dtype": "bfloat16" if args.dtype == "auto" else args.dtype,
            "speculative_config": spec, "gpu_memory_utilization": args.vllm_memory_fraction,
            "structured_outputs": structured, "tokenizer": tokenizer,
            "quantization": getattr(args, "quantization", None),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto")}


def run_vllm_baseline(request: dict, python: str = sys.executable, timeout: float | None = None) -> dict:
    """Runs the request in a child process and returns its result (a bench result dict, label 'vllm...')."""
    if not vllm_available() and python == sys.executable:
        raise SystemExit("--baseline vllm needs vLLM in this Python environment (for example `pip install "
                         "vllm==0.23.0`, or the wheel set of ../shared/tools/vllm_wheels.sh); it is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        req, res = os.path.join(tmp, "request.json"), os.path.join(tmp, "result.json")
        with open(req, "w") as f:
            json.dump(request, f)
        env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER=os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"))
        proc = subprocess.run([python, "-m", "jaxspec.bench.baselines.vllm", req, res], env=env, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(res):
            raise RuntimeError(f"the vLLM baseline failed (exit code {proc.returncode}); its output is above")
        with open(res) as f:
            return json.load(f)


def constraint_fields(described: dict | None) -> dict | None:
    """The fields of vLLM's StructuredOutputsParams for the constraint the report describes."""
    if described is None:
        return None
    kind = described["kind"]
    return {kind: described[kind], **{k: described[k] for k in ("disable_any_whitespace",) if k in described}}


def side_by_side(args, model, workload, ours: dict) -> dict:
    """The workload through vLLM (in a process of its own), printed next to jaxspec's last configuration `ours`."""
    from jaxspec.bench.outputs import output_digest, output_summary
    from jaxspec.models.presets import PRESETS, preset_path

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
                                structured=constraint_fields(structured),
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


def vllm_importable(python: str = sys.executable) -> bool:
    """Whether `python` (an interpreter) can import vLLM."""
    if python == sys.executable:
        return vllm_available()
    try:
        return subprocess.run([python, "-c", "import importlib.util, sys; "
                               "sys.exit(importlib.util.find_spec('vllm') is None)"],
                              capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# `jaxspec-bench startup --baseline vllm`'s child: run as `python -c` so that nothing of jaxspec is imported in the
# process timed. argv[1]: {"kwargs": LLM's keywords, "prompt": token ids, "temperature", "seed",
# "triton_gdn_unless_flashinfer"}. Prints one JSON line: the phases in seconds since $JAXSPEC_STARTUP_T0.
_STARTUP_CHILD = r"""
import time
t_wall, t_perf = time.time(), time.perf_counter()
import importlib.util, json, os, sys
r, t0 = json.loads(sys.argv[1]), float(os.environ.get("JAXSPEC_STARTUP_T0", t_wall))
since = lambda: round(time.perf_counter() - t_perf + t_wall - t0, 4)
phases = {}
import vllm
from vllm import LLM, SamplingParams
phases["import"] = since()
kwargs = r["kwargs"]
if r["triton_gdn_unless_flashinfer"] and importlib.util.find_spec("flashinfer") is None:
    kwargs["gdn_prefill_backend"] = "triton"
llm = LLM(**kwargs)
phases["engine"] = since()
out = llm.generate([{"prompt_token_ids": r["prompt"]}], SamplingParams(temperature=r["temperature"], seed=r["seed"],
                   max_tokens=1, ignore_eos=True, detokenize=False), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 1
phases["first_token"] = since()
phases["all_compiled"] = phases["engine"]   # vLLM compiles and captures its graphs inside LLM(...)
torch = sys.modules.get("torch")   # vLLM's; not imported here if vLLM did not
device = torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
sys.stdout.flush()
print(json.dumps({"phases": phases, "device": device, "vllm": getattr(vllm, "__version__", None),
                  "torch": getattr(torch, "__version__", None)}), flush=True)
"""


def startup_runs(args, cache_root: str, prompt: list[int]) -> list[dict]:
    """`jaxspec-bench startup --baseline vllm`: vLLM's start-up, `import vllm`, `LLM(...)` and the first token of
    `prompt` (max_tokens=1), in a fresh process per run of --runs: cold with empty vLLM, TorchInductor, Triton and
    CUDA caches under `cache_root`, warm with the caches the last cold run left. Rows labelled vllm-cold/vllm-warm,
    their phases in seconds since the process started, like jaxspec's."""
    from jaxspec.bench.child_process import run_timed_child
    from jaxspec.models.presets import PRESETS, preset_path

    def path(spec):
        return str(preset_path(spec)) if spec in PRESETS else spec
    request = build_request(args, [prompt], [1], args.vllm_model or path(args.model),
                            path(args.draft_model) if args.draft_model else None)
    kwargs = engine_kwargs(request, has_flashinfer=True)   # without FlashInfer: decided in the child, below
    kwargs["disable_log_stats"] = True
    task = {"kwargs": kwargs, "prompt": prompt, "temperature": args.temperature, "seed": args.seed,
            "triton_gdn_unless_flashinfer": _has_linear_attention(_read_config(request["model"]))}
    config = {k: request[k] for k in ("model", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "dtype",
                                      "random_weights", "speculative_config", "gpu_memory_utilization")}
    rows, cache = [], None
    for i, kind in enumerate(args.runs):
        if kind == "cold":
            cache = tempfile.mkdtemp(dir=cache_root, prefix=f"vllm-{i}-cold-")
        env = dict(os.environ, VLLM_CACHE_ROOT=os.path.join(cache, "vllm"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"), CUDA_CACHE_PATH=os.path.join(cache, "cuda"),
                   VLLM_USE_FLASHINFER_SAMPLER=os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"))
        res = run_timed_child([args.vllm_python, "-c", _STARTUP_CHILD, json.dumps(task)], env,
                              f"vLLM's {kind} start-up run")   # stderr (vLLM's log) passes through
        rows.append({"run": f"vllm-{kind}", **res, "config": config, "cache_dir": cache})
    return rows



def _metric_values(metrics) -> dict:
    """vLLM's metrics (Counter: .value, Vector: .values) by name, summed over label sets."""
    out = {}
    for m in metrics:
        if hasattr(m, "values"):
            prev = out.get(m.name, [0] * len(m.values))
            out[m.name] = [a + b for a, b in zip(prev, m.values)]
        elif hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def _tpot(output) -> float | None:
    """Seconds per output token after the first, where vLLM reports per-request times."""
    m = getattr(output, "metrics", None)
    first, last = getattr(m, "first_token_ts", None), getattr(m, "last_token_ts", None)
    n = len(output.outputs[0].token_ids)
    if first is None or last is None or n < 2:
        return None
    return (last - first) / (n - 1)


def _read_config(model_path: str) -> dict:
    """The model directory's config.json ({} where there is none: a GGUF file, a hub name)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _has_vision_config(config: dict) -> bool:
    return isinstance(config.get("vision_config"), dict)


def _has_linear_attention(config: dict) -> bool:
    """A hybrid checkpoint (Qwen3-Next, Qwen3.5): some of its layers are Gated DeltaNet."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return "linear_attention" in (text.get("layer_types") or [])


def engine_kwargs(r: dict, has_flashinfer: bool | None = None) -> dict:
    """vLLM's `LLM(...)` keywords for a request of `build_request`. `has_flashinfer`: whether vLLM's interpreter has
    FlashInfer (None: this one's)."""
    spec, structured = r["speculative_config"], r.get("structured_outputs")
    kwargs = dict(model=r["model"], max_num_seqs=r["max_num_seqs"], max_model_len=r["max_model_len"],
                  max_num_batched_tokens=r["max_num_batched_tokens"], dtype=r["dtype"], seed=r["seed"],
                  skip_tokenizer_init=structured is None,   # vLLM builds a grammar from the tokenizer
                  gpu_memory_utilization=r["gpu_memory_utilization"],
                  disable_log_stats=spec is None)   # stats cost time per step: on only to read acceptance
    if structured is not None and r.get("tokenizer"):
        kwargs["tokenizer"] = r["tokenizer"]
    if structured is not None and structured.get("disable_any_whitespace"):
        # vLLM's grammar backends read this from the engine's config, not from the request's params (the
        # request's field alone leaves whitespace free: a random-weights model then fills its whole output with it)
        # (and vLLM accepts it only with an explicit xgrammar or guidance backend)
        kwargs["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
    if r["random_weights"]:
        kwargs["load_format"] = "dummy"
    if r.get("quantization"):   # vLLM quantizes the checkpoint on load (its online FP8)
        kwargs["quantization"] = r["quantization"]
    if r.get("kv_cache_dtype", "auto") != "auto":   # the same names in both engines
        kwargs["kv_cache_dtype"] = r["kv_cache_dtype"]
    config = _read_config(r["model"])
    if _has_vision_config(config):
        # a vision-language checkpoint (Qwen3.5) serving token ids: no vision tower, no image-processor profiling
        # (which needs processor files that a config-only directory lacks)
        kwargs["language_model_only"] = True
    if has_flashinfer is None:
        has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    if _has_linear_attention(config) and not has_flashinfer:
        # vLLM's default Gated DeltaNet prefill kernel on Hopper is FlashInfer's; without FlashInfer installed it
        # fails at the first prefill, so take vLLM's other kernel (Triton, from flash-linear-attention)
        kwargs["gdn_prefill_backend"] = "triton"
    if spec is not None:
        kwargs["speculative_config"] = spec
    return kwargs


def _child(request_path: str, result_path: str):
    import numpy as np
    from vllm import LLM, SamplingParams

    with open(request_path) as f:
        r = json.load(f)
    spec, structured = r["speculative_config"], r.get("structured_outputs")
    kwargs = engine_kwargs(r)
    llm = LLM(**kwargs)
    prompts = [{"prompt_token_ids": ids} for ids in r["prompts"]]

    def constraint() -> dict:   # each request its own StructuredOutputsParams (vLLM annotates it per request)
        if structured is None:
            return {}
        from vllm.sampling_params import StructuredOutputsParams
        return {"structured_outputs": StructuredOutputsParams(**structured)}
    params = [SamplingParams(temperature=r["temperature"], max_tokens=n, ignore_eos=r["ignore_eos"],
                             seed=r["seed"] + i, detokenize=False, **constraint())
              for i, n in enumerate(r["output_lens"])]
    warm = min(len(prompts), r["max_num_seqs"])
    llm.generate(prompts[:warm], [SamplingParams(temperature=r["temperature"], max_tokens=8, detokenize=False,
                                                 **constraint()) for _ in range(warm)],
                 use_tqdm=False)   # warm-up: compiles, graphs and the grammar
    before = _metric_values(llm.get_metrics()) if spec is not None else {}
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = [t for t in map(_tpot, outs) if t is not None]
    label = "vllm" + (f"+{spec['method']}" if spec else "")
    result = {"label": label, "requests": len(outs), "duration_s": duration, "output_tokens": n_out,
              "finish_reasons": [getattr(o.outputs[0], "finish_reason", None) for o in outs],
              "output_throughput": n_out / duration, "batch": r["max_num_seqs"],
              "tpot_ms": {"mean": 1e3 * float(np.mean(tpots)) if tpots else float("nan"),
                          "median": 1e3 * float(np.median(tpots)) if tpots else float("nan")},
              "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    if spec is not None:
        after = _metric_values(llm.get_metrics())
        diff = {k: (np.asarray(after[k]) - np.asarray(before.get(k, 0))).tolist() for k in after
                if k.startswith("vllm:spec_decode")}
        drafts = diff.get("vllm:spec_decode_num_drafts", 0)
        accepted = diff.get("vllm:spec_decode_num_accepted_tokens", 0)
        per_pos = diff.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
        result["spec"] = {"num_speculative_tokens": spec["num_speculative_tokens"], "drafts": drafts,
                          "draft_tokens": diff.get("vllm:spec_decode_num_draft_tokens", 0),
                          "accepted_tokens": accepted,
                          "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                          "per_position_acceptance": [a / drafts for a in per_pos] if drafts else []}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
