"""The host's cost of launching a jitted function of ~300 kernels over a donated state (as the engine's step is),
called with the same input buffer every time vs a fresh one (device_put, as each step's packed inputs are): does a
new input address make XLA's command buffers (CUDA graphs) cost host time?

    python3 scripts/bench_launch.py
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/bench_launch.py     # command buffers off
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

L = 100
def body(state, inp):
    x, ws = state
    h = x + inp[0]
    for i in range(L):
        h = jnp.tanh(h @ ws[i]) * (1.0 + inp[i % inp.shape[0]])
        h = h / (1e-3 + jnp.sum(h * h, axis=-1, keepdims=True))
    return (h, ws), h[0, :4]

f = jax.jit(body, donate_argnums=(0,))
key = jax.random.PRNGKey(0)
state = (jax.random.normal(key, (8, 256), jnp.bfloat16), jax.random.normal(key, (L, 256, 256), jnp.bfloat16) * 0.05)
inp_np = np.linspace(0, 1, 64, dtype=np.float32).astype(jnp.bfloat16)
same = jax.device_put(inp_np)
for mode in ("same", "fresh", "same", "fresh"):
    for _ in range(20):
        state, out = f(state, same if mode == "same" else jax.device_put(inp_np))
    jax.block_until_ready(out)
    t_issue = 0.0
    t0 = time.perf_counter()
    for _ in range(200):
        a = jax.device_put(inp_np) if mode == "fresh" else same
        t1 = time.perf_counter()
        state, out = f(state, a)
        t_issue += time.perf_counter() - t1
    jax.block_until_ready(out)
    wall = (time.perf_counter() - t0) / 200
    print(f"{mode:6s} issue {1e3 * t_issue / 200:.3f} ms per call, wall {1e3 * wall:.3f} ms per call", flush=True)
