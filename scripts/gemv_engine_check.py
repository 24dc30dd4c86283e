"""On a GPU: an engine whose decode steps run the matmuls named by JAXSPEC_GEMV as gemv kernels against one on
XLA's layers (random bf16 weights of --model's shapes): greedy tokens agree (bf16 sums in another order may
flip a near-tie late in a sequence, so the first divergence is reported), and with a draft model speculating
async == sync exactly within the kernel engine (the verify step of 1-2 rows x 5 tokens takes the kernels).

    JAXSPEC_GEMV=down python3 scripts/gemv_engine_check.py --model qwen2.5-coder-1.5b-instruct
"""
import argparse
import os

from jaxspec import LLM, SamplingParams
from jaxspec.models.random import random_model
from jaxspec.spec import SpeculativeConfig


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--tokens", type=int, default=48)
    a = p.parse_args()
    spec_set = os.environ.get("JAXSPEC_GEMV", "")
    model = random_model(a.model, dtype="bfloat16")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 1000 + 10 for j in range(24 + 9 * i)]} for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    kw = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=128, warmup=False)
    runs = {}
    for name, env in (("xla", ""), ("gemv", spec_set)):
        os.environ["JAXSPEC_GEMV"] = env
        llm = LLM(model, **kw)
        print(f"{name}: gemv matmuls {sorted(llm.engine.runner.ops.gemv)}", flush=True)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (x, g) in enumerate(zip(runs["xla"], runs["gemv"])):
        same = next((j for j, (u, v) in enumerate(zip(x, g)) if u != v), len(x))
        print(f"prompt {i}: greedy tokens equal for the first {same} of {len(x)}", flush=True)
    os.environ["JAXSPEC_GEMV"] = spec_set
    draft = random_model(a.draft_model, dtype="bfloat16", seed=1)
    outs = []
    for async_scheduling in (True, False):
        llm = LLM(model, speculative_config=SpeculativeConfig("draft_model", draft, 4),
                  async_scheduling=async_scheduling, **kw)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    print(f"draft model, kernels on: async == sync: {outs[0] == outs[1]}", flush=True)
    for i, (x, s) in enumerate(zip(runs["gemv"], outs[0])):   # verify steps sum in other orders than decode steps
        same = next((j for j, (u, v) in enumerate(zip(x, s)) if u != v), len(x))
        print(f"prompt {i}: speculative greedy equals plain greedy for the first {same} of {len(x)}", flush=True)


if __name__ == "__main__":
    main()
