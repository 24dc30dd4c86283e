"""The prefill kernel's query tiles lowered for the GPU against the reference attention: a 512-token chunk ending an
8k and a 32k context (Qwen2.5-1.5B's attention shapes, bf16), and a mixed step of chunks and decode rows (float32)."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.nn.ops import ForwardBatch, paged_attention_reference
from jaxspec.pallas.prefill_attention import prefill_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("context,heads,q_tile", [(8192, 1, 64), (32768, 1, 64), (32768, 3, 32), (32768, 6, 16)])
def test_a_chunk_at_the_end_of_a_long_context(context, heads, q_tile):
    """Relative to the output's largest value (bf16 inputs, float32 reference); one program per query head, and per
    3 or all 6 of a kv head's."""
    rng = np.random.default_rng(context)
    Hkv, G, hd, bs, T = 2, 6, 128, 16, 512
    blocks = context // bs + 1
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((2, blocks * bs, Hkv, hd)), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((T, Hkv * G, hd)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(blocks)[None, :], jnp.int32)
    positions = jnp.arange(context - T, context, dtype=jnp.int32)
    batch = ForwardBatch(None, positions, None, jnp.zeros(T, jnp.int32), tables, None,
                         first_in_step=jnp.zeros(T, jnp.int32))
    out = prefill_attention(q, k_pool, v_pool, jnp.int32(1), positions, batch.first_in_step, batch.row_of_token,
                            tables, block_size=bs, q_tile=q_tile, heads_per_program=heads).astype(jnp.float32)
    ref = paged_attention_reference(q.astype(jnp.float32), k_pool.astype(jnp.float32), v_pool.astype(jnp.float32),
                                    1, batch, bs)
    assert float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))) < 3e-2


@pytest.mark.parametrize("window", [None, 100])
def test_chunks_and_decode_rows_in_one_step(window):
    """Rows of 300, 1, 77 and 1 tokens over cached prefixes, then padding; float32 (the GPU's dots are TF32)."""
    rng = np.random.default_rng(5)
    Hkv, G, hd, bs, MB = 2, 7, 64, 16, 64
    rows_tokens, rows_start = [300, 1, 77, 1], [200, 900, 0, 33]
    positions, rows, first = [], [], []
    for r, (n, p0) in enumerate(zip(rows_tokens, rows_start)):
        first += [len(positions)] * n
        positions += list(range(p0, p0 + n))
        rows += [r] * n
    pad = 11
    first += list(range(len(positions), len(positions) + pad))
    positions += [-1] * pad
    rows += [0] * pad
    i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)  # noqa: E731
    tables = i32(rng.permutation(4 * MB).reshape(4, MB))
    batch = ForwardBatch(None, i32(positions), None, i32(rows), tables, None, first_in_step=i32(first))
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((1, 4 * MB * bs, Hkv, hd)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((len(positions), Hkv * G, hd)), jnp.float32)
    out = prefill_attention(q, k_pool, v_pool, jnp.int32(0), batch.positions, batch.first_in_step, batch.row_of_token,
                            tables, block_size=bs, window=window)
    ref = paged_attention_reference(q, k_pool, v_pool, 0, batch, bs, window)
    real = np.asarray(positions) >= 0
    err = np.abs(np.asarray(out)[real] - np.asarray(ref)[real]).max() / np.abs(np.asarray(ref)[real]).max()
    assert err < 2e-3
