"""The fused attention kernel (rotary, q/k norms, bias and the KV write inside) against the separate rotary, KV
write and attention kernels on the GPU, on the ragged step of tests/test_paged_attention.py (a prefill chunk after
a cached prefix, a verify segment, decode tokens, padding), with the engine's 16-token pages and a real head width
(the GPU's dots want tiles of at least 16 keys).

Measured on an H100 (docs/lab/2026-11-25-update-mode-and-fused-attention.md): in bf16 the written pools are
bit-identical and the output differs by at most one bf16 step, 0.0078 (the two dots of hd/2 sum in another order than one
of hd); in float32 by 0.00024 (the GPU's float32 dots are TF32)."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import _fused_case

from jaxspec.nn.kernels import LayerWeights, fused_attention_fn, paged_attention_fn
from jaxspec.nn.layers import split_qkv, write_kv
from jaxspec.nn.ops import rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,bias_norm,splits", list(itertools.product(
    (jnp.bfloat16, jnp.float32), ((True, False), (False, True)), (None, 1))),
    ids=lambda v: getattr(v, "__name__", str(v)))
def test_fused_attention_matches_separate_kernels(dtype, bias_norm, splits):
    bias, norm = bias_norm
    cfg, stacks, qkv, k_pool, v_pool, batch, bs = _fused_case(bias, norm, block_size=16, head_dim=128)
    stacks = {k: v.astype(dtype) for k, v in stacks.items()}
    qkv, k_pool, v_pool = qkv.astype(dtype), k_pool.astype(dtype), v_pool.astype(dtype)
    lp = LayerWeights(stacks, 1)
    q, k, v = split_qkv(cfg, lp, qkv, batch.positions)
    kv = write_kv({"k": k_pool, "v": v_pool}, 1, batch, k, v)
    want = np.asarray(paged_attention_fn(q, kv["k"], kv["v"], 1, batch, bs), np.float32)
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(cfg))
    out, k_new, v_new = fused_attention_fn(cfg, lp, qkv, cos, sin, k_pool, v_pool, 1, batch, bs, splits)
    out = np.asarray(out, np.float32)
    k_new, k_want = np.asarray(k_new, np.float32), np.asarray(kv["k"], np.float32)
    if dtype == jnp.bfloat16:   # rotated keys rounded to bf16 alike
        np.testing.assert_array_equal(k_new, k_want)
    else:
        np.testing.assert_allclose(k_new, k_want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(v_new, np.float32), np.asarray(kv["v"], np.float32))
    # measured: bf16 0.0078 (one bf16 step of a value in [1, 2); outputs reach ~4), float32 0.00024
    diff = np.abs(out - want).max()
    assert diff <= (2 ** -6 if dtype == jnp.bfloat16 else 1e-3), diff


@pytest.mark.parametrize("window", [5, 24])
def test_sliding_window_kernels_match_the_reference(window):
    """Both Pallas kernels with a sliding window (5: inside a 16-key page; 24: across pages, some skipped), lowered
    through Triton, against the reference's windowed attention, in float32 (TF32 dots: 1e-3 as above)."""
    from jaxspec.nn.ops import paged_attention_reference
    cfg, stacks, qkv, k_pool, v_pool, batch, bs = _fused_case(False, True, block_size=16, head_dim=128)
    lp = LayerWeights(stacks, 1)
    q, k, v = split_qkv(cfg, lp, qkv, batch.positions)
    kv = write_kv({"k": k_pool, "v": v_pool}, 1, batch, k, v)
    want = np.asarray(paged_attention_reference(q, kv["k"], kv["v"], 1, batch, bs, window), np.float32)
    padding = np.asarray(batch.slot_mapping) >= k_pool.shape[1]
    unfused = np.asarray(paged_attention_fn(q, kv["k"], kv["v"], 1, batch, bs, window), np.float32)
    assert np.abs(unfused - want)[~padding].max() <= 1e-3
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(cfg))
    out, _, _ = fused_attention_fn(cfg, lp, qkv, cos, sin, k_pool, v_pool, 1, batch, bs, None, window=window)
    assert np.abs(np.asarray(out, np.float32) - want)[~padding].max() <= 1e-3


def test_attention_sinks_kernels_match_the_reference():
    """Both Pallas kernels with attention sinks (the unfused one with its context split 4 ways too), lowered through
    Triton, against the reference in float32 (TF32 dots: 1e-3)."""
    from jaxspec.nn.ops import paged_attention_reference
    from jaxspec.pallas.paged_attention import paged_attention
    cfg, stacks, qkv, k_pool, v_pool, batch, bs = _fused_case(False, True, block_size=16, head_dim=128)
    lp = LayerWeights(stacks, 1)
    q, k, v = split_qkv(cfg, lp, qkv, batch.positions)
    kv = write_kv({"k": k_pool, "v": v_pool}, 1, batch, k, v)
    sinks = jnp.asarray(np.random.default_rng(5).normal(0, 2, cfg.num_heads), jnp.float32)
    want = np.asarray(paged_attention_reference(q, kv["k"], kv["v"], 1, batch, bs, sinks=sinks), np.float32)
    live = np.asarray(batch.slot_mapping) < k_pool.shape[1]
    for splits in (1, 4):
        out = paged_attention(q, kv["k"], kv["v"], jnp.int32(1), batch.positions, batch.row_of_token,
                              batch.block_tables, block_size=bs, num_splits=splits, sinks=sinks)
        assert np.abs(np.asarray(out, np.float32) - want)[live].max() <= 1e-3
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(cfg))
    out, _, _ = fused_attention_fn(cfg, lp, qkv, cos, sin, k_pool, v_pool, 1, batch, bs, None, sinks=sinks)
    assert np.abs(np.asarray(out, np.float32) - want)[live].max() <= 1e-3
