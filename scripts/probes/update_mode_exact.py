"""Greedy outputs of the engine on random bf16 weights, as one digest (GPU): run once with XLA's default
command-buffer update mode and once with JAXSPEC_COMMAND_BUFFER_UPDATE_MODE=SKIP_PROFILED; the digests must
match (the mode changes where buffers live, never what is computed).

    python3 scripts/probes/update_mode_exact.py
    JAXSPEC_COMMAND_BUFFER_UPDATE_MODE=SKIP_PROFILED python3 scripts/probes/update_mode_exact.py
"""
import hashlib
import os
import sys

import numpy as np

from jaxspec import LLM, SamplingParams
from jaxspec.models.random import random_model

model = random_model(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
llm = LLM(model, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=256, warmup=False)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(20, 120, 8)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
ids = [o.outputs[0].token_ids for o in outs]
print("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""), "| tokens", sum(map(len, ids)), "| digest",
      hashlib.sha256(repr(ids).encode()).hexdigest()[:16], flush=True)
