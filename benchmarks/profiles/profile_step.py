"""Times the decode step on the device and breaks one traced step down by kernel.

    python3 benchmarks/profiles/profile_step.py --model qwen2.5-coder-1.5b-instruct --batches 1 32 --trace-dir /tmp/trace

`--structured-json SCHEMA --tokenizer DIR` constrains every live row (compact JSON; the grammar's variant of the
step); `--ngram` profiles the n-gram speculative step; `--matmuls` adds each projection's bytes, time and share of
the copy bandwidth at each batch's bucket of tokens (matmul_table.py's table). The replayed device step is timed
first, from the state the prefill leaves, so a constrained row walks through its JSON's states as it would in a run.
"""
import argparse
import collections
import glob
import json
import time

import jax
import numpy as np

from jaxspec import SamplingParams
from jaxspec.bench.measure import decode_bytes, device_step_time
from jaxspec.models.random import random_model
from jaxspec.sched.engine import Engine, EngineConfig


COLLECTIVE_KERNELS = ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter")


def first_gpu_planes(trace_dir: str) -> list:
    """The trace's planes of the first GPU: with tensor parallelism every device runs the same kernels, and
    summing every device's would count each kernel once per device."""
    from jax.profiler import ProfileData
    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    gpus = [plane for plane in ProfileData.from_file(path).planes if "GPU" in plane.name]
    return [plane for plane in gpus if plane.name == min(p.name for p in gpus)] if gpus else []


def kernel_breakdown(trace_dir: str, steps: int, top: int = 25):
    """Sum of one device's event durations by name, per step, from the profiler's xspace file; the collectives'
    share on its own line (with tensor parallelism their time includes waiting for the other devices)."""
    totals, lines_seen, launches = collections.Counter(), set(), 0
    for plane in first_gpu_planes(trace_dir):
        for line in plane.lines:
            if "Stream" not in line.name and "Kernel" not in line.name:
                continue
            lines_seen.add(line.name)
            for ev in line.events:
                totals[ev.name] += ev.duration_ns
                launches += 1
    total = sum(totals.values())
    print(f"device lines: {sorted(lines_seen)[:6]}; kernel time per step {total / steps / 1e3:.1f} us, "
          f"{len(totals)} distinct kernels, {launches / steps:.0f} per step")
    collective = {n: ns for n, ns in totals.items() if any(c in n.lower() for c in COLLECTIVE_KERNELS)}
    if collective:
        print(f"collectives: {sum(collective.values()) / steps / 1e3:.1f} us per step over "
              f"{len(collective)} kernel names")
    for name, ns in totals.most_common(top):
        print(f"  {ns / steps / 1e3:9.1f} us  {100 * ns / max(total, 1):5.1f}%  {name[:110]}")


def device_events(trace_dir: str) -> list[tuple[int, int, str]]:
    """The traced window's device events (kernels and copies) on the first GPU, (start_ns, duration_ns, name) in
    start order."""
    return sorted((ev.start_ns, ev.duration_ns, ev.name) for plane in first_gpu_planes(trace_dir)
                  for line in plane.lines
                  if "Stream" in line.name or "Kernel" in line.name for ev in line.events)


def kernel_sequence(trace_dir: str, count: int):
    """The first `count` kernels of the traced window in launch order, each with its duration: one layer's
    kernels read in order (which matmul, norm, rotary or copy comes where)."""
    evs = device_events(trace_dir)
    for start, dur, name in evs[:count]:
        print(f"  at {(start - evs[0][0]) / 1e3:8.2f} us  {dur / 1e3:7.2f} us  {name[:110]}")


