"""An engine whose decode steps run the matmuls JAXSPEC_GEMV names (default `down`) as GEMV kernels, against one on
XLA's matmuls, random bf16 weights of Qwen2.5-Coder-1.5B's shapes. With a 0.5B draft model at k = 4, async and sync
scheduling give the same tokens within the kernel engine (its verify steps of 1-2 rows x 5 tokens take the
kernels). The greedy tokens of the kernel engine and XLA's, and speculative against plain greedy, are printed
(`-s`), not asserted: bf16 sums in another order flip random weights' near-tied logits (on an H100 the two engines
agreed for 7 and 2 tokens of 48, docs/lab/2026-11-24-gemv-kernels.md); the kernels' exactness is float32's, in
tests/test_gemv.py."""
import os

import pytest

from jaxspec import LLM, SamplingParams
from jaxspec.models.random import random_model
from jaxspec.spec import SpeculativeConfig

pytestmark = pytest.mark.gpu

TOKENS = 48
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 1000 + 10 for j in range(24 + 9 * i)]} for i in range(2)]
ENGINE = dict(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=128, warmup=False)


def first_divergence(a: list, b: list) -> int:
    return next((j for j, (u, v) in enumerate(zip(a, b)) if u != v), len(a))


def test_gemv_engine(monkeypatch):
    kernels = os.environ.get("JAXSPEC_GEMV", "down") or "down"
    model = random_model("qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    runs = {}
    for name, env in (("xla", ""), ("gemv", kernels)):
        monkeypatch.setenv("JAXSPEC_GEMV", env)
        llm = LLM(model, **ENGINE)
        assert bool(llm.engine.runner.ops.gemv) == (name == "gemv"), sorted(llm.engine.runner.ops.gemv)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
    for i, (x, g) in enumerate(zip(runs["xla"], runs["gemv"])):
        print(f"prompt {i}: greedy tokens of XLA's and the kernels' engines equal for the first "
              f"{first_divergence(x, g)} of {len(x)}")
    monkeypatch.setenv("JAXSPEC_GEMV", kernels)
    draft = random_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16", seed=1)
    outs = []
    for async_scheduling in (True, False):
        llm = LLM(model, speculative_config=SpeculativeConfig("draft_model", draft, 4),
                  async_scheduling=async_scheduling, **ENGINE)
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        del llm
    assert outs[0] == outs[1], "a draft model with the kernels on: async and sync scheduling differ"
    for i, (x, s) in enumerate(zip(runs["gemv"], outs[0])):   # verify steps sum in other orders than decode steps
        print(f"prompt {i}: speculative greedy equals plain greedy for the first {first_divergence(x, s)} of {len(x)}")
