"""The Pallas kernels lowered for the GPU against their references: KV slot mapping, token acceptance, paged
attention (the context split over programs or not; short and long contexts). The CPU suite checks the same
kernels in interpret mode."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.nn.ops import ForwardBatch, paged_attention_reference
from jaxspec.pallas.acceptance import acceptance, acceptance_reference
from jaxspec.pallas.paged_attention import paged_attention
from jaxspec.pallas.slot_mapping import slot_mapping, slot_mapping_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T,R,MB,bs", [(8, 8, 4, 16), (37, 5, 9, 16), (256, 32, 64, 16)])
def test_slot_mapping(T, R, MB, bs):
    rng = np.random.default_rng(T)
    pos = jnp.asarray(rng.integers(0, MB * bs + 3, T).astype(np.int32))
    row = jnp.asarray(rng.integers(0, R, T).astype(np.int32))
    valid = jnp.asarray(rng.random(T) < 0.8)
    bt = jnp.asarray(rng.integers(-1, 500, (R, MB)).astype(np.int32))
    a = slot_mapping(pos, row, valid, bt, bs, 500 * bs)
    b = slot_mapping_reference(pos, row, valid, bt, bs, 500 * bs)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("R,K", [(1, 1), (5, 3), (32, 4), (16, 16)])
def test_acceptance(R, K):
    rng = np.random.default_rng(R * 100 + K)
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
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(n1), np.asarray(n2))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("Hkv,G,hd,bs", [(2, 6, 128, 16), (3, 3, 64, 16), (2, 7, 64, 16)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-3), (jnp.bfloat16, 3e-2)], ids=["float32", "bfloat16"])
def test_paged_attention(dtype, tol, Hkv, G, hd, bs, num_splits):
    """Relative to the output's largest value (the GPU's float32 dots are TF32)."""
    rng = np.random.default_rng(Hkv * 100 + G * 10 + hd)
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
    out = paged_attention(q, k_pool, v_pool, jnp.int32(1), batch.positions, batch.row_of_token, batch.block_tables,
                          block_size=bs, num_splits=num_splits)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    assert err < tol


@pytest.mark.parametrize("num_splits", [1, 8])
@pytest.mark.parametrize("context", [200, 1000, 2500])
def test_paged_attention_long_context(context, num_splits):
    """One live token at the end of a long context beside seven padding tokens, bf16."""
    rng = np.random.default_rng(context)
    Hkv, G, hd, bs, MB, NB = 2, 6, 128, 16, 160, 400
    k_pool = jnp.asarray(rng.standard_normal((2, NB * bs, Hkv, hd)), jnp.bfloat16)
    v_pool = jnp.asarray(rng.standard_normal((2, NB * bs, Hkv, hd)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((8, Hkv * G, hd)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(NB)[:2 * MB].reshape(2, MB).astype(np.int32))
    pos = jnp.asarray([context - 1] + [-1] * 7, jnp.int32)
    rows = jnp.zeros(8, jnp.int32)
    batch = ForwardBatch(None, pos, None, rows, tables, None)
    ref = paged_attention_reference(q.astype(jnp.float32), k_pool.astype(jnp.float32), v_pool.astype(jnp.float32),
                                    1, batch, bs)
    out = paged_attention(q, k_pool, v_pool, jnp.int32(1), pos, rows, tables, block_size=bs, num_splits=num_splits)
    err = float(jnp.max(jnp.abs(out[:1].astype(jnp.float32) - ref[:1])) / jnp.max(jnp.abs(ref[:1])))
    assert err < 3e-2
