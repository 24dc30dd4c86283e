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

from jaxspec.nn.ops import ForwardBatch, paged_attention_reference  # noqa: E402
from jaxspec.pallas.paged_attention import paged_attention  # noqa: E402

for dtype, tol in [(jnp.float32, 2e-3), (jnp.bfloat16, 3e-2)]:
    for Hkv, G, hd, bs in [(2, 6, 128, 16), (3, 3, 64, 16), (2, 7, 64, 16)]:
        L, NB, T, R, MB = 3, 64, 37, 5, 8
        k_pool = jnp.asarray(rng.standard_normal((L, NB * bs, Hkv, hd)), dtype)
        v_pool = jnp.asarray(rng.standard_normal((L, NB * bs, Hkv, hd)), dtype)
        q = jnp.asarray(rng.standard_normal((T, Hkv * G, hd)), dtype)
        tables = rng.permutation(NB)[:R * MB].reshape(R, MB).astype(np.int32)
        rows = rng.integers(0, R, T).astype(np.int32)
        pos = rng.integers(0, MB * bs, T).astype(np.int32)
        batch = ForwardBatch(None, jnp.asarray(pos), None, jnp.asarray(rows), jnp.asarray(tables), None)
        ref = paged_attention_reference(q.astype(jnp.float32), k_pool.astype(jnp.float32), v_pool.astype(jnp.float32),
                                    1, batch, bs)
        for splits in (1, 3):
            out = paged_attention(q, k_pool, v_pool, jnp.int32(1), batch.positions, batch.row_of_token,
                                  batch.block_tables, block_size=bs, num_splits=splits)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
            assert err < tol, (dtype, Hkv, G, hd, splits, err)
print("paged attention kernel == reference")

# Long contexts: the kernel against the reference, and its time per call by context length.
import time  # noqa: E402

Hkv, G, hd, bs, MB, NB = 2, 6, 128, 16, 160, 400
k_pool = jnp.asarray(rng.standard_normal((2, NB * bs, Hkv, hd)), jnp.bfloat16)
v_pool = jnp.asarray(rng.standard_normal((2, NB * bs, Hkv, hd)), jnp.bfloat16)
q = jnp.asarray(rng.standard_normal((8, Hkv * G, hd)), jnp.bfloat16)
tables = jnp.asarray(rng.permutation(NB)[:2 * MB].reshape(2, MB).astype(np.int32))
for ctx in (200, 1000, 2500):
    pos = jnp.asarray([ctx - 1] + [-1] * 7, jnp.int32)      # one live token, seven padding tokens
    rows = jnp.zeros(8, jnp.int32)
    batch = ForwardBatch(None, pos, None, rows, tables, None)
    ref = paged_attention_reference(q.astype(jnp.float32), k_pool.astype(jnp.float32), v_pool.astype(jnp.float32),
                                1, batch, bs)
    for splits in (1, 8):
        out = paged_attention(q, k_pool, v_pool, jnp.int32(1), pos, rows, tables, block_size=bs, num_splits=splits)
        err = float(jnp.max(jnp.abs(out[:1].astype(jnp.float32) - ref[:1])) / jnp.max(jnp.abs(ref[:1])))
        assert err < 3e-2, (ctx, splits, err)
        # 28 calls in one executable (a model's layers), so the time is the kernels', not the dispatch's.
        many = jax.jit(lambda q, s=splits, pos=pos: sum(
            paged_attention(q, k_pool, v_pool, jnp.int32(i % 2), pos, rows, tables, block_size=bs, num_splits=s)
            for i in range(28)))
        many(q).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(20):
            out = many(q)
        out.block_until_ready()
        print(f"context {ctx}, {splits} split(s): {1e6 * (time.perf_counter() - t0) / 20 / 28:.1f} us per layer "
              f"(err {err:.1e})")
print("long-context paged attention == reference")
