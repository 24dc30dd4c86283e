"""The engine's host phases per step (schedule, build, issue, process, publish; ms) at one batch size, with a real
checkpoint's tokenizer rendering every request's text every step (a stop string makes the engine detokenize
incrementally, as streaming does), on any backend: the host's share of the loop without a GPU.

    python3 benchmarks/profiles/host_phases.py [MODEL] [BATCH] [TOKENS] [TOKENIZER_DIR]   # smollm2-135m-instruct 32 64

With TOKENIZER_DIR (a Hugging Face tokenizer folder), MODEL is a preset whose shapes get random bf16 weights and
that tokenizer: the real tokenizer on a GPU without staging the checkpoint.
"""
import collections
import functools
import sys

from jaxspec import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 32
n = int(sys.argv[3]) if len(sys.argv) > 3 else 64
if len(sys.argv) > 4:
    from transformers import AutoTokenizer

    from jaxspec.models.random import random_model
    from jaxspec.models.tokenizer import Tokenizer
    tokenizer = Tokenizer(AutoTokenizer.from_pretrained(sys.argv[4]))
    model = random_model(model, dtype="bfloat16")
    model.tokenizer = tokenizer
llm = LLM(model, max_num_seqs=B, max_model_len=1024, warmup=False)
engine = llm.engine
prompts = [f"Write a short story, number {i}, about a robot who learns to paint." for i in range(B)]
variants = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=stop)
            for stop in (None, ["<no such text>"])]
for sp in variants * 2:
    llm.generate(prompts, sp, use_tqdm=False)          # compiles what the timed runs meet
for sp in variants:
    stop = sp.stop
    acc = collections.Counter()
    orig, engine.step = engine.step, functools.partial(engine.step, timings=acc)
    steps0 = engine.counters["steps"]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    engine.step = orig
    steps = engine.counters["steps"] - steps0
    per = {k: 1e3 * v / steps for k, v in acc.items() if k not in ("dispatch", "wait")}
    loop = per["schedule"] + per["build"] + per["process"]
    print(f"batch {B}, text rendered {'every step' if stop else 'at the end'}: {steps} steps; host ms per step: "
          + ", ".join(f"{k} {v:.3f}" for k, v in per.items())
          + f"; schedule + build + process {loop:.3f}; + issue + publish {loop + per['issue'] + per['publish']:.3f}"
          + f"; {sum(len(o.outputs[0].text) for o in outs)} characters", flush=True)
