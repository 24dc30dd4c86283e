"""Times the decode step on the device and breaks one traced step down by kernel.

    python3 scripts/profile_step.py --model qwen2.5-coder-1.5b-instruct --batches 1 32 --trace-dir /tmp/trace
"""
import argparse
import collections
import glob
import time

import jax

from jaxspec.bench import decode_bytes, device_step_time
from jaxspec.decode.state import empty_inputs, pack_inputs
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
    a = p.parse_args()
    model = random_model(a.model, dtype="bfloat16")
    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(max_num_seqs=max(a.batches), max_model_len=a.max_model_len,
                                        max_num_batched_tokens=max(8, max(a.batches)), warmup=False))
    rows = []
    for b in a.batches:
        step_s = device_step_time(engine, b)
        bound = decode_bytes(engine, b, a.max_model_len // 2) / 2.98e12
        rows.append((b, engine._bucket(b), 1e3 * step_s, 1e3 * bound))
        T = engine._bucket(b)
        buf = jax.device_put(pack_inputs(empty_inputs(T, engine._rows_for(T), engine.step_config)))
        with jax.profiler.trace(f"{a.trace_dir}/b{b}"):
            for _ in range(5):
                engine.state, out = engine._steps[T](engine.params, None, engine.state, buf)
            jax.block_until_ready(out["tokens"])
        print(f"--- batch {b} (T={T})")
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
