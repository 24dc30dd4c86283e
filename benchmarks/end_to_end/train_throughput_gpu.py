"""The EAGLE-3 trainer's throughput in several configurations from one target load (issue #37's before and after):
each configuration trains a fresh head for --steps steps on the same examples and reports what `jaxspec-train-eagle`
prints at its end (step time, target and sequence tokens/s, padding, each phase's time and MFU).

    python3 benchmarks/end_to_end/train_throughput_gpu.py --model /tmp/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \\
        --dataset-path /tmp/gpu/regen.json --num-examples 2000 --steps 60 \\
        --run nopack-b8 --run pack-b8 --run pack-b16 --json /tmp/out/train_throughput.json

A run is `[no]pack-bN[-parallel]`: one example per row (the trainer before packing) or packed rows, N rows a step,
the chain head or the parallel drafter. The examples are rendered once (seq len --seq-len) and shared.
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

RUN = re.compile(r"(no)?pack-b(\d+)(-parallel)?$")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset-path", required=True, help="a ShareGPT-format JSON file (a --save-regenerated one)")
    p.add_argument("--num-examples", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--run", action="append", required=True, help="[no]pack-bN[-parallel]")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    for run in args.run:
        if not RUN.match(run):
            raise SystemExit(f"--run {run!r}: expected [no]pack-bN[-parallel], e.g. nopack-b8 or pack-b16-parallel")

    from jaxspec.models.weights import resolve_dtype
    from jaxspec.models.loader import load_model
    from jaxspec.train import TrainConfig, load_sharegpt, render, train

    t0 = time.perf_counter()
    target = load_model(args.model, resolve_dtype("auto"))
    examples = render(target.tokenizer, load_sharegpt(args.num_examples, args.dataset_path), args.seq_len)
    print(f"target and {len(examples)} examples ({examples.num_target_tokens} target tokens) ready in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    results = []
    for run in args.run:
        no_pack, batch, parallel = RUN.match(run).groups()
        config = TrainConfig(steps=args.steps, batch_size=int(batch), pack=not no_pack, ttt_steps=args.ttt_steps,
                             arch="parallel" if parallel else "chain", warmup_steps=10, save_every=args.steps)
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            result = train(target, examples, out, config, progress=True)
        results.append({"run": run, "seconds": time.perf_counter() - t0, "num_examples": len(examples),
                        "final_loss": result.losses[-1], "throughput": result.throughput})
        print(json.dumps(results[-1]), flush=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    base = results[0]["throughput"]["target_tokens_per_s"]
    for r in results:
        t = r["throughput"]
        print(f"{r['run']:<22} {t['step_ms']:8.1f} ms/step {t['target_tokens_per_s']:9.0f} target tok/s "
              f"({t['target_tokens_per_s'] / base:.2f}x {results[0]['run']})  padding {t['padding_fraction']:.2f}  "
              f"MFU step {t['mfu']['step']}")


if __name__ == "__main__":
    main()
