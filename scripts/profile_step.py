"""Times the decode step on the device and breaks one traced step down by kernel.

    python3 scripts/profile_step.py --model qwen2.5-coder-1.5b-instruct --batches 1 32 --trace-dir /tmp/trace
"""
import argparse
import collections
import glob
import time

import jax
import numpy as np

from jaxspec import SamplingParams
from jaxspec.bench import decode_bytes, device_step_time
from jaxspec.models.random import random_model
from jaxspec.sched.engine import Engine, EngineConfig


def kernel_breakdown(trace_dir: str, steps: int, top: int = 25):
    """Sum of device event durations by name, per step, from the profiler's xspace file."""
    from jax.profiler import ProfileData
    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    data = ProfileData.from_file(path)
    totals, lines_seen = collections.Counter(), set()
    for plane in data.planes:
        if "GPU" not in plane.name:
            continue
        for line in plane.lines:
            if "Stream" not in line.name and "Kernel" not in line.name:
                continue
            lines_seen.add(line.name)
            for ev in line.events:
                totals[ev.name] += ev.duration_ns
    total = sum(totals.values())
    print(f"device lines: {sorted(lines_seen)[:6]}; kernel time per step {total / steps / 1e3:.1f} us, "
          f"{len(totals)} distinct kernels")
    for name, ns in totals.most_common(top):
        print(f"  {ns / steps / 1e3:9.1f} us  {100 * ns / max(total, 1):5.1f}%  {name[:110]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--trace-dir", default="/tmp/jaxspec-trace")
    p.add_argument("--context", type=int, default=192, help="prompt tokens of each live decode row")
    a = p.parse_args()
    model = random_model(a.model, dtype="bfloat16")
    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(max_num_seqs=max(a.batches), max_model_len=a.max_model_len,
                                        max_num_batched_tokens=max(8, max(a.batches)), warmup=False))
    rows = []
    for b in a.batches:
        # Live decode rows (prompt of `--context` tokens) so the replayed step reads a real context.
        rng = np.random.default_rng(b)
        reqs = [engine.add_request(rng.integers(0, 1000, a.context).tolist(),
                                   SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)) for _ in range(b)]
        while any(r.prefilling or r.slot is None for r in reqs):
            engine.step()
        for _ in range(4):
            engine.step()
        engine.flush()
        step_s = device_step_time(engine, b)
        T = engine._bucket(b)
        fn, buf = engine._steps[T], engine.last_inputs[T]
        jax.block_until_ready(engine.state.num_tokens)
        t0 = time.perf_counter()
        for _ in range(10):
            engine.state, out = fn(engine.params, None, engine.state, buf)
        launch_s = (time.perf_counter() - t0) / 10
        jax.block_until_ready(out["tokens"])
        print(f"batch {b}: host time to launch one step {1e3 * launch_s:.3f} ms", flush=True)
        bound = decode_bytes(engine, b, a.context + 8) / 2.98e12
        rows.append((b, engine._bucket(b), 1e3 * step_s, 1e3 * bound))
        with jax.profiler.trace(f"{a.trace_dir}/b{b}"):
            for _ in range(5):
                engine.state, out = engine._steps[T](engine.params, None, engine.state, buf)
            jax.block_until_ready(out["tokens"])
        print(f"--- batch {b} (T={T})")
        for r in reqs:
            engine.abort(r.request_id)
        while engine.has_unfinished():
            engine.step()
        try:
            kernel_breakdown(f"{a.trace_dir}/b{b}", 5)
        except Exception as e:  # noqa: BLE001 - the timing table below still stands
            print(f"no kernel breakdown: {type(e).__name__}: {e}")
    print(f"engine built and compiled in {time.perf_counter() - t0:.1f}s")
    print(f"{'batch':>6}{'T':>5}{'step ms':>10}{'bound ms':>10}{'step/bound':>12}")
    for b, T, s, bd in rows:
        print(f"{b:>6}{T:>5}{s:>10.3f}{bd:>10.3f}{s / bd:>12.2f}")


if __name__ == "__main__":
    main()
