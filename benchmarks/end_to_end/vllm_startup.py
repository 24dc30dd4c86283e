"""vLLM's start-up as a user meets it: from process start to its first generated token, cold and warm, for the
side-by-side with `jaxspec-bench startup` (jaxspec/bench/startup.py, benchmarks/end_to_end/startup_gpu.sh).

    F="--max-num-batched-tokens 256 --max-model-len 448 --max-num-seqs 32 --input-len 128"   # startup_gpu.sh's
    PYTHONPATH=/tmp/vllm-site:$PWD python3 benchmarks/end_to_end/vllm_startup.py $F \\
        --model qwen2.5-coder-1.5b-instruct --runs cold warm --json $OUT/vllm_startup.json
    ... --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct --num-spec-tokens 4
    ... --model llama-3.1-8b
    ... --model /tmp/models/qwen15-hf             # a real checkpoint (weights in the directory): loaded
    ... --model /tmp/cfg --load-format dummy      # any HF directory, its config.json alone

--model / --draft-model: a name of jaxspec.models.random.KNOWN_SHAPES (the presets, llama-3.1-8b, llama-3.2-1b),
for which a config.json of those shapes is written (vLLM 0.26 reads no GGUF: that moved to a plugin), or an HF
directory. A directory without weight files runs with vLLM's random weights (load_format="dummy"), as does
every preset.

Each run of --runs is a fresh process (jaxspec.bench.baselines.vllm's start-up child, the one `jaxspec-bench
startup --baseline vllm` runs, with the same LLM(...) keywords: token-id prompt, skip_tokenizer_init, dummy
weights, bf16, the bench's max_num_seqs 8 / max_model_len 1024 / max_num_batched_tokens 256 defaults). `cold`
gets new empty cache directories under --cache-root (VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR,
XDG_CACHE_HOME, CUDA_CACHE_PATH, TVM_FFI_CACHE_DIR); `warm` reuses the ones the last cold run filled. The runs are
offline (HF_HUB_OFFLINE, no usage stats) and sample natively (VLLM_USE_FLASHINFER_SAMPLER=0) unless the
environment says otherwise. Timed from just before the process is started, in seconds:

    import        `import vllm; from vllm import LLM, SamplingParams` done
    engine        LLM(...) returned (EngineCore process started, weights, torch.compile, KV cache, CUDA graphs)
    first_token   generate() of one --input-len random-id prompt with max_tokens=1 returned

and vLLM's own log, read from the run's output (missing lines give null): model loading, Dynamo, the Inductor
compile or the compiled graphs loaded from the cache, torch.compile in total, memory profiling, CUDA graph
capture, "init engine", the attention backend; `log_at` gives when each marker line arrived (seconds since the
start; sub-second, unlike vLLM's own time stamps). "Cold" means cold compile caches: the OS page cache (vLLM's
shared libraries, the checkpoint) is not cleared unless --drop-page-cache works there (root, outside gVisor).

`vllm bench startup` (vllm/benchmarks/startup.py in 0.26) measures something narrower: the seconds of
`LLM.from_engine_args(...)` alone (no `import vllm`, no first token), with VLLM_ENABLE_V1_MULTIPROCESSING=0 (the
engine core in the same process: no EngineCore process to start, which the default LLM(...) has), cold with a
temporary VLLM_CACHE_ROOT plus torch's fresh_cache() (Inductor and Triton caches; not CUDA's), and its
"compilation" is compilation_config.compilation_time (the sum of "torch.compile took ... in total"). So its
startup is about `engine - import` here minus the EngineCore process start. --vllm-bench-startup runs it too, once
cold, once as its warm-up and once warm, and puts its JSON under "vllm_bench_startup".

Writes one JSON object per run and a summary (--json). Needs no vLLM for --help; --python is the interpreter
that has vLLM (default: this one).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RUNS = ("cold", "warm")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
CACHE_VARS = {"VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
              "XDG_CACHE_HOME": "xdg", "CUDA_CACHE_PATH": "cuda", "TVM_FFI_CACHE_DIR": "tvm-ffi"}
# No network on the GPU machine: nothing may wait on a hub or a usage-stats server.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm_startup.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a KNOWN_SHAPES name (e.g. qwen2.5-coder-1.5b-instruct, "
                                                   "llama-3.1-8b) or an HF directory")
    p.add_argument("--draft-model", help="speculative decoding with this draft model (method draft_model); a "
                                         "name or a directory, as --model")
    p.add_argument("--num-spec-tokens", type=int, default=4, help="with --draft-model (default 4)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                   help="default: dummy (random weights) unless the model directory holds weight files")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS),
                   help="the runs, in order, each a fresh process: cold (new empty caches) or warm (the caches the "
                        "last cold run left)")
    p.add_argument("--cache-root", help="where the runs' cache directories (and the presets' config.json) are made, "
                                        "kept afterwards; default: a temporary directory, removed at the end")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=8, help="as jaxspec-bench's --max-concurrency default")
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids, --seed)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llm-kwargs", type=json.loads, default={},
                   help="JSON object merged into LLM(...)'s keywords, e.g. '{\"enforce_eager\": true}'")
    p.add_argument("--python", default=sys.executable, help="the interpreter that has vLLM (default: this one)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="before each cold run, try `sync; echo 3 > /proc/sys/vm/drop_caches` (recorded per run)")
    p.add_argument("--vllm-bench-startup", action="store_true",
                   help="also run `vllm bench startup` (1 cold, 1 warm-up, 1 warm iteration) on the same engine "
                        "arguments")
    p.add_argument("--log-dir", help="write each run's whole vLLM log here (RUN_INDEX-KIND.log)")
    p.add_argument("--quiet", action="store_true", help="do not echo vLLM's log")
    p.add_argument("--json", help="write the runs and the summary here")
    return p


def check_args(p: argparse.ArgumentParser, a):
    if a.runs[0] != "cold":
        p.error(f"argument --runs: {a.runs[0]!r} comes before any 'cold' (e.g. --runs cold warm)")
    if a.input_len + 1 > a.max_model_len:
        p.error(f"argument --input-len: {a.input_len} tokens and the first token do not fit --max-model-len "
                f"{a.max_model_len}")
    if not 0 < a.gpu_memory_utilization <= 1:
        p.error("argument --gpu-memory-utilization: expected a fraction in (0, 1]")
    if not isinstance(a.llm_kwargs, dict):
        p.error("argument --llm-kwargs: expected a JSON object")


# ---- model directories -----------------------------------------------------------------------------------
_HF_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3"), "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
            "gpt_oss": ("GptOssForCausalLM", "gpt_oss")}


def hf_config(c) -> dict:
    """A jaxspec ModelConfig (a preset of KNOWN_SHAPES: dense Llama / Mistral / Qwen2 / Qwen3, Qwen3-MoE, Gemma 3's
    text model, GPT-OSS) as the config.json of its HF checkpoint (the fields those checkpoints publish), bf16 and
    unquantized; ModelConfig.from_hf reads it back to `c`."""
    if c.arch not in _HF_ARCH or c.hybrid:
        raise ValueError(f"no HF config written for architecture {c.arch!r} (supported: {', '.join(_HF_ARCH)}): "
                         "give an HF directory instead")
    arch, model_type = _HF_ARCH[c.arch]
    if c.arch == "llama" and c.sliding_window is not None:
        arch, model_type = "MistralForCausalLM", "mistral"
    if c.arch == "qwen3" and c.moe:
        arch, model_type = "Qwen3MoeForCausalLM", "qwen3_moe"
    cfg = {"architectures": [arch], "model_type": model_type, "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": c.hidden_act,
           "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling_dict,
           "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
           "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16"}
    if model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif model_type == "mistral":   # the same window on every layer
        cfg["sliding_window"] = c.sliding_window
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):   # full attention in every layer
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.num_layers)
    if model_type in ("qwen3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if model_type == "qwen3_moe":   # every layer sparse
        cfg.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok, decoder_sparse_step=1,
                   moe_intermediate_size=c.moe_intermediate_size, mlp_only_layers=[], norm_topk_prob=c.norm_topk_prob,
                   output_router_logits=False)
    if model_type == "gemma3_text":   # local layers: the window and their own rotary base; global ones scaled
        del cfg["hidden_act"]
        cfg.update(hidden_activation=c.hidden_act, query_pre_attn_scalar=int(c.query_pre_attn_scalar),
                   sliding_window=c.sliding_window, rope_local_base_freq=c.local_rope_theta,
                   layer_types=["sliding_attention" if s else "full_attention" for s in c.sliding_layers],
                   attention_bias=False, final_logit_softcapping=None, attn_logit_softcapping=None)
    if model_type == "gpt_oss":   # alternating windowed and full layers, the experts intermediate_size wide
        cfg.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   sliding_window=c.sliding_window, attention_bias=c.attention_bias,
                   layer_types=["sliding_attention" if s else "full_attention" for s in c.sliding_layers],
                   swiglu_limit=c.swiglu_limit, output_router_logits=False)
    if c.bos_token_id is not None:
        cfg["bos_token_id"] = c.bos_token_id
    if c.eos_token_ids:
        cfg["eos_token_id"] = c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids)
    return cfg


def has_weights(path: str) -> bool:
    return os.path.isdir(path) and any(f.endswith(WEIGHT_SUFFIXES) for f in os.listdir(path))


def model_dir(spec: str, config_root: str) -> str:
    """`spec`'s HF directory: an existing one as it is, a KNOWN_SHAPES name as a config.json written under
    `config_root`/NAME (the same path every run, so that warm runs find what cold runs compiled)."""
    if os.path.isfile(os.path.join(spec, "config.json")):
        return os.path.abspath(spec)
    from jaxspec.models.random import KNOWN_SHAPES
    if spec not in KNOWN_SHAPES:
        raise SystemExit(f"model {spec!r}: neither an HF directory (with config.json) nor one of "
                         f"{', '.join(sorted(KNOWN_SHAPES))}")
    out = os.path.join(config_root, spec)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(KNOWN_SHAPES[spec]), f, indent=1)
    return os.path.abspath(out)


# ---- vLLM's log --------------------------------------------------------------------------------------------
_NUM = r"([0-9]+(?:\.[0-9]+)?)"
# (key, pattern, groups -> values, how repeated matches combine: first, last, sum, list)
LOG_VALUES = [
    ("platform", r"Automatically detected platform (\S+?)\.?$", ("platform",), "first"),
    ("attention_backend", r"Using (\S+) attention backend", ("attention_backend",), "first"),
    ("weights_s", rf"Loading weights took {_NUM} seconds", ("weights_s",), "sum"),
    ("model_loading", rf"Model loading took {_NUM} GiB(?: memory)? and {_NUM} seconds",
     ("model_memory_gib", "model_loading_s"), "first"),
    ("dynamo_s", rf"Dynamo bytecode transform time: {_NUM} s", ("dynamo_s",), "sum"),
    ("inductor_compile_s", rf"Compiling a graph for compile range .* takes {_NUM} s", ("inductor_compile_s",), "sum"),
    ("compiled_graphs_loaded_s", rf"Directly load the compiled graph\(s\) for compile range .* took {_NUM} s",
     ("compiled_graphs_loaded_s",), "sum"),
    ("aot_loaded", r"Directly load AOT compilation from path", ("aot_loaded",), "count"),
    ("torch_compile_s", rf"torch\.compile (?:and initial profiling/warmup run together )?took {_NUM} s in total",
     ("torch_compile_s",), "list"),
    ("memory_profiling_s", rf"Memory profiling takes {_NUM} seconds", ("memory_profiling_s",), "first"),
    ("kv_cache_gib", rf"Available KV cache memory: {_NUM} GiB", ("kv_cache_gib",), "first"),
    ("kv_cache_tokens", r"GPU KV cache size: ([0-9,]+) tokens", ("kv_cache_tokens",), "first"),
    ("cuda_graphs", rf"Graph capturing finished in {_NUM} secs?, took {_NUM} GiB", ("cuda_graph_s", "cuda_graph_gib"),
     "first"),
    ("init_engine", rf"init engine \(profile, create kv cache, warmup model\) took {_NUM} s"
                    rf"(?: \(compilation: {_NUM} s)?", ("init_engine_s", "init_engine_compilation_s"), "first"),
]
# When the first line of each marker arrived (seconds since the start): the phases' edges.
LOG_MARKERS = [
    ("first_log_line", r"\S"),
    ("engine_config", r"Initializing a V1 LLM engine"),
    ("load_start", r"Starting to load model"),
    ("load_done", r"Model loading took"),
    ("dynamo_done", r"Dynamo bytecode transform time"),
    ("compile_done", r"torch\.compile (?:and initial profiling/warmup run together )?took"),
    ("memory_profiled", r"Memory profiling takes|Available KV cache memory"),
    ("cuda_graphs_start", r"Capturing CUDA graphs"),
    ("cuda_graphs_done", r"Graph capturing finished"),
    ("init_engine_done", r"init engine \(profile"),
]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _value(text: str | None):
    if text is None:
        return None
    text = text.replace(",", "")
    try:
        return int(text) if re.fullmatch(r"[0-9]+", text) else float(text)
    except ValueError:
        return text


def parse_log(lines) -> dict:
    """vLLM's phases from its log: `lines` are (seconds since the start, line) or plain lines. Every key of
    LOG_VALUES' groups is present (None where no line matched), plus `log_at` (LOG_MARKERS' arrival times) and
    `cuda_graphs_wall_s` (first "Capturing CUDA graphs" to "Graph capturing finished", by arrival)."""
    out: dict = {key: None for _, _, keys, _ in LOG_VALUES for key in keys}
    at: dict = {name: None for name, _ in LOG_MARKERS}
    values = [(re.compile(pat), keys, how) for _, pat, keys, how in LOG_VALUES]
    markers = [(name, re.compile(pat)) for name, pat in LOG_MARKERS]
    for item in lines:
        t, line = item if isinstance(item, tuple) else (None, item)
        line = _ANSI.sub("", line).rstrip()
        for rx, keys, how in values:
            m = rx.search(line)
            if not m:
                continue
            for key, g in zip(keys, m.groups() if m.groups() else (None,)):
                v = _value(g) if g is not None else (True if how == "count" else None)
                if how == "first":
                    out[key] = out[key] if out[key] is not None else v
                elif how == "sum":
                    out[key] = round((out[key] or 0) + v, 4) if v is not None else out[key]
                elif how == "list":
                    out[key] = (out[key] or []) + ([v] if v is not None else [])
                elif how == "count":
                    out[key] = (out[key] or 0) + 1
        for name, rx in markers:
            if at[name] is None and t is not None and rx.search(line):
                at[name] = round(t, 3)
    if out["aot_loaded"] is None:
        out["aot_loaded"] = 0
    out["log_at"] = at
    start, end = at["cuda_graphs_start"], at["cuda_graphs_done"]
    out["cuda_graphs_wall_s"] = round(end - start, 3) if start is not None and end is not None else None
    return out


# ---- the runs ----------------------------------------------------------------------------------------------
def cache_env(cache: str) -> dict:
    env = {var: os.path.join(cache, sub) for var, sub in CACHE_VARS.items()}
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    return env


def child_env(cache: str) -> dict:
    env = dict(os.environ)
    for k, v in OFFLINE.items():
        env.setdefault(k, v)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.update(cache_env(cache), PYTHONUNBUFFERED="1", NO_COLOR="1", VLLM_LOGGING_COLOR="0")
    return env


def drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_logged(cmd: list[str], env: dict, timeout: float, quiet: bool, t0: float):
    """Runs `cmd`, reading its stdout and stderr (vLLM logs to stdout unless VLLM_LOGGING_STREAM says otherwise),
    each line with its arrival time in seconds since t0, echoed unless quiet. Kills the whole process group
    (vLLM's EngineCore too) past `timeout`. Returns (returncode, stdout lines, all (time, line), timed_out)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    lines: list[tuple[float, str]] = []
    stdout_lines: list[str] = []

    def pump(pipe, echo, keep):   # a line (ended by '\n' or, for progress bars, '\r') timed by its first byte
        fd, buf, started = pipe.fileno(), b"", None
        while True:
            chunk = os.read(fd, 1 << 16)
            now = time.time() - t0
            if not chunk:
                break
            if not quiet:
                echo.buffer.write(chunk)
                echo.flush()
            if not buf:
                started = now
            buf += chunk
            parts = re.split(rb"\r\n|\r|\n", buf)
            buf = parts.pop()
            for part in parts:
                if part.strip():
                    lines.append((started, part.decode(errors="replace")))
                    if keep is not None:
                        keep.append(part.decode(errors="replace"))
                started = now
        if buf.strip():
            lines.append((started, buf.decode(errors="replace")))
            if keep is not None:
                keep.append(buf.decode(errors="replace"))
    readers = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout, stdout_lines), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, sys.stderr, None), daemon=True)]
    for r in readers:
        r.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:   # what the run left (vLLM's EngineCore, a timed-out run whole)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    for r in readers:
        r.join(10)
    lines.sort(key=lambda x: x[0])
    return proc.returncode, stdout_lines, lines, timed_out


