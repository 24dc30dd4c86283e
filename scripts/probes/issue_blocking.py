"""Does the engine's step call block the host while the previous step runs (GPU)? Times one request's decode
step issued with the device idle against one issued right behind another, and device_put of the step's packed
input buffer idle and busy. argv[1]: num_kv_blocks (default: the engine's; "" for it), argv[2]: the attention
("pallas", the GPU default, or "reference"); argv[3] "trace": the host's longest trace events (PJRT's and
XLA's TraceMe scopes) during back-to-back calls, to name what the blocked call waits in.

    python3 scripts/probes/issue_blocking.py
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/probes/issue_blocking.py
"""
import time, numpy as np, jax
from jaxspec import SamplingParams
from jaxspec.models.random import random_model
from jaxspec.sched.engine import Engine, EngineConfig

model = random_model("qwen2.5-coder-1.5b-instruct", dtype="bfloat16")
import sys
nkv = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] else None
attention = sys.argv[2] if len(sys.argv) > 2 else "auto"
engine = Engine(model, EngineConfig(max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=256, warmup=False, num_kv_blocks=nkv,
                                    attention=attention))
print("num_kv_blocks", engine.step_config.num_blocks, "attention", attention, flush=True)
r = engine.runner
rng = np.random.default_rng(0)
req = engine.add_request(rng.integers(0, 1000, 192).tolist(), SamplingParams(temperature=0, max_tokens=600, ignore_eos=True))
while req.prefilling or req.status.value == "waiting":
    engine.step()
for _ in range(5): engine.step()
engine.flush()
T = r.bucket_for(1)
variant, buf = r.last_inputs[T]
packed = np.asarray(buf)
print("packed buffer", packed.shape, packed.dtype, packed.nbytes, "bytes", flush=True)

def tm(label, f, n=200, busy=False):
    ts = []
    for _ in range(n):
        if busy:
            out = r.replay(T)
        t0 = time.perf_counter(); x = f(); ts.append(time.perf_counter() - t0)
        if busy:
            jax.block_until_ready(out["tokens"])
        jax.block_until_ready(x)
    ts = np.array(ts[10:]) * 1e3
    print(f"{label:55s} median {np.median(ts):.3f} ms  p90 {np.percentile(ts, 90):.3f}", flush=True)

dev = jax.devices()[0]
for busy in (False, True):
    s = "busy" if busy else "idle"
    tm(f"device_put(np, None, may_alias=False) [{s}]", lambda: jax.device_put(packed.copy(), None, may_alias=False), busy=busy)
    tm(f"device_put(np, dev) [{s}]", lambda: jax.device_put(packed.copy(), dev), busy=busy)
    tm(f"jnp.asarray(np) [{s}]", lambda: jax.numpy.asarray(packed.copy()), busy=busy)
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    try:
        tm(f"device_put to pinned_host [{s}]", lambda: jax.device_put(packed.copy(), pinned), busy=busy)
    except Exception as e:
        print("pinned_host:", type(e).__name__, str(e)[:150])
# the step call itself, device idle vs busy, with the same device buffer
def call():
    return r._issue(T, variant, buf, None)["tokens"]   # inbox load, step, outputs' copy
tm("step call, same input buffer [idle]", call, n=60)
def call_busy():
    call()
    t0 = time.perf_counter()
    out2 = call()
    return time.perf_counter() - t0, out2
ts = []
for _ in range(60):
    dt, o = call_busy(); ts.append(dt); jax.block_until_ready(o)
print(f"step call issued while the previous step runs            median {1e3*np.median(ts[5:]):.3f} ms", flush=True)
def call_np():
    return r._issue(T, variant, packed, None)["tokens"]
tm("step call, numpy input (transfer inside the call) [idle]", call_np, n=60)
if len(sys.argv) > 3 and sys.argv[3] == "trace":
    import glob, tempfile, collections
    from jax.profiler import ProfileData
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(8):
                call_busy()
            jax.block_until_ready(r.state)
        data = ProfileData.from_file(sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1])
        total, count = collections.Counter(), collections.Counter()
        for plane in data.planes:
            if "host" not in plane.name.lower():
                continue
            for line in plane.lines:
                for ev in line.events:
                    if ev.duration_ns > 50_000:
                        total[(line.name[:30], ev.name[:90])] += ev.duration_ns
                        count[(line.name[:30], ev.name[:90])] += 1
        for (ln, name), ns in total.most_common(30):
            print(f"  host {ns / 8e6:8.3f} ms per pair  x{count[(ln, name)] / 8:.1f}  [{ln}] {name}", flush=True)
engine.abort(req.request_id)
