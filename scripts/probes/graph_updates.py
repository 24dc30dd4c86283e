"""Does the step's CUDA graph still get re-recorded, and does the step call still block the host behind a running
step (GPU)? One request decoding on random bf16 weights of Qwen2.5-Coder-1.5B's shapes; each case issues a step
right behind a running one and times the host call (median of 60):

  boxes    the engine's path: inputs copied into the bucket's inbox, outputs written into the outbox (every
           address the step sees is the same on every call), then a fresh copy of the outputs
  moving   the step called with a fresh input buffer as its inbox and a fresh outbox every call (the addresses
           move as they did before the boxes)

Each case prints a marker line to stderr; with XLA's command-buffer log on, the updates between two markers are
the re-recordings of that case:

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 python3 scripts/probes/graph_updates.py 2> log
    awk '/^CASE/{c=$2} /Update command buffer/{n[c]++} END{for (k in n) print k, n[k]}' log
"""
import sys
import time

import jax
import numpy as np

from jaxspec import SamplingParams
from jaxspec.models.random import random_model
from jaxspec.sched.engine import Engine, EngineConfig

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
model = random_model(sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else "qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
N = int(sys.argv[3]) if len(sys.argv) > 3 else 60
engine = Engine(model, EngineConfig(max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=256, warmup=False))
r = engine.runner
print("command-buffer update mode:", r.ops.command_buffer_update_mode, flush=True)
rng = np.random.default_rng(0)
reqs = [engine.add_request(rng.integers(0, 1000, 192).tolist(),
                           SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)) for _ in range(batch)]
while any(q.prefilling or q.status.value == "waiting" for q in reqs):
    engine.step()
for _ in range(5):
    engine.step()
engine.flush()
T = r.bucket_for(batch)
variant, buf = r.last_inputs[T]
packed = np.asarray(buf)
fn = r.step_fn(T, variant)


def boxes():
    return r._issue(T, variant, jax.device_put(packed.copy(), None, may_alias=False), None)["tokens"]


def moving():
    inbox = jax.device_put(packed.copy(), None, may_alias=False)
    r.state, out = fn(r.params, r.drafter_params, r.state, inbox, r.new_outbox(T, variant))
    return out["tokens"]


def behind(label, call, n=N):
    print(f"CASE {label}", file=sys.stderr, flush=True)
    ts = []
    for _ in range(n):
        step_only()                         # the step the next call is issued behind
        t0 = time.perf_counter()
        second = call()
        ts.append(time.perf_counter() - t0)
        jax.block_until_ready((r.state.num_tokens, second))
    ts = np.array(ts[n // 10:]) * 1e3
    print(f"batch {batch} {label:8s} call issued behind a running step: median {np.median(ts):.3f} ms, "
          f"p10 {np.percentile(ts, 10):.3f}, p90 {np.percentile(ts, 90):.3f}", flush=True)


from jaxspec.decode.step import make_step  # noqa: E402

# the pieces of `boxes`, each issued behind a running step: the transfer, the load, the step alone, the copy
inbox, outbox = r._inboxes[T], r._outboxes[(T, variant)]


def step_only():
    r.state, r._outboxes[(T, variant)] = fn(r.params, r.drafter_params, r.state, r._inboxes[T],
                                            r._outboxes[(T, variant)])


# a second executable of the same step, issued behind the first: if launching a CUDA graph while its own
# previous launch runs makes the host wait, a second graph does not
fn2 = make_step(r.target, r.drafter, r.step_config, T, r.rows_for(T), variant, None, r.ops.compiler_options(T))


def step_other():
    r.state, r._outboxes[(T, variant)] = fn2(r.params, r.drafter_params, r.state, r._inboxes[T],
                                             r._outboxes[(T, variant)])


step_other()   # compiled before the clock
jax.block_until_ready(r.state.num_tokens)
cases = [("boxes", boxes), ("moving", moving), ("boxes", boxes), ("step", step_only),
         ("other", step_other), ("step", step_only),
         ("put", lambda: jax.device_put(packed.copy(), None, may_alias=False)),
         ("copy", lambda: r._copy_outputs(r._outboxes[(T, variant)])["tokens"])]
if len(sys.argv) > 4:
    cases = [c for c in cases if c[0] in sys.argv[4].split(",")]
for label, call in cases:
    behind(label, call)
# the device time of one step, back to back (the call above should stay well under it)
jax.block_until_ready(boxes())
t0 = time.perf_counter()
for _ in range(50):
    out = boxes()
jax.block_until_ready(out)
print(f"batch {batch} back-to-back steps: {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms per step", flush=True)
print("CASE end", file=sys.stderr, flush=True)
for q in reqs:
    engine.abort(q.request_id)
