"""Checks the Pallas kernels against their references on whatever backend JAX has (the GPU on the device)."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.pallas.acceptance import acceptance, acceptance_reference
from jaxspec.pallas.slot_mapping import slot_mapping, slot_mapping_reference

print("backend", jax.default_backend(), jax.devices())
rng = np.random.default_rng(0)
for T, R, MB, bs in [(8, 8, 4, 16), (37, 5, 9, 16), (256, 32, 64, 16)]:
    pos = rng.integers(0, MB * bs + 3, T).astype(np.int32)
    row = rng.integers(0, R, T).astype(np.int32)
    valid = rng.random(T) < 0.8
    bt = rng.integers(-1, 500, (R, MB)).astype(np.int32)
    a = slot_mapping(jnp.asarray(pos), jnp.asarray(row), jnp.asarray(valid), jnp.asarray(bt), bs, 500 * bs)
    b = slot_mapping_reference(jnp.asarray(pos), jnp.asarray(row), jnp.asarray(valid), jnp.asarray(bt), bs, 500 * bs)
    assert np.array_equal(np.asarray(a), np.asarray(b)), (T, R)
print("slot_mapping kernel == reference")
for R, K in [(1, 1), (5, 3), (32, 4), (16, 16)]:
    V = 50
    args = dict(draft_ids=rng.integers(-2, V + 2, (R, K)).astype(np.int32), valid=rng.random((R, K)) < 0.9,
                p_d=rng.random((R, K)).astype(np.float32), q_d=rng.random((R, K)).astype(np.float32),
                uniforms=rng.random((R, K)).astype(np.float32), is_greedy=rng.random(R) < 0.5,
                target_argmax=rng.integers(0, V, (R, K + 1)).astype(np.int32),
                recovered=rng.integers(0, V, (R, K + 1)).astype(np.int32),
                num_drafts=rng.integers(0, K + 1, R).astype(np.int32))
    args = {k: jnp.asarray(v) for k, v in args.items()}
    o1, n1 = acceptance(**args)
    o2, n2 = acceptance_reference(**args)
    assert np.array_equal(np.asarray(o1), np.asarray(o2)) and np.array_equal(np.asarray(n1), np.asarray(n2)), (R, K)
print("acceptance kernel == reference")
