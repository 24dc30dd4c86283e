"""Where the host's time goes per engine step in steady-state decode (cProfile), sync and async.

    python3 benchmarks/profiles/profile_host.py --model qwen2.5-coder-1.5b-instruct --batches 1 32
"""
import argparse
import cProfile
import io
import pstats
import time

import numpy as np

from jaxspec import SamplingParams
from jaxspec.models.random import random_model
from jaxspec.sched.engine import Engine, EngineConfig


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--top", type=int, default=18)
    a = p.parse_args()
    model = random_model(a.model, dtype="bfloat16")
    for async_mode in (False, True):
        engine = Engine(model, EngineConfig(max_num_seqs=max(a.batches), max_model_len=512, warmup=False,
                                            max_num_batched_tokens=256, async_scheduling=async_mode))
        for b in a.batches:
            rng = np.random.default_rng(0)
            reqs = [engine.add_request(rng.integers(0, 1000, 64).tolist(),
                                       SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
                    for _ in range(b)]
            while any(r.prefilling or r.slot is None for r in reqs):
                engine.step()
            for _ in range(5):
                engine.step()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(a.steps):
                engine.step()
            prof.disable()
            wall = (time.perf_counter() - t0) / a.steps
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.top)
            print(f"=== {'async' if async_mode else 'sync'} batch {b}: {1e3 * wall:.3f} ms per step (under cProfile)")
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))
            for r in reqs:
                engine.abort(r.request_id)
            while engine.has_unfinished():
                engine.step()


if __name__ == "__main__":
    main()
