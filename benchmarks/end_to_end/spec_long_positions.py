"""Speculation past 32,768 positions (CPU or GPU): a small random Llama of `--max-len` positions decodes a short and a
long prompt greedily, plainly and under each method (n-gram; a draft model that is the target with its weights moved
by 1% of their scale, so that it agrees often; an EAGLE-3 head, random: it is rejected, which checks the verify path
at those positions); for each method and prompt length, whether the tokens equal plain decoding's and the acceptance
rate, so a collapse of acceptance past 32k positions would show as a drop from the short prompt to the long one.

    python3 benchmarks/end_to_end/spec_long_positions.py --lengths 1000 33000 --json out.json
"""
import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 33000])
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--methods", nargs="+", default=["ngram", "draft_model", "eagle3"])
    p.add_argument("--json")
    args = p.parse_args()

    import jax
    import numpy as np

    from eagle_heads import write_eagle3_head
    from random_drafts import perturbed
    from jaxspec import LLM, SamplingParams
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.random import random_model
    max_len = max(args.lengths) + args.output_len + 8
    config = ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=max_len,
                         rope_theta=500000.0)
    # weights of O(1) gain, so that the logits are far from uniform and a moved draft agrees often
    model = random_model(config, dtype="float32", seed=0)
    model = dataclasses.replace(model, params=jax.tree_util.tree_map(
        lambda x: x * (8.0 if x.ndim > 1 else 1.0), model.params))
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, config.vocab_size, n).tolist() for n in args.lengths}
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine = dict(dtype="float32", max_num_seqs=1, max_model_len=max_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, warmup=False)
    head_dir = tempfile.mkdtemp()
    drafts = {"ngram": None, "draft_model": perturbed(model, 0.01, 9),
              "eagle3": str(write_eagle3_head(os.path.join(head_dir, "eagle3"), config, seed=3))}
    plain_llm = LLM(model, **engine)
    plain = {}
    for n, prompt in prompts.items():
        t0 = time.perf_counter()
        plain[n] = list(plain_llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
        print(f"plain {n:>6} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for method in args.methods:
        spec = {"method": method, "num_speculative_tokens": 3}
        if drafts[method] is not None:
            spec["model"] = drafts[method]
        for n, prompt in prompts.items():
            llm = LLM(model, **engine, speculative_config=spec)   # one per length: the stats are the length's own
            t0 = time.perf_counter()
            tokens = list(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
            s = llm.stats()["spec"]
            row = {"method": method, "prompt_tokens": n, "lossless": tokens == plain[n], "drafts": s["drafts"],
                   "draft_tokens": s["draft_tokens"], "accepted_tokens": s["accepted_tokens"],
                   "acceptance_rate": s["acceptance_rate"], "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(f"{method:>11} {n:>6} tokens: lossless {row['lossless']}, acceptance {row['acceptance_rate']:.3f} "
                  f"({row['accepted_tokens']}/{row['draft_tokens']}), {row['seconds']:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_model_len": max_len, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
