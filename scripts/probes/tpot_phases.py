"""Where the bench's TPOT goes beyond the step (GPU): `LLM.generate` as `jaxspec-bench` runs it (random bf16
weights, 128-token random prompts, 256 greedy tokens, ignore_eos, one request per batch slot), with the engine's
host phases timed per step, the inter-token gaps' spread, and the same with Python's garbage collector off.

    python3 scripts/probes/tpot_phases.py [model] [batch ...]
"""
import collections
import functools
import gc
import statistics
import sys
import time

import importlib.util
import pathlib

import jax
import numpy as np

from jaxspec import LLM, SamplingParams
from jaxspec.bench import device_step_time
from jaxspec.models.random import random_model

_spec = importlib.util.spec_from_file_location("profile_step", pathlib.Path(__file__).parents[1] / "profile_step.py")
profile_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_step)

name = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else "qwen2.5-coder-1.5b-instruct"
batches = [int(b) for b in sys.argv[2:]] or [1, 32]
model = random_model(name, dtype="bfloat16")
for B in batches:
    llm = LLM(model, max_num_seqs=B, max_model_len=1024)
    engine = llm.engine
    rng = np.random.default_rng(B)
    prompts = [rng.integers(0, 1000, 128).tolist() for _ in range(B)]
    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)    # every step variant compiled
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
        line = (f"batch {B}, {label}: TPOT {1e3 * tpot:.3f} ms; {steps} steps, wall {1e3 * wall / steps:.3f} ms per "
                f"step; token gaps p10 / p50 / p90 / p99 {np.percentile(gaps, 10):.3f} / {np.percentile(gaps, 50):.3f}"
                f" / {np.percentile(gaps, 90):.3f} / {np.percentile(gaps, 99):.3f} ms")
        if acc:
            line += "; host phases per step: " + ", ".join(
                f"{k} {1e3 * v / steps:.3f}" for k, v in acc.items() if k != "dispatch")
        print(line, flush=True)
    # the same engine's step replayed back to back, and a traced generate: kernel time per step and device gaps
    print(f"batch {B}: replayed step {1e3 * device_step_time(engine, B):.3f} ms", flush=True)
    steps0 = engine.counters["steps"]
    trace = f"/tmp/tpot-trace-{B}"
    with jax.profiler.trace(trace):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    profile_step.kernel_breakdown(trace, engine.counters["steps"] - steps0, top=4)
    profile_step.busy_gaps(trace, top=8)
    del llm, engine
