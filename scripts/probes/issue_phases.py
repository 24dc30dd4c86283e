"""Where the engine loop's 'issue' phase goes (GPU): ModelRunner.run timed piece by piece (packing the inputs,
device_put, the step call, copy_to_host_async) over 60 steps of the async, sync and again async loop, with the
loop's own phases. Random bf16 weights of Qwen2.5-Coder-1.5B's shapes (or argv[2]), argv[1] requests decoding.

    python3 scripts/probes/issue_phases.py 1      # then 32
"""
import collections, time, sys
import jax, numpy as np
from jaxspec import SamplingParams
from jaxspec.models.random import random_model
from jaxspec.sched.engine import Engine, EngineConfig
import jaxspec.decode.runner as R

acc = collections.Counter()
def run(self, inputs, variant, grammar_table=None):
    t0 = time.perf_counter()
    T = inputs.token_matrix.shape[1]
    packed = inputs.pack()
    t1 = time.perf_counter()
    buf = jax.device_put(packed, self.input_sharding, may_alias=False)
    t2 = time.perf_counter()
    self.step_fn(T, variant)
    t3 = time.perf_counter()
    out = self._issue(T, variant, buf, grammar_table)   # load into the inbox, the step, the outputs' copy
    t4 = time.perf_counter()
    for a in out.values():
        a.copy_to_host_async()
    t5 = time.perf_counter()
    self.last_inputs[T] = (variant, buf); self._last_grammar[T] = grammar_table
    for k, v in (("pack", t1 - t0), ("device_put", t2 - t1), ("step_fn", t3 - t2), ("call", t4 - t3), ("copy_async", t5 - t4)):
        acc[k] += v
    acc["n"] += 1
    acc["outputs"] = len(out)
    return out
R.ModelRunner.run = run

model = random_model(sys.argv[2] if len(sys.argv) > 2 else "qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
engine = Engine(model, EngineConfig(max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=256, warmup=False))
rng = np.random.default_rng(0)
for b in (B, B):
    reqs = [engine.add_request(rng.integers(0, 1000, 192).tolist(), SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)) for _ in range(b)]
    while any(r.status.value == "waiting" or r.prefilling for r in reqs):
        engine.step()
    for mode in (True, False, True):
        engine.config.async_scheduling = mode
        for _ in range(10): engine.step()
        acc.clear(); ph = collections.Counter()
        t0 = time.perf_counter()
        for _ in range(60): engine.step(timings=ph)
        wall = (time.perf_counter() - t0) / 60
        engine.flush()
        n = acc.pop("n"); outs = acc.pop("outputs")
        print(f"b{b} {'async' if mode else 'sync '} {1e3*wall:.3f} ms/step | run(): " + ", ".join(f"{k} {1e3*v/n:.3f}" for k, v in acc.items()) + f" ({outs} outputs) | phases: " + ", ".join(f"{k} {1e3*v/60:.3f}" for k, v in ph.items() if k != "dispatch"), flush=True)
    for r in reqs: engine.abort(r.request_id)
    while engine.has_unfinished(): engine.step()