def child_json(stdout_lines: list[str]) -> dict | None:
    """The child's result: its last stdout line that is a JSON object."""
    for line in reversed(stdout_lines):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return None


def engine_task(a, model: str, draft: str | None, random_weights: bool, prompt: list[int]) -> dict:
    """The start-up child's task: LLM(...)'s keywords as `jaxspec-bench startup --baseline vllm` builds them."""
    from jaxspec.bench.baselines.vllm import _has_linear_attention, _read_config, build_request, engine_kwargs
    ns = types.SimpleNamespace(spec_method="draft_model" if draft else None, num_spec_tokens=a.num_spec_tokens,
                               max_concurrency=a.max_num_seqs, max_model_len=a.max_model_len,
                               max_num_batched_tokens=a.max_num_batched_tokens, temperature=a.temperature,
                               seed=a.seed, ignore_eos=True, random_weights=random_weights, dtype=a.dtype,
                               vllm_memory_fraction=a.gpu_memory_utilization)
    request = build_request(ns, [prompt], [1], model, draft)
    kwargs = engine_kwargs(request, has_flashinfer=True)   # without FlashInfer: decided in the child
    kwargs["disable_log_stats"] = True
    kwargs.update(a.llm_kwargs)
    return {"kwargs": kwargs, "prompt": prompt, "temperature": a.temperature, "seed": a.seed,
            "triton_gdn_unless_flashinfer": _has_linear_attention(_read_config(model))}


