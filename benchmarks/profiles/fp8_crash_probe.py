"""Which FP8 path faults on Llama shapes: one short greedy generation per process and setting."""
import os
import subprocess
import sys

CHILD = """
import sys
from jaxspec import LLM, SamplingParams
from jaxspec.models.random import random_model
m = random_model(sys.argv[1], dtype="bfloat16")
llm = LLM(m, quantization="fp8", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=128, warmup="none")
print(llm.generate([list(range(1, 40))], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                   use_tqdm=False)[0].token_ids, flush=True)
"""
CASES = {"default": ("llama-3.1-8b", {}), "xla": ("llama-3.1-8b", {"JAXSPEC_GEMV": ""}),
         "fused": ("llama-3.1-8b", {"JAXSPEC_FP8_GEMV": "fused"}), "1b": ("llama-3.2-1b", {}),
         "w8a16": ("llama-3.1-8b", {"JAXSPEC_FP8_W8A8_FROM": "never"}),
         "xla_w8a16": ("llama-3.1-8b", {"JAXSPEC_GEMV": "", "JAXSPEC_FP8_W8A8_FROM": "never"})}
for model, env in [CASES[c] for c in (sys.argv[1:] or CASES)]:
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, model], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=int(os.environ.get("PROBE_TIMEOUT", "60")))
    except subprocess.TimeoutExpired:
        print(model, env, "timed out", flush=True)
        continue
    tail = [ln for ln in (r.stdout + r.stderr).splitlines() if "Error" in ln or ln.startswith("[")][-2:]
    print(model, env, "rc", r.returncode, tail, flush=True)
