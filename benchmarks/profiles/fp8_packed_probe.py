"""The gemv kernel reading e4m3 weights as uint16 pairs (jaxspec.pallas.gemv, needed past 2^31 elements) against
the plain read, at Llama-3.1-8B's gate/up and down shapes over 16 stacked layers (1.9e9 elements: both reads
work): equality and the time of each at 1 and 8 tokens."""
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.pallas.gemv import gemv, tiling_for

L, K_MODEL, F = 16, 4096, 14336
for name, shape, pairs in (("gate_up", (L, F, 2, K_MODEL), True), ("down", (L, K_MODEL, F), False)):
    q = jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * 4).astype(jnp.float8_e4m3fn))(jax.random.key(0))
    scale = jnp.full(shape[:-1], 0.01, jnp.float32)
    K = shape[-1]
    tiling = tiling_for(shape[1], K, norm=False, pairs=pairs, fp8=True)
    for T in (1, 8):
        x = jnp.asarray(np.random.default_rng(T).standard_normal((T, K)), jnp.bfloat16)
        outs, times = {}, {}
        for packed in (False, True):
            g = jax.jit(lambda x, q, scale, layer, packed=packed: gemv(x, q, layer, scale=scale, tiling=tiling,
                                                                          packed=packed))
            f = lambda x, layer, g=g: g(x, q, scale, jnp.int32(layer))  # noqa: E731
            y = f(x, L - 1).block_until_ready()
            outs[packed] = np.asarray(y.astype(jnp.float32))
            t0 = time.perf_counter()
            for i in range(200):
                y = f(x, i % L)
            y.block_until_ready()
            times[packed] = (time.perf_counter() - t0) / 200 * 1e6
        err = np.abs(outs[True] - outs[False]).max()
        print(f"{name} T={T} {tiling}: plain {times[False]:.1f} us, packed {times[True]:.1f} us, "
              f"max |packed - plain| {err:.3g} of max {np.abs(outs[False]).max():.3g}", flush=True)