def one_run(a, task: dict, kind: str, index: int, cache: str) -> dict:
    from jaxspec.bench.baselines.vllm import _STARTUP_CHILD
    from jaxspec.bench.startup import T0_ENV
    dropped = drop_page_cache() if (a.drop_page_cache and kind == "cold") else None
    env = child_env(cache)
    t0 = time.time()
    env[T0_ENV] = repr(t0)
    rc, stdout_lines, lines, timed_out = run_logged([a.python, "-c", _STARTUP_CHILD, json.dumps(task)], env,
                                                    a.timeout, a.quiet, t0)
    wall = round(time.time() - t0, 3)
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
        with open(os.path.join(a.log_dir, f"{index}-{kind}.log"), "w") as f:
            f.write("".join(f"[{t:9.3f}] {line}\n" for t, line in lines))
    row = {"run": f"vllm-{kind}", "index": index, "cache_dir": cache, "process_wall_s": wall,
           "page_cache_dropped": dropped, "log": parse_log(lines)}
    result = child_json(stdout_lines)
    if rc == 0 and result is not None:
        row.update(result, ok=True)
    else:
        row.update(ok=False, error=(f"timed out after {a.timeout:.0f} s" if timed_out else
                                    f"the {kind} run failed (exit code {rc})"),
                   log_tail=[line for _, line in lines[-40:]])
        print(f"vllm_startup: {row['error']}; the end of its output:\n  " + "\n  ".join(row["log_tail"][-15:]),
              file=sys.stderr)
    return row


