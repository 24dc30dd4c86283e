"""Adaptive k's step prices against live steps, one engine: each (k, bucket)'s time from blank steps (Engine.time_steps,
as the engine prices them: 2 untimed + 8 timed runs, and again with the GPU kept busy first and 32 runs, best of two
rounds), against live steps of the same k at batch 8 and 32: the loop's period over 60 decode steps with k forced,
and the device time of one of those steps replayed back to back (runner.replay).

    python3 benchmarks/profiles/probe_step_prices.py --model GGUF --head DIR --prompts humaneval.json
"""
import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import jax

    from jaxspec import LLM, SamplingParams
    from jaxspec.models.loader import load_model
    model = load_model(args.model)
    K = args.k
    budget = args.max_num_batched_tokens
    llm = LLM(model, max_num_seqs=max(args.batches), max_model_len=2048, max_num_batched_tokens=budget, warmup=False,
              enable_prefix_caching=False,
              speculative_config={"method": "eagle3", "model": args.head, "num_speculative_tokens": K, "adaptive": True})
    engine = llm.engine
    runner, chooser = engine.runner, engine.k_chooser
    engine.warmup(sample=False)
    report = {"blank": {f"{k},{T}": s for (k, T), s in chooser.calibrated.items()}}
    base = engine._serving_variants[0]
    variant = lambda k: dataclasses.replace(base, drafts=None if k == K else k)   # noqa: E731
    pairs = sorted(chooser.calibrated, key=lambda kT: (kT[1], kT[0]))
    for _ in range(30):   # the GPU busy for a while first
        runner.time_step(runner.token_buckets[-1], variant(K), runs=4)
    best = {}
    for _ in range(2):
        for k, T in pairs:
            s = runner.time_step(T, variant(k), runs=32)
            best[(k, T)] = min(s, best.get((k, T), s))
    report["blank_busy"] = {f"{k},{T}": s for (k, T), s in best.items()}
    with open(args.prompts) as f:
        prompts = [list(turns[0][0]) for turns in json.load(f)["sessions"]]
    live = {}
    for batch in args.batches:
        for k in range(K + 1):
            chooser.choose = lambda step, rows, prefill_tokens=0, k=k: k
            reqs = [engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=600, ignore_eos=True))
                    for i in range(batch)]
            for _ in range(30):   # every prompt prefilled, the rows decoding at width k
                engine.step()
            t0, n = time.perf_counter(), 60
            for _ in range(n):
                engine.step()
            period = (time.perf_counter() - t0) / n
            T = runner.bucket_for(batch * (1 + k))
            engine.flush()
            out = runner.replay(T)
            jax.block_until_ready(out)
            t0 = time.perf_counter()
            for _ in range(32):
                out = runner.replay(T)
            jax.block_until_ready(out)
            replay = (time.perf_counter() - t0) / 32
            tokens = sum(len(r.output_token_ids) for r in reqs)
            for r in reqs:
                engine.abort(r.request_id)
            while engine.has_unfinished():
                engine.step()
            live[f"{batch},{k}"] = {"bucket": T, "period_s": period, "replay_s": replay, "tokens": tokens,
                                    "blank_s": chooser.calibrated[(k, T)], "blank_busy_s": best[(k, T)]}
            print(f"batch {batch} k {k} bucket {T}: loop period {1e3 * period:.3f} ms, replayed {1e3 * replay:.3f} ms,"
                  f" blank {1e3 * chooser.calibrated[(k, T)]:.3f} ms, blank busy {1e3 * best[(k, T)]:.3f} ms",
                  flush=True)
    report["live"] = live
    for T in sorted({T for _, T in pairs}):
        print(T, "blank", " ".join(f"{1e3 * chooser.calibrated[(k, T)]:.3f}" for k in range(K + 1)),
              "| busy", " ".join(f"{1e3 * best[(k, T)]:.3f}" for k in range(K + 1)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
