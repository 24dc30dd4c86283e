"""The attention kernel's device time per decode step against the prompt length (GPU): one engine (random bf16
weights, batch 1), a traced generate of 32 greedy tokens per prompt length, the kernel's time per step from the
trace, and the request's KV block ids (where its pages sit in the pool).

    python3 scripts/probes/attention_context.py [model] [prompt_len ...]
"""
import glob
import statistics
import sys

import jax
import numpy as np
from jax.profiler import ProfileData

from jaxspec import LLM, SamplingParams
from jaxspec.models.random import random_model

name = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else "qwen2.5-coder-1.5b-instruct"
lengths = [int(n) for n in sys.argv[2:]] or [128, 192, 256, 64]
llm = LLM(random_model(name, dtype="bfloat16"), max_num_seqs=1, max_model_len=1024)
engine = llm.engine
print("KV pool", engine.runner.state.layers["attention"]["k"].shape, "blocks", engine.blocks.num_blocks, flush=True)
rng = np.random.default_rng(0)
for n in lengths:
    prompt = rng.integers(0, 1000, n).tolist()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    trace = f"/tmp/attn-ctx-{n}"
    blocks = []
    orig = engine._dispatch

    def spy(rows, timings=None):
        blocks.append(list(rows[0].request.block_ids))
        return orig(rows, timings)
    engine._dispatch = spy
    with jax.profiler.trace(trace):
        llm.generate([rng.integers(0, 1000, n).tolist()], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                     use_tqdm=False)
    engine._dispatch = orig
    path = sorted(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True))[-1]
    durs = [ev.duration_ns for plane in ProfileData.from_file(path).planes if "GPU" in plane.name
            for line in plane.lines for ev in line.events if ev.name.startswith("paged_attention")]
    per_step = [sum(durs[i:i + 28]) / 1e3 for i in range(28, len(durs) - 27, 28)]   # decode steps (the first: prefill)
    print(f"prompt {n}: attention per decode step median {statistics.median(per_step):.1f} us (min "
          f"{min(per_step):.1f}, max {max(per_step):.1f}, {len(per_step)} steps); block ids {blocks[-1][:4]}..."
          f"{blocks[-1][-2:]}", flush=True)