def bench_startup(a, task: dict, cache: str) -> dict:
    """`vllm bench startup` on the same engine arguments: 1 cold, 1 warm-up, 1 warm iteration."""
    kw = task["kwargs"]
    flags = {"model": kw["model"], "dtype": kw["dtype"], "max_model_len": kw["max_model_len"],
             "max_num_seqs": kw["max_num_seqs"], "max_num_batched_tokens": kw["max_num_batched_tokens"],
             "gpu_memory_utilization": kw["gpu_memory_utilization"], "seed": kw["seed"],
             "load_format": kw.get("load_format")}
    cmd = [a.python, "-m", "vllm.entrypoints.cli.main", "bench", "startup"]
    for k, v in flags.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    if kw.get("skip_tokenizer_init"):
        cmd.append("--skip-tokenizer-init")
    if kw.get("speculative_config"):
        cmd += ["--speculative-config", json.dumps(kw["speculative_config"])]
    out = os.path.join(cache, "vllm_bench_startup.json")
    cmd += ["--num-iters-cold", "1", "--num-iters-warmup", "1", "--num-iters-warm", "1", "--output-json", out]
    t0 = time.time()
    rc, _, lines, timed_out = run_logged(cmd, child_env(cache), 3 * a.timeout, a.quiet, t0)
    res = {"command": cmd, "wall_s": round(time.time() - t0, 3), "returncode": rc}
    try:
        with open(out) as f:
            res["result"] = json.load(f)
    except (OSError, ValueError):
        res["error"] = "timed out" if timed_out else "no result"
        res["log_tail"] = [line for _, line in lines[-40:]]
    return res