def busy_gaps(trace_dir: str, top: int = 6):
    """GPU busy fraction of a traced window (union of kernel intervals over first start to last end) and
    the largest idle gaps, each with the kernels on either side."""
    evs = [(start, start + dur, name) for start, dur, name in device_events(trace_dir)]
    if not evs:
        return print("no device events in the trace")
    busy, gaps, end, prev = 0, [], evs[0][0], evs[0][2]
    for start, stop, name in evs:
        if start > end:
            gaps.append((start - end, prev, name))
        busy += max(0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    window = end - evs[0][0]
    print(f"live loop trace: device busy {100 * busy / window:.1f}% of {window / 1e6:.2f} ms; "
          f"{len(gaps)} gaps, {sum(g for g, *_ in gaps) / 1e3:.0f} us idle")
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  gap {g / 1e3:8.1f} us  after {before[:50]}  before {after[:50]}")


def phase_times(engine, steps: int = 40) -> str:
    """The async loop with each host phase timed (Engine.step's timings): planning, building the inputs,
    copying them over and issuing the step (issue), waiting for the previous step's output, processing it."""
    acc = collections.Counter()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step(timings=acc)
    wall = time.perf_counter() - t0
    engine.flush()
    return (f"{1e3 * wall / steps:.3f} ms per step: " +
            ", ".join(f"{k} {1e3 * v / steps:.3f}" for k, v in acc.items() if k != "dispatch"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--trace-dir", default="/tmp/jaxspec-trace")
    p.add_argument("--context", type=int, default=192, help="prompt tokens of each live decode row")
    p.add_argument("--attention-splits", type=int, help="paged-attention context splits (default: NUM_SPLITS)")
    p.add_argument("--draft-model", help="profile the speculative step: this draft model's shapes, random")
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--ngram", action="store_true", help="profile the n-gram speculative step")
    p.add_argument("--structured-json", help="every row constrained to this JSON schema (needs --tokenizer)")
    p.add_argument("--tokenizer", help="a directory with the model's tokenizer files")
    p.add_argument("--hlo-dir", help="write each batch's compiled step (optimized HLO text) here")
    p.add_argument("--sequence", type=int, default=0, help="print the first N kernels of a traced step in order")
    p.add_argument("--quantization", choices=["fp8"], help="the engine's quantization (weights quantized on load)")
    p.add_argument("--replay-only", action="store_true", help="the replayed step and its trace only, not the "
                   "engine's own loop (one batch after another, each from a fresh engine state)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices the model is split over; the "
                   "breakdowns read the first device's kernels")
    p.add_argument("--matmuls", action="store_true", help="after the step table, each projection of the step timed "
                   "alone at each batch's bucket of tokens against the copy bandwidth "
                   "(benchmarks/profiles/matmul_table.py)")
    a = p.parse_args()
    if a.attention_splits:
        import jaxspec.pallas.paged_attention as pa
        pa.NUM_SPLITS = a.attention_splits
    model = random_model(a.model, dtype="bfloat16")
    structured = None
    if a.structured_json:
        if not a.tokenizer:
            raise SystemExit("--structured-json needs --tokenizer DIR (the constraint is compiled over its tokens)")
        from transformers import AutoTokenizer

        from jaxspec import StructuredOutputsParams
        from jaxspec.models.tokenizer import Tokenizer
        model.tokenizer = Tokenizer(AutoTokenizer.from_pretrained(a.tokenizer))
        with open(a.structured_json) as f:
            structured = StructuredOutputsParams(json=json.load(f), disable_any_whitespace=True)
    t0 = time.perf_counter()
    spec = None
    if a.draft_model or a.ngram:
        from jaxspec.spec import SpeculativeConfig
        spec = (SpeculativeConfig("ngram", None, a.num_spec_tokens) if a.ngram else
                SpeculativeConfig("draft_model", random_model(a.draft_model, dtype="bfloat16", seed=1),
                                  a.num_spec_tokens))
    k = a.num_spec_tokens if spec is not None else 0
    engine = Engine(model, EngineConfig(max_num_seqs=max(a.batches), max_model_len=a.max_model_len,
                                        max_num_batched_tokens=256, warmup=False,
                                        structured_compile_timeout=3600.0, quantization=a.quantization,
                                        tensor_parallel_size=a.tensor_parallel_size), spec)
    runner = engine.runner
    print(f"argument buffers per step: {runner.argument_buffers()}")
    rows = []
    for b in a.batches:
        # Live decode rows (prompt of `--context` tokens) so the replayed step reads a real context.
        rng = np.random.default_rng(b)
        reqs = [engine.add_request(rng.integers(0, 1000, a.context).tolist(),
                                   SamplingParams(temperature=0, max_tokens=a.max_model_len - a.context - 2,
                                                  ignore_eos=True, structured_outputs=structured))
                for _ in range(b)]
        # Early rows decode while later ones prefill: they get the room max_model_len leaves.
        while any(r.status.value == "waiting" or r.prefilling for r in reqs):
            engine.step()
        for _ in range(3):   # decode steps: the bucket the replay runs
            engine.step()
        engine.flush()
        step_s = device_step_time(engine, b * (1 + k))
        T = runner.bucket_for(b * (1 + k))
        jax.block_until_ready(runner.state.num_tokens)
        t0 = time.perf_counter()
        for _ in range(10):
            out = runner.replay(T)
        launch_s = (time.perf_counter() - t0) / 10
        jax.block_until_ready(out["tokens"])
        print(f"batch {b}: host time to launch one step {1e3 * launch_s:.3f} ms; device step {1e3 * step_s:.3f} ms; "
              f"{runner.argument_buffers()} argument buffers; {runner.kernels_per_step(T, *runner.last_variant(T))} kernels (compiled HLO)",
              flush=True)
        bound = decode_bytes(engine, b, a.context + 8) / 2.98e12
        rows.append((b, T, 1e3 * step_s, 1e3 * bound))
        with jax.profiler.trace(f"{a.trace_dir}/b{b}"):
            for _ in range(5):
                out = runner.replay(T)
            jax.block_until_ready(out["tokens"])
        if a.sequence:
            kernel_sequence(f"{a.trace_dir}/b{b}", a.sequence)
        try:
            kernel_breakdown(f"{a.trace_dir}/b{b}", 5)
        except Exception as e:  # noqa: BLE001 - the timing table below still stands
            print(f"no kernel breakdown: {type(e).__name__}: {e}")
        if a.replay_only:   # the next batch starts from no live rows
            for r in reqs:
                engine.abort(r.request_id)
            while engine.has_unfinished():
                engine.step()
            continue
        for async_mode in (True, False):   # the engine's own loop: host planning and reading included
            engine.config.async_scheduling = async_mode
            for _ in range(4):
                engine.step()
            t0 = time.perf_counter()
            for _ in range(20):
                engine.step()
            loop_ms = 1e3 * (time.perf_counter() - t0) / 20
            engine.flush()
            print(f"batch {b}: engine loop, {'async' if async_mode else 'sync'}: {loop_ms:.3f} ms per step", flush=True)
            with jax.profiler.trace(f"{a.trace_dir}/loop{b}{'a' if async_mode else 's'}"):
                for _ in range(8):
                    engine.step()
                engine.flush()
            busy_gaps(f"{a.trace_dir}/loop{b}{'a' if async_mode else 's'}")
        engine.config.async_scheduling = True
        print(f"batch {b}: async loop phases (host ms per step): {phase_times(engine)}", flush=True)
        print(f"--- batch {b} (T={T})")
        for r in reqs:
            engine.abort(r.request_id)
        while engine.has_unfinished():
            engine.step()
        if a.hlo_dir:
            import os
            os.makedirs(a.hlo_dir, exist_ok=True)
            text = runner.lower(T, *runner.last_variant(T)).compile().as_text()
            with open(f"{a.hlo_dir}/step_b{b}_T{T}.hlo", "w") as f:
                f.write(text)
    print(f"engine built and compiled in {time.perf_counter() - t0:.1f}s")
    print(f"{'batch':>6}{'T':>5}{'step ms':>10}{'bound ms':>10}{'step/bound':>12}")
    for b, T, s, bd in rows:
        print(f"{b:>6}{T:>5}{s:>10.3f}{bd:>10.3f}{s / bd:>12.2f}")
    if a.matmuls:
        from matmul_table import markdown, matmul_rows  # (this directory)
        print(markdown(matmul_rows(model, sorted({T for _, T, *_ in rows}), a.quantization)))   # the buckets' tokens


if __name__ == "__main__":
    main()
