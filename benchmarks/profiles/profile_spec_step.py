"""Kernel breakdown of the replayed speculative step (Qwen2.5-Coder-1.5B target, 0.5B draft model at k, random
bf16 weights, one 128-token request decoding): kernels per step, distinct kernels, time by kernel. Runs against
this tree or an older checkout (see benchmarks/end_to_end/bench_core.py).

    python3 benchmarks/profiles/profile_spec_step.py /tmp/trace 4
"""
import collections
import glob
import os
import sys

import jax
from jax.profiler import ProfileData

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "end_to_end"))
from bench_core import handles  # noqa: E402
from jaxspec import LLM, SamplingParams  # noqa: E402
from jaxspec.models.random import random_model  # noqa: E402


def main(trace_dir: str, k: int, steps: int = 5):
    target = random_model("qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
    draft = random_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16", seed=1)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k} if k else None
    llm = LLM(target, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=256, warmup=False,
              speculative_config=spec)
    llm.generate([list(range(128))], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    _, bucket_for, replay = handles(llm.engine)
    T = bucket_for(1 + k)
    jax.block_until_ready(replay(T)["tokens"])
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            out = replay(T)
        jax.block_until_ready(out["tokens"])
    totals, counts = collections.Counter(), collections.Counter()
    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    for plane in ProfileData.from_file(path).planes:
        if "GPU" not in plane.name:
            continue
        for line in plane.lines:
            if "Stream" in line.name or "Kernel" in line.name:
                for ev in line.events:
                    totals[ev.name] += ev.duration_ns
                    counts[ev.name] += 1
    print(f"kernel time per step {sum(totals.values()) / steps / 1e3:.1f} us, "
          f"{sum(counts.values()) / steps:.0f} kernels per step, {len(totals)} distinct")
    for name, ns in totals.most_common(20):
        print(f"  {ns / steps / 1e3:9.1f} us  x{counts[name] // steps:4d}  {name[:90]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
