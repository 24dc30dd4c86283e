"""Device time of the EAGLE-3 speculative step (k=4, greedy) on Qwen2.5-Coder-1.5B shapes, random bf16 weights,
with a random head written in the published HF layout (32000-token draft vocabulary), at batch 1 and 8. Runs
against this tree or an older checkout (see benchmarks/end_to_end/bench_core.py).

    python3 benchmarks/end_to_end/bench_eagle3_step.py [--quantization fp8] [--plain]

--quantization fp8: the target's and the head's projections in FP8 (LLM's quantization).
"""
import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from bench_core import handles  # noqa: E402
from eagle_heads import write_eagle3_head  # noqa: E402
from jaxspec import LLM, SamplingParams  # noqa: E402
from jaxspec.models.random import random_model  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quantization", default=None, choices=["fp8"])
    p.add_argument("--plain", action="store_true", help="also time the target's plain decode step")
    a = p.parse_args()
    target = random_model("qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
    head = write_eagle3_head("/tmp/eagle3_head", target.config, seed=0, draft_vocab_size=32000)
    llm = LLM(target, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=256, warmup=False,
              quantization=a.quantization, speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 4})
    for b in (1, 8):
        rng = np.random.default_rng(b)
        llm.generate([rng.integers(0, 1000, 128).tolist() for _ in range(b)],
                     SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        _, bucket_for, replay = handles(llm.engine)
        T = bucket_for(b * 5)
        jax.block_until_ready(replay(T)["tokens"])
        t0 = time.perf_counter()
        for _ in range(20):
            out = replay(T)
        jax.block_until_ready(out["tokens"])
        print(f"eagle3 k=4 {a.quantization or 'bf16'} batch {b}: device step {1e3 * (time.perf_counter() - t0) / 20:.3f} ms", flush=True)
    if a.plain:   # the plain decode step of the same target, same process: the speculative step's cost ratio
        del llm
        llm = LLM(target, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=256, warmup=False,
                  quantization=a.quantization)
        for b in (1, 8):
            rng = np.random.default_rng(b)
            llm.generate([rng.integers(0, 1000, 128).tolist() for _ in range(b)],
                         SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
            _, bucket_for, replay = handles(llm.engine)
            T = bucket_for(b)
            jax.block_until_ready(replay(T)["tokens"])
            t0 = time.perf_counter()
            for _ in range(20):
                out = replay(T)
            jax.block_until_ready(out["tokens"])
            print(f"plain {a.quantization or 'bf16'} batch {b}: device step "
                  f"{1e3 * (time.perf_counter() - t0) / 20:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
