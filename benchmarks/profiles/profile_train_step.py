"""Where an EAGLE-3 training step's time goes, by kernel: the target's forward alone and the whole step (target
forward, the head's unrolled steps forward and backward, the optimizer), each timed over a few steps and then traced,
with the target's rows one after another (the trainer's form) and side by side (one batched forward),
on one batch of packed rows of a --save-regenerated dataset (issue #37: the step at ~35% MFU on an H100).

    python3 benchmarks/profiles/profile_train_step.py --model /tmp/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \\
        --dataset-path /tmp/gpu/regen.json --batch-size 8 --trace-dir /tmp/trace

Prints each program's time per step, its MFU (the trainer's FLOP count), and its kernels by total time (with
--trace-dir). The draft vocabulary is the first --draft-vocab-size ids (the trainer picks the most predicted ones:
the same shapes, a cheaper start).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))


def timed(fn, args, steps: int) -> float:
    import jax
    jax.block_until_ready(fn(*args))   # compiled here
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset-path", required=True)
    p.add_argument("--num-examples", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--arch", default="chain", choices=["chain", "parallel"])
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.models.weights import resolve_dtype
    from jaxspec.models.loader import load_model
    from jaxspec.nn.eagle import EagleHead
    from jaxspec.train import TrainConfig, load_sharegpt, render
    from jaxspec.train.eagle3 import (head_config, head_optimizer, init_head, make_target_fn, make_train_step,
                                      peak_flops, training_flops)
    from profile_step import kernel_breakdown

    target = load_model(args.model, resolve_dtype("auto"))
    tc = target.config
    examples = render(target.tokenizer, load_sharegpt(args.num_examples, args.dataset_path), args.seq_len).pack()
    B = args.batch_size
    ids, mask, segments = (jnp.asarray(x[:B]) for x in (examples.ids, examples.mask, examples.segments))
    config = TrainConfig(batch_size=B, ttt_steps=args.ttt_steps, arch=args.arch, draft_vocab_size=args.draft_vocab_size)
    d2t = np.arange(min(args.draft_vocab_size, tc.vocab_size), dtype=np.int32)
    head = EagleHead("eagle3", head_config(tc), tc, draft_vocab_size=len(d2t), parallel=args.arch == "parallel")
    params = init_head(head, target.params, d2t, 0)
    opt_state = head_optimizer(config, 0.0).init(params)
    lr = np.float32(1e-4)

    target_flops, head_flops = training_flops(target.params, params, B * args.seq_len, args.ttt_steps)
    flops, programs = {}, {}
    # the target's rows one after another (the trainer's form) and side by side (make_target_fn's other form)
    for form, side_by_side in (("rows one by one", False), ("rows side by side", True)):
        if side_by_side and tc.moe:
            continue
        target_fn = make_target_fn(tc, head.aux_layers, rows_side_by_side=side_by_side)
        train_step = make_train_step(head, target_fn, d2t, config)
        flops[f"target forward, {form}"] = target_flops
        programs[f"target forward, {form}"] = (target_fn, (target.params, ids, jnp.asarray(d2t), segments))
        flops[f"training step, {form}"] = target_flops + head_flops
        programs[f"training step, {form}"] = (train_step, (params, opt_state, target.params, ids, mask, lr, None,
                                                           segments))
    peak = peak_flops()
    print(f"{jax.devices()[0].device_kind}: batch {B} x {args.seq_len} packed rows "
          f"({float(examples.row_lengths()[:B].mean()) / args.seq_len:.0%} used), {args.arch} head, "
          f"{args.ttt_steps} unrolled steps", flush=True)
    for name, (fn, fn_args) in programs.items():
        seconds = timed(fn, fn_args, args.steps)
        mfu = f", MFU {100 * flops[name] / seconds / peak:.1f}%" if peak else ""
        print(f"{name}: {seconds * 1e3:.1f} ms{mfu}", flush=True)
        if args.trace_dir:
            trace_dir = os.path.join(args.trace_dir, name.replace(" ", "_").replace(",", ""))
            with jax.profiler.trace(trace_dir):
                for _ in range(3):
                    out = fn(*fn_args)
                jax.block_until_ready(out)
            kernel_breakdown(trace_dir, 3, args.top)


if __name__ == "__main__":
    main()
