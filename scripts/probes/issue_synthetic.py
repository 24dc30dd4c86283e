"""Does issuing a jitted function block while the previous call runs? A synthetic stand-in for the step: 28
[8, 4096] x [4096, 4096] bf16 matmuls over a state (0.42 ms of device work), the state donated or kept, with
every other matmul a Pallas kernel (jaxspec.pallas.gemv) or none.

    python3 scripts/probes/issue_synthetic.py donate [pallas]     # or keep
"""
import sys, time, functools, numpy as np, jax, jax.numpy as jnp
donate = sys.argv[1] == "donate"
pallas = len(sys.argv) > 2 and sys.argv[2] == "pallas"
from jaxspec.pallas.gemv import gemv, Tiling
L = 28
w = jax.random.normal(jax.random.PRNGKey(0), (L, 4096, 4096), jnp.bfloat16)

def body(w, state, x):
    h = state["h"] + x[0]
    for i in range(L):
        h = jnp.tanh(gemv(h, w, i, tiling=Tiling(32, 128, 1, 4, 4)) if pallas and i % 2 else h @ w[i])
    return {"h": h, "c": state["c"] + 1}, h[0, :4]

f = jax.jit(body, donate_argnums=(1,) if donate else ())
state = {"h": jnp.ones((8, 4096), jnp.bfloat16), "c": jnp.zeros((), jnp.int32)}
x = jnp.zeros((1,), jnp.bfloat16)
for _ in range(5):
    state, out = f(w, state, x)
jax.block_until_ready(out)
t0 = time.perf_counter()
for _ in range(20):
    state, out = f(w, state, x)
jax.block_until_ready(out)
dev = (time.perf_counter() - t0) / 20
idle, busy = [], []
for _ in range(30):
    jax.block_until_ready(out)
    t0 = time.perf_counter(); state, out = f(w, state, x); idle.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); state, out = f(w, state, x); busy.append(time.perf_counter() - t0)
print(f"donate={donate} pallas={pallas}: device step {1e3*dev:.3f} ms; call with device idle {1e3*np.median(idle):.3f} ms; "
      f"call issued while the previous runs {1e3*np.median(busy):.3f} ms", flush=True)
