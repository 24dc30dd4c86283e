"""Does issuing a jitted function block while the previous call runs? A synthetic stand-in for the step: 28
[8, 4096] x [4096, 4096] bf16 matmuls over a state (0.42 ms of device work), the state donated or kept, with
every other matmul a Pallas kernel (jaxspec.pallas.gemv) or none. `long`: the 28 matmuls 4 times over (a ~1.7
ms step, like the engine's); `pool`: a KV-like pool [28, 16384, 2, 128] in the state that each layer writes 8
rows of (slots from an int32 input) and reads back; `copy`: the output copied to host after each call;
`temp`: an lm-head-like [8, 151936] f32 product inside (a large temporary) with only its argmax returned;
`out`: that product returned as the output.

    python3 scripts/probes/issue_synthetic.py donate [pallas] [long] [pool] [copy]     # or keep
"""
import sys, time, functools, numpy as np, jax, jax.numpy as jnp
donate = sys.argv[1] == "donate"
flags = set(sys.argv[2:])
pallas, pool, copy = "pallas" in flags, "pool" in flags, "copy" in flags
temp, big_out = "temp" in flags, "out" in flags
repeat = 4 if "long" in flags else 1
from jaxspec.pallas.gemv import gemv, Tiling
L = 28
w = jax.random.normal(jax.random.PRNGKey(0), (L, 4096, 4096), jnp.bfloat16)
head = jax.random.normal(jax.random.PRNGKey(1), (151936, 4096), jnp.bfloat16)

def body(w, head, state, x, slots):
    h = state["h"] + x[0]
    new = dict(state)
    for i in range(L * repeat):
        li = i % L
        h = jnp.tanh(gemv(h, w, li, tiling=Tiling(32, 128, 1, 4, 4)) if pallas and i % 2 else h @ w[li])
        if pool and i < L:
            new["k"] = new["k"].at[li, slots].set(h[:, :256].reshape(8, 2, 128))
            h = h + new["k"][li, slots].reshape(8, 256).sum(-1, keepdims=True)
    new["h"], new["c"] = h, state["c"] + 1
    if temp or big_out:
        logits = jnp.dot(h, head.T, preferred_element_type=jnp.float32)     # [8, 151936]
        return new, (logits if big_out else jnp.argmax(logits, -1))
    return new, h[0, :4]

f = jax.jit(body, donate_argnums=(2,) if donate else ())


def call(*args):
    new, out = f(*args)
    if copy:
        out.copy_to_host_async()
    return new, out

state = {"h": jnp.ones((8, 4096), jnp.bfloat16), "c": jnp.zeros((), jnp.int32)}
if pool:
    state["k"] = jnp.zeros((L, 16384, 2, 128), jnp.bfloat16)
x = jnp.zeros((1,), jnp.bfloat16)
slots = jnp.arange(8, dtype=jnp.int32) * 7
for _ in range(5):
    state, out = call(w, head, state, x, slots)
jax.block_until_ready(out)
t0 = time.perf_counter()
for _ in range(20):
    state, out = call(w, head, state, x, slots)
jax.block_until_ready(out)
dev = (time.perf_counter() - t0) / 20
idle, busy = [], []
for _ in range(30):
    jax.block_until_ready(out)
    t0 = time.perf_counter(); state, out = call(w, head, state, x, slots); idle.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); state, out = call(w, head, state, x, slots); busy.append(time.perf_counter() - t0)
print(f"donate={donate} {' '.join(sorted(flags))}: device step {1e3*dev:.3f} ms; call with device idle {1e3*np.median(idle):.3f} ms; "
      f"call issued while the previous runs {1e3*np.median(busy):.3f} ms", flush=True)
