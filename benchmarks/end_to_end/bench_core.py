"""TPOT, argument buffers per step and host issue time per step, for Qwen2.5-Coder-1.5B shapes (random bf16
weights), 128-token random prompts, 256 greedy tokens, async, at batch 1 / 8 / 32, plain and with the 0.5B
draft model at k=4 (batch 1). The before/after record of the core reshape (docs/lab/2026-11-23-core-reshape.md).

    python3 benchmarks/end_to_end/bench_core.py --json /tmp/after.json
    PYTHONPATH=/path/to/older/checkout python3 benchmarks/end_to_end/bench_core.py --json /tmp/before.json

It also runs against a checkout from before the reshape, whose engine held its params, state, buckets and
replay hook itself (`engine.params`, `engine.replay_step`, ...): `handles` picks whichever the engine has.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

from jaxspec import LLM, SamplingParams
from jaxspec.models.random import random_model


def handles(engine):
    """(argument buffers per step, bucket_for(num_tokens), replay(T)) of either engine layout."""
    runner = getattr(engine, "runner", None)
    if runner is not None:
        return runner.argument_buffers(), runner.bucket_for, runner.replay
    buffers = len(jax.tree_util.tree_leaves((engine.params, engine.drafter_params, engine.state))) + 1
    return buffers, lambda n: next(b for b in engine.token_buckets if b >= n), engine.replay_step


def measure(llm, batch: int, k: int, input_len: int, output_len: int, seed: int) -> dict:
    vocab = llm.engine.model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, input_len).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)        # compiles this batch's buckets
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tpot = float(np.mean([o.metrics["tpot"] for o in outs]))
    ttft = float(np.mean([o.metrics["ttft"] for o in outs]))
    buffers, bucket_for, replay = handles(llm.engine)
    T = bucket_for(batch * (1 + k))
    out = replay(T)
    jax.block_until_ready(out["tokens"])
    t0 = time.perf_counter()
    for _ in range(10):               # issued back to back: the host's cost to issue one step
        out = replay(T)
    issue = (time.perf_counter() - t0) / 10
    jax.block_until_ready(out["tokens"])
    t0 = time.perf_counter()
    for _ in range(20):
        out = replay(T)
    jax.block_until_ready(out["tokens"])
    device = (time.perf_counter() - t0) / 20
    tokens = np.array([o.token_ids for o in outs])   # how alike the requests decode (as vllm_batches.py reports)
    return {"batch": batch, "k": k, "tpot_ms": 1e3 * tpot, "ttft_ms": 1e3 * ttft, "output_tok_s": batch * output_len / wall,
            "argument_buffers": buffers, "host_issue_ms": 1e3 * issue, "device_step_ms": 1e3 * device,
            "distinct_rows": len({tuple(t) for t in tokens.tolist()}), "distinct_tokens": len(np.unique(tokens))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--draft-batches", type=int, nargs="*", default=[1])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--warmup", default="none", help="LLM's warmup: none (each program tuned when first used), fast "
                                                    "(every program without autotuning: the fast tier's TPOT)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a preset's shapes, random bf16 weights")
    p.add_argument("--weights", help="an HF directory whose weights to load instead (e.g. random_hf_checkpoint.py's, "
                                     "which vLLM loads too)")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--eagle3-batches", type=int, nargs="*", default=[],
                   help="also these batches with a random EAGLE-3 head (k = 4, the target's head width, 32000-token "
                        "draft vocabulary): the speculative step's cost (random drafts are rejected, so its TPOT is not "
                        "a speculative speed-up)")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="LLM's quantization")
    p.add_argument("--json")
    a = p.parse_args()
    if a.weights:
        from jaxspec.models import load_model
        target = load_model(a.weights, dtype="bfloat16")
    else:
        target = random_model(a.model, dtype="bfloat16")
    common = dict(max_num_seqs=max(a.batches), max_model_len=a.input_len + a.output_len + 64,
                  max_num_batched_tokens=256, warmup=a.warmup, quantization=a.quantization)
    rows = []
    llm = LLM(target, **common)
    rows += [measure(llm, b, 0, a.input_len, a.output_len, b) for b in a.batches]
    del llm
    if a.draft_batches:
        draft = random_model(a.draft_model, dtype="bfloat16", seed=1)
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
        llm = LLM(target, **common, speculative_config=spec)
        rows += [measure(llm, b, 4, a.input_len, a.output_len, b) for b in a.draft_batches]
        del llm
    if a.eagle3_batches:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
        from eagle_heads import write_eagle3_head
        head = write_eagle3_head(tempfile.mkdtemp(prefix="eagle3-"), target.config, seed=0, draft_vocab_size=32000,
                                 head_dim=target.config.head_dim)
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}
        llm = LLM(target, **common, speculative_config=spec)
        rows += [dict(measure(llm, b, 4, a.input_len, a.output_len, b), drafter="eagle3") for b in a.eagle3_batches]
    print(f"{'batch':>5} {'k':>2} {'drafter':>8} {'TPOT ms':>8} {'tok/s':>8} {'buffers':>8} {'issue ms':>9} {'device ms':>10} "
          f"{'distinct rows / tokens':>23}")
    for r in rows:
        r.setdefault("drafter", "draft" if r["k"] else "-")
        print(f"{r['batch']:>5} {r['k']:>2} {r['drafter']:>8} {r['tpot_ms']:>8.3f} {r['output_tok_s']:>8.1f} {r['argument_buffers']:>8} "
              f"{r['host_issue_ms']:>9.3f} {r['device_step_ms']:>10.3f} {r['distinct_rows']:>11} / {r['distinct_tokens']:<9}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
