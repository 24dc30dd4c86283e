"""Where the bench's TPOT goes beyond the step (GPU): `LLM.generate` as `jaxspec-bench` runs it (random bf16
weights, 128-token random prompts, 256 greedy tokens, ignore_eos, one request per batch slot), with the engine's
host phases timed per step, the inter-token gaps' spread, and the same with Python's garbage collector off.

    python3 benchmarks/end_to_end/tpot_phases.py [model] [batch ...]

model: a preset name (random bf16 weights of its shapes; default Qwen2.5-Coder-1.5B) or a checkpoint path (its
real weights and tokenizer). STOP=1 gives every request a stop string, so the engine renders each request's text
every step (incremental detokenization, as streaming does); TOKENIZER=DIR puts a Hugging Face tokenizer folder on
the random weights. Device busy: the replayed decode step over the median
TPOT (the decode steps' time per token). Each run also prints the generate call's output tok/s and wall time per
output token of a request (the time to first token included), as benchmarks/end_to_end/vllm_batches.py does for vLLM, and a
digest of the output tokens (the same across loop settings that must not change them).

The traced run also prints one decode layer's kernels in order (attention to attention). MERGE_KERNEL=0 merges
the attention's context splits with XLA's ops instead of the merge kernel, SPLIT_PROGRAMS=N sets the fused
attention's split target (paged_attention.FUSED_SPLIT_PROGRAMS), SPLIT_PAGES=N the pages a split program reads
per iteration (FUSED_SPLIT_PAGES_PER_ITER): before/after on one machine. Steps compile as
the first generate meets them (no engine warm-up).
"""
import collections
import functools
import gc
import os
import statistics
import sys
import time

import importlib.util
import pathlib

import jax
import numpy as np

from jaxspec import LLM, SamplingParams
from jaxspec.bench.measure import device_step_time
from jaxspec.bench.outputs import output_digest
from jaxspec.models.random import random_model

_spec = importlib.util.spec_from_file_location("profile_step",
                                               pathlib.Path(__file__).parents[1] / "profiles" / "profile_step.py")
profile_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_step)

import jaxspec.pallas.paged_attention as pa  # noqa: E402
pa.MERGE_KERNEL = os.environ.get("MERGE_KERNEL", "1") == "1"
pa.FUSED_SPLIT_PROGRAMS = int(os.environ.get("SPLIT_PROGRAMS", pa.FUSED_SPLIT_PROGRAMS))
if os.environ.get("SPLIT_PAGES"):
    pa.FUSED_SPLIT_PAGES_PER_ITER = int(os.environ["SPLIT_PAGES"])


def layer_sequence(trace_dir: str, kernel: str = "paged_attention_fused", back: int = 4):
    """The kernels of one decode layer in launch order, from the `back`-th last call of `kernel` to the next."""
    evs = profile_step.device_events(trace_dir)
    at = [i for i, (_, _, n) in enumerate(evs) if n.startswith(kernel)]
    if len(at) <= back:
        return print(f"fewer than {back + 1} {kernel} calls in the trace")
    window = evs[at[-back - 1]:at[-back]]
    print(f"one decode layer: {len(window)} kernels, {sum(d for _, d, _ in window) / 1e3:.2f} us of kernels, "
          f"{(evs[at[-back]][0] - window[0][0]) / 1e3:.2f} us from attention to attention")
    for start, dur, n in window:
        print(f"  {(start - window[0][0]) / 1e3:8.2f} us  {dur / 1e3:6.2f} us  {n[:90]}")


name = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else "qwen2.5-coder-1.5b-instruct"
batches = [int(b) for b in sys.argv[2:]] or [1, 32]
model = name if os.path.exists(name) else random_model(name, dtype="bfloat16")
if os.environ.get("TOKENIZER"):   # a Hugging Face tokenizer folder: the real tokenizer on random weights
    if isinstance(model, str):
        raise SystemExit(f"TOKENIZER goes with a preset's random weights; the checkpoint {name} has its own tokenizer")
    from transformers import AutoTokenizer

    from jaxspec.models.tokenizer import Tokenizer
    model.tokenizer = Tokenizer(AutoTokenizer.from_pretrained(os.environ["TOKENIZER"]))
stop = ["<no such text>"] if os.environ.get("STOP") == "1" else None
for B in batches:
    llm = LLM(model, max_num_seqs=B, max_model_len=1024, warmup=False)
    engine = llm.engine
    rng = np.random.default_rng(B)
    prompts = [rng.integers(0, 1000, 128).tolist() for _ in range(B)]
    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True, stop=stop)
    llm.generate(prompts, sp, use_tqdm=False)    # every step variant this run meets compiled
    orig = engine.step
    for label in ("gc on", "gc off", "gc on, timed phases"):
        acc = collections.Counter()
        if label.endswith("phases"):
            engine.step = functools.partial(orig, timings=acc)
        if label == "gc off":
            gc.collect()
            gc.disable()
        steps0 = engine.counters["steps"]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        gc.enable()
        engine.step = orig
        steps = engine.counters["steps"] - steps0
        tpot = statistics.median(o.metrics["tpot"] for o in outs)
        gaps = np.asarray([g for o in outs for g in o.metrics["inter_token_latencies"][1:] if g > 0]) * 1e3
        line = (f"batch {B}, {label}: TPOT {1e3 * tpot:.3f} ms; {B * 256 / wall:.0f} tok/s, {1e3 * wall / 256:.3f} ms "
                f"per token of a request; digest {output_digest([o.token_ids for o in outs])}; {steps} steps, wall "
                f"{1e3 * wall / steps:.3f} ms per "
                f"step; token gaps p10 / p50 / p90 / p99 {np.percentile(gaps, 10):.3f} / {np.percentile(gaps, 50):.3f}"
                f" / {np.percentile(gaps, 90):.3f} / {np.percentile(gaps, 99):.3f} ms")
        if acc:
            line += "; host phases per step: " + ", ".join(
                f"{k} {1e3 * v / steps:.3f}" for k, v in acc.items() if k != "dispatch")
        print(line, flush=True)
    # the same engine's step replayed back to back, and a traced generate: kernel time per step and device gaps
    replayed = device_step_time(engine, B)
    print(f"batch {B}: replayed step {1e3 * replayed:.3f} ms; device busy {100 * min(1.0, replayed / tpot):.1f}% "
          f"of the last run's median TPOT", flush=True)
    if os.environ.get("TRACE") == "0":
        continue
    steps0 = engine.counters["steps"]
    trace = f"/tmp/tpot-trace-{B}"
    with jax.profiler.trace(trace):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    profile_step.kernel_breakdown(trace, engine.counters["steps"] - steps0, top=4)
    profile_step.busy_gaps(trace, top=8)
    layer_sequence(trace)
    del llm, engine