SUMMARY_KEYS = ("import", "engine", "first_token")
LOG_KEYS = ("model_loading_s", "dynamo_s", "inductor_compile_s", "compiled_graphs_loaded_s", "torch_compile_s",
            "memory_profiling_s", "cuda_graph_s", "cuda_graphs_wall_s", "init_engine_s")


def summarize(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        key = f"{r['index']}-{r['run']}"
        ph = r.get("phases", {})
        log = r["log"]
        tc = log.get("torch_compile_s")
        out[key] = {**{k: ph.get(k) for k in SUMMARY_KEYS},
                    **{k: (round(sum(tc), 3) if k == "torch_compile_s" and tc else log.get(k))
                       for k in LOG_KEYS}, "ok": r.get("ok")}
    return out


def print_table(summary: dict, device: str | None):
    head = ["run", "import", "engine", "1st token", "load", "compile", "graphs", "init engine"]
    rows = []
    for key, s in summary.items():
        cells = [s["import"], s["engine"], s["first_token"], s["model_loading_s"], s["torch_compile_s"],
                 s["cuda_graphs_wall_s"] if s["cuda_graphs_wall_s"] is not None else s["cuda_graph_s"],
                 s["init_engine_s"]]
        rows.append([key] + [f"{c:.2f}" if isinstance(c, (int, float)) else "-" for c in cells])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    print(f"vLLM start-up, seconds ({device or 'device unknown'}): import/engine/1st token since the process "
          "started; load, compile, graphs, init engine as vLLM's log gives them")
    for row in [head, *rows]:
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    check_args(p, a)
    root = a.cache_root or tempfile.mkdtemp(prefix="vllm-startup-")
    os.makedirs(root, exist_ok=True)
    rows, bench = [], None
    try:
        model = model_dir(a.model, os.path.join(root, "configs"))
        draft = model_dir(a.draft_model, os.path.join(root, "configs")) if a.draft_model else None
        random_weights = (a.load_format == "dummy" if a.load_format else not has_weights(model))
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {})["vocab_size"]
        import numpy as np   # the prompt jaxspec-bench startup times: --input-len ids below the vocabulary, --seed
        prompt = np.random.default_rng(a.seed).integers(0, vocab, a.input_len).tolist()
        task = engine_task(a, model, draft, random_weights, prompt)
        cache, cold_ok = None, None
        for i, kind in enumerate(a.runs):
            if kind == "cold":
                cache = tempfile.mkdtemp(dir=root, prefix=f"{i}-cold-")
                cold_ok = None
            elif cold_ok is False:   # nothing for it to reuse
                rows.append({"run": f"vllm-{kind}", "index": i, "ok": False, "log": parse_log([]),
                             "error": "skipped: the cold run before it failed"})
                continue
            rows.append(one_run(a, task, kind, i, cache))
            if kind == "cold":
                cold_ok = rows[-1]["ok"]
            s = summarize(rows[-1:])
            print(f"vllm_startup: {kind}: " + json.dumps(next(iter(s.values()))), flush=True)
        if a.vllm_bench_startup:
            bench = bench_startup(a, task, tempfile.mkdtemp(dir=root, prefix="bench-startup-"))
        summary = summarize(rows)
        device = next((r.get("device") for r in rows if r.get("device")), None)
        print_table(summary, device)
        if bench is not None:
            print("vllm bench startup:", json.dumps(bench.get("result") or bench.get("error")))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"runs": rows, "summary": summary, "vllm_bench_startup": bench, "task": task,
                           "model_dir": model, "draft_model_dir": draft, "random_weights": random_weights,
                           "args": vars(a), "device": device,
                           "vllm": next((r.get("vllm") for r in rows if r.get("vllm")), None),
                           "torch": next((r.get("torch") for r in rows if r.get("torch")), None)}, f, indent=1)
    finally:
        if a.cache_root is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
