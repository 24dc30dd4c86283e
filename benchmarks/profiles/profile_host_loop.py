"""The host's own work per steady-state decode step, by phase, at several batch sizes, with a real tokenizer.

A tiny random model over SmolLM2's whole vocabulary (49152 tokens; its random weights make greedy text real
tokens of every kind) and the SmolLM2 tokenizer, which detokenizes as `LLM.generate` does (text rendered each
step only for requests with stop strings: half of them here) or as a server does (`--stream`: every request
streamed, a RequestOutput delta per step each). Phases, from Engine.step's timings: schedule, build (the step's
host inputs), process (read tokens: append, stop checks, detokenize, finish) and publish (the deltas of
streamed requests); `issue` (the jitted call) and `wait` (the device) are shown apart.

Sync mode by default. The device step is a stub by default (`--model` runs the tiny model instead): it packs
the inputs as the real one does and answers random tokens of the vocabulary at once; on a CPU backend the real
step's threads share the host's cores and spin after each step, which inflated the host phases 2-4x. Each
phase's figure is its median over the measured steps (wall time, as the engine measures it), so that steps
where other processes took the cores count little; `host` is the median of the steps' sums.

    python benchmarks/profiles/profile_host_loop.py --batches 1 8 32 [--stream] [--cprofile 32]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import queue
import statistics
import time

import numpy as np

from jaxspec import SamplingParams
from jaxspec.models.config import ModelConfig
from jaxspec.models.model import Model
from jaxspec.models.random import random_params
from jaxspec.sched.engine import Engine, EngineConfig

HOST_PHASES = ("schedule", "build", "process", "publish")
TEMPERATURE = 0.0
STOPS = ["<|never seen|>", "#@#@"]   # render the text every step; random tokens practically never complete them


def smollm2_tokenizer():
    from jaxspec.models.gguf_loader import hf_tokenizer_from_gguf
    from jaxspec.models.presets import preset_path
    from jaxspec.models.tokenizer import Tokenizer
    return Tokenizer(hf_tokenizer_from_gguf(preset_path("smollm2-135m-instruct")))


def tiny_model(tokenizer) -> Model:
    config = ModelConfig(arch="llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=4096)
    return Model(config, random_params(config, "float32", scale=0.5), tokenizer=tokenizer, name="tiny-smollm2-vocab")


def stub_device(engine: Engine, seed: int = 0):
    """The runner answers each step at once with random tokens (every row accepts no drafts), after packing
    its inputs (the host's part of a transfer)."""
    rng = np.random.default_rng(seed)
    runner, vocab = engine.runner, engine.model.config.vocab_size
    width = engine.step_config.num_speculative_tokens + 2

    def run(inputs, variant, grammar_table=None):
        inputs.pack()
        runner.last_run_compiled = False
        tokens = rng.integers(0, vocab, (inputs.int_rows.shape[1], width), dtype=np.int32)
        tokens[:, -1] = 0
        return {"tokens": tokens}
    runner.run = run


def measure(engine: Engine, batch: int, stream: bool, warm_steps: int, steps: int, profile: bool):
    """Per-step seconds of each phase (its median) over `steps` steady-state decode steps of `batch` requests."""
    rng = np.random.default_rng(batch)
    sink = queue.SimpleQueue() if stream else None
    reqs = [engine.add_request(rng.integers(100, 40000, 64).tolist(),
                               SamplingParams(temperature=TEMPERATURE, max_tokens=3000, ignore_eos=True,
                                              stop=STOPS if i % 2 == 0 else None), outputs=sink)
            for i in range(batch)]
    while any(r.prefilling or r.slot is None for r in reqs):
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    per_step: list[dict] = []
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        per_step.append({})
        engine.step(per_step[-1])
        while sink is not None and not sink.empty():
            sink.get()
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    ended = [(r.finish_reason, r.text[-40:]) for r in reqs if r.finished]
    assert not ended, f"requests finished inside the measured window: {ended}"
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    for t in per_step:
        t["host"] = sum(t.get(k, 0.0) for k in HOST_PHASES)
    medians = {k: statistics.median(t.get(k, 0.0) for t in per_step) for k in (*HOST_PHASES, "host", "issue", "wait")}
    medians["wall"] = wall / steps   # the mean
    return medians, prof


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--warm-steps", type=int, default=50)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--stream", action="store_true", help="every request streamed (a server's deltas)")
    p.add_argument("--model", action="store_true", help="run the tiny model's step (default: a stub device)")
    p.add_argument("--async", dest="async_", action="store_true", help="async scheduling (default: sync)")
    p.add_argument("--cprofile", type=int, default=None, help="also cProfile the host at this batch")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    engine = Engine(tiny_model(smollm2_tokenizer()), EngineConfig(
        max_num_seqs=max(a.batches), max_model_len=4096, max_num_batched_tokens=256, warmup=False,
        async_scheduling=a.async_))
    if not a.model:
        stub_device(engine)
    results, profiles = {}, {}
    for b in a.batches:
        measure(engine, b, a.stream, 5, 5, False)   # compiles this batch's buckets
        results[b], _ = measure(engine, b, a.stream, a.warm_steps, a.steps, False)
        if a.cprofile == b:   # apart: cProfile slows every Python call down
            profiles[b] = measure(engine, b, a.stream, a.warm_steps, a.steps, True)[1]
    mode = f"{'stream' if a.stream else 'generate'}, {'async' if a.async_ else 'sync'}, {'model' if a.model else 'stub'} device"
    print(f"host us per decode step, median ({mode}; SmolLM2 tokenizer; half the requests with stop strings)")
    print(f"{'phase':<10}" + "".join(f"{'batch ' + str(b):>12}" for b in a.batches))
    for phase in (*HOST_PHASES, "host", "issue", "wait", "wall"):
        vals = [r[phase] for r in results.values()]
        print(f"{phase:<10}" + "".join(f"{1e6 * v:>12.1f}" for v in vals))
    for b, prof in profiles.items():
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print(f"=== cProfile, batch {b}")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
