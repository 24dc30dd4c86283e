"""The Pallas paged-attention kernel (interpret mode on CPU) equals the reference gather attention."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.nn.ops import ForwardBatch, paged_attention_reference
from jaxspec.pallas.paged_attention import paged_attention


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,block_size", [(2, 3, 16, 4), (1, 1, 8, 8), (3, 6, 32, 4)])
def test_kernel_matches_reference(num_kv_heads, group, head_dim, block_size, num_splits):
    """One split per token, and the context split over programs (some splits empty: short rows)."""
    rng = np.random.default_rng(num_kv_heads * 100 + group)
    layers, num_blocks, T, R, MB = 2, 24, 9, 4, 5
    pool = lambda: jnp.asarray(rng.standard_normal((layers, num_blocks * block_size, num_kv_heads, head_dim)),  # noqa: E731
                               jnp.float32)
    k_pool, v_pool = pool(), pool()
    q = jnp.asarray(rng.standard_normal((T, num_kv_heads * group, head_dim)), jnp.float32)
    tables = rng.permutation(num_blocks)[:R * MB].reshape(R, MB).astype(np.int32)
    tables[3, 2:] = -1                                  # a short row: unallocated entries are never read
    rows = rng.integers(0, R, T).astype(np.int32)
    limit = np.where(rows == 3, 2 * block_size, MB * block_size)
    positions = (rng.random(T) * limit).astype(np.int32)
    positions[0], rows[0] = 0, 0                        # a token attending to itself only
    batch = ForwardBatch(None, jnp.asarray(positions), None, jnp.asarray(rows), jnp.asarray(tables), None)
    for layer in range(layers):
        out = paged_attention(q, k_pool, v_pool, jnp.int32(layer), batch.positions, batch.row_of_token,
                              batch.block_tables, block_size=block_size, num_splits=num_splits, interpret=True)
        ref = paged_attention_reference(q, k_pool, v_pool, layer, batch, block_size)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_with_a_sliding_window_matches_reference(num_splits):
    """A 6-key sliding window over 4-token pages: the pages before a token's window are skipped (the splits share
    what is left) and the window's first page is masked below its start, as the reference's mask; the window bites
    (the whole-context output differs)."""
    rng = np.random.default_rng(7)
    layers, num_blocks, T, R, MB, block_size, window = 2, 24, 9, 4, 5, 4, 6
    pool = lambda: jnp.asarray(rng.standard_normal((layers, num_blocks * block_size, 2, 16)), jnp.float32)  # noqa: E731
    k_pool, v_pool = pool(), pool()
    q = jnp.asarray(rng.standard_normal((T, 6, 16)), jnp.float32)
    tables = rng.permutation(num_blocks)[:R * MB].reshape(R, MB).astype(np.int32)
    rows = rng.integers(0, R, T).astype(np.int32)
    positions = np.array([0, 3, 5, 6, 9, 13, 17, 18, 19], np.int32)
    batch = ForwardBatch(None, jnp.asarray(positions), None, jnp.asarray(rows), jnp.asarray(tables), None)
    out = paged_attention(q, k_pool, v_pool, jnp.int32(1), batch.positions, batch.row_of_token, batch.block_tables,
                          block_size=block_size, num_splits=num_splits, interpret=True, window=window)
    ref = paged_attention_reference(q, k_pool, v_pool, 1, batch, block_size, window)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    whole = paged_attention_reference(q, k_pool, v_pool, 1, batch, block_size)
    assert np.abs(np.asarray(whole) - np.asarray(ref)).max(axis=1)[positions >= window].min() > 1e-2


def test_forward_with_kernel_matches_reference_forward():
    """The whole model with the kernel as its attention (Ops) gives the same logits."""
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.random import random_params
    from jaxspec.nn import CacheShape, Decoder, Ops, schema
    cfg = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    params = random_params(cfg, "float32", seed=1, scale=0.3)
    rng = np.random.default_rng(0)
    bs, T = 4, 12
    tables = jnp.asarray(rng.permutation(16)[:8].reshape(2, 4).astype(np.int32))
    rows = np.array([0] * 7 + [1] * 5, np.int32)
    positions = np.concatenate([np.arange(7), np.arange(5)]).astype(np.int32)
    slots = np.asarray(tables)[rows, positions // bs] * bs + positions % bs
    batch = ForwardBatch(jnp.asarray(rng.integers(0, cfg.vocab_size, T), jnp.int32), jnp.asarray(positions),
                         jnp.asarray(slots, jnp.int32), jnp.asarray(rows), tables, jnp.arange(T))
    outs = []
    for attention in ("reference", "pallas"):
        model = Decoder(cfg, Ops(attention=attention, block_size=bs))
        state = schema.initialize(model.state_schema(CacheShape(num_kv_slots=16 * bs, num_slots=3)), jnp.float32)
        outs.append(model.forward(params, state, batch)[0])
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_padding_tokens_visit_no_page_and_stay_finite(num_splits):
    rng = np.random.default_rng(3)
    k_pool = jnp.asarray(rng.standard_normal((1, 32, 1, 8)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.float32)
    out = paged_attention(q, k_pool, k_pool, jnp.int32(0), jnp.array([3, -1, 5, -1], jnp.int32),
                          jnp.zeros(4, jnp.int32), jnp.arange(8, dtype=jnp.int32).reshape(1, 8), block_size=4,
                          num_splits=num_splits, interpret=True)
    out = np.asarray(out).reshape(4, 2, 8)
    assert np.isfinite(out).all()
    assert np.all(out[[1, 3]] == 0)


def _fused_case(qkv_bias: bool, qk_norm: bool, seed: int = 0, block_size: int = 4, head_dim: int = 32):
    """A ragged step on a pool that already holds earlier steps' KV: row 0 a prefill chunk after a cached
    prefix, row 1 a verify segment of 4 tokens, rows 2-3 single decode tokens (row 3 at position 0), then two
    padding tokens (slot past the pool)."""
    from jaxspec.models.config import ModelConfig
    cfg = ModelConfig(arch="qwen3" if qk_norm else "qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=6, num_kv_heads=2, head_dim=head_dim,
                      rope_theta=500.0)
    rng = np.random.default_rng(seed)
    bs, num_blocks, L, Hkv, hd = block_size, 32, 2, 2, head_dim
    S = num_blocks * bs
    tables = rng.permutation(num_blocks)[:16].reshape(4, 4).astype(np.int32)
    rows_spec = [(0, 5, 7), (1, 9, 4), (2, 13, 1), (3, 0, 1)]     # (row, first position this step, tokens)
    rows, positions, first = [], [], []
    for r, p0, n in rows_spec:
        first += [len(rows)] * n
        rows += [r] * n
        positions += list(range(p0, p0 + n))
    rows, positions, first = rows + [0, 0], positions + [0, 0], first + [len(rows), len(rows) + 1]
    T = len(rows)
    rows, positions, first = (np.asarray(x, np.int32) for x in (rows, positions, first))
    slots = tables[rows, positions // bs] * bs + positions % bs
    slots[-2:] = S                                              # padding: writes nothing, sees nothing
    W = 6 // 2 + 2
    lp = {"qkv_bias": jnp.asarray(rng.standard_normal((L, Hkv * W * hd)), jnp.float32)} if qkv_bias else {}
    if qk_norm:
        lp.update(q_norm=jnp.asarray(1 + 0.3 * rng.standard_normal((L, hd)), jnp.float32),
                  k_norm=jnp.asarray(1 + 0.3 * rng.standard_normal((L, hd)), jnp.float32))
    pool = lambda: jnp.asarray(rng.standard_normal((L, S, Hkv, hd)), jnp.float32)   # noqa: E731
    qkv = jnp.asarray(rng.standard_normal((T, Hkv * W * hd)), jnp.float32)
    batch = ForwardBatch(None, jnp.asarray(positions), jnp.asarray(slots), jnp.asarray(rows), jnp.asarray(tables),
                         None, first_in_step=jnp.asarray(first))
    return cfg, lp, qkv, pool(), pool(), batch, bs


@pytest.mark.parametrize("qkv_bias,qk_norm,num_splits,window", [(True, False, None, None), (False, True, 1, None),
                                                                (True, False, None, 3), (False, True, 1, 5)])
def test_fused_attention_matches_rotary_write_and_attention(qkv_bias, qk_norm, num_splits, window):
    """The kernel with rotary, q/k norms, bias and the KV write inside gives the unfused layer's output and pool:
    keys of this step read from the projection, earlier keys from the pool, padding writing and seeing nothing.
    Layer 1 of two, its weights at index 1 of their stacks. One program per token and kv head (num_splits=1), and
    the 15-token step's default of 8 programs sharing each context (pages split between them, the step's own
    keys in the last one). With a sliding window (3: inside this step's own keys; 5: across the pool's pages and the
    step's), the reference's windowed attention."""
    from jaxspec.nn.kernels import LayerWeights, fused_attention_fn
    from jaxspec.nn.layers import split_qkv, write_kv
    from jaxspec.nn.ops import rope_cos_sin, rope_inv_freq
    cfg, stacks, qkv, k_pool, v_pool, batch, bs = _fused_case(qkv_bias, qk_norm)
    layer = 1
    lp = LayerWeights(stacks, layer)
    q, k, v = split_qkv(cfg, lp, qkv, batch.positions)
    kv = write_kv({"k": k_pool, "v": v_pool}, layer, batch, k, v)
    want = paged_attention_reference(q, kv["k"], kv["v"], layer, batch, bs, window)
    if window is not None:   # the window bites
        whole = paged_attention_reference(q, kv["k"], kv["v"], layer, batch, bs)
        assert np.abs(np.asarray(whole) - np.asarray(want)).max() > 0.1
    want = jnp.where((batch.slot_mapping < k_pool.shape[1])[:, None], want, 0)   # padding: 0
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(cfg))
    out, k_new, v_new = fused_attention_fn(cfg, lp, qkv, cos, sin, k_pool, v_pool, layer, batch, bs, num_splits,
                                           window=window)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(k_new), np.asarray(kv["k"]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(v_new), np.asarray(kv["v"]))


def test_attention_sinks_in_the_reference_and_both_kernels():
    """GPT-OSS's attention sinks: a learned logit per query head in the softmax's sum, attending to nothing. The
    reference equals a direct softmax over [scores, sink]; the unfused kernel (one program per token, and the
    context split three ways: the sink counted once, in split 0) and the fused kernel equal the reference; sinks
    that bite (the output differs from no sinks)."""
    from jaxspec.nn.kernels import LayerWeights, fused_attention_fn
    from jaxspec.nn.layers import split_qkv, write_kv
    from jaxspec.nn.ops import rope_cos_sin, rope_inv_freq
    cfg, stacks, qkv, k_pool, v_pool, batch, bs = _fused_case(False, True)
    lp = LayerWeights(stacks, 1)
    q, k, v = split_qkv(cfg, lp, qkv, batch.positions)
    kv = write_kv({"k": k_pool, "v": v_pool}, 1, batch, k, v)
    sinks = jnp.asarray(np.random.default_rng(5).normal(0, 2, cfg.num_heads), jnp.float32)
    want = paged_attention_reference(q, kv["k"], kv["v"], 1, batch, bs, sinks=sinks)
    live = np.asarray(batch.slot_mapping) < k_pool.shape[1]
    # the reference itself, token by token: softmax over the visible keys' scores and the sink
    T, Hq, hd = q.shape
    G = Hq // cfg.num_kv_heads
    tables, rows, pos = (np.asarray(x) for x in (batch.block_tables, batch.row_of_token, batch.positions))
    for t in np.flatnonzero(live):
        slots = tables[rows[t], np.arange(pos[t] + 1) // bs] * bs + np.arange(pos[t] + 1) % bs
        for head in range(Hq):
            keys, values = (np.asarray(kv[n][1])[slots, head // G] for n in ("k", "v"))
            s = keys @ np.asarray(q[t, head]) / np.sqrt(hd)
            e = np.exp(np.append(s, sinks[head]) - max(s.max(), sinks[head]))
            np.testing.assert_allclose(np.asarray(want)[t, head * hd:(head + 1) * hd],
                                       (e[:-1] / e.sum()) @ values, rtol=1e-4, atol=1e-5)
    whole = paged_attention_reference(q, kv["k"], kv["v"], 1, batch, bs)
    assert np.abs(np.asarray(whole) - np.asarray(want))[live].max() > 1e-2
    for splits in (1, 3):
        out = paged_attention(q, kv["k"], kv["v"], jnp.int32(1), batch.positions, batch.row_of_token,
                              batch.block_tables, block_size=bs, num_splits=splits, interpret=True, sinks=sinks)
        np.testing.assert_allclose(np.asarray(out)[live], np.asarray(want)[live], rtol=2e-5, atol=2e-5)
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(cfg))
    out, _, _ = fused_attention_fn(cfg, lp, qkv, cos, sin, k_pool, v_pool, 1, batch, bs, None, sinks=sinks)
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(want)[live], rtol=2e-5, atol=2e-5)


def test_long_block_tables_split_decode_contexts_further_and_stay_exact(monkeypatch):
    """With FUSED_PAGES_PER_SPLIT set (64; 0 by default until timed end to end on a GPU), a block table of
    max_model_len 8192 or more (512 pages) splits a decode token's context over more programs, so that none walks
    more than FUSED_PAGES_PER_SPLIT pages at full length; the default 4096 (256 pages) keeps the short-context count.
    The fused kernel with such a table (the case's rows padded to 1024 pages, the pages past each row's context never
    read) still gives the unfused layer's output."""
    import jaxspec.pallas.paged_attention as pa
    from jaxspec.nn.kernels import LayerWeights, fused_attention_fn
    from jaxspec.nn.layers import split_qkv, write_kv
    from jaxspec.nn.ops import rope_cos_sin, rope_inv_freq
    monkeypatch.setattr(pa, "FUSED_PAGES_PER_SPLIT", 64)
    assert [pa.fused_splits(t, 256) for t in (8, 32, 64)] == [pa.fused_splits(t) for t in (8, 32, 64)] == [16, 4, 2]
    assert [pa.fused_splits(t, 2048) for t in (8, 16, 32, 64, 512)] == [32, 32, 16, 8, 1]
    cfg, stacks, qkv, k_pool, v_pool, batch, bs = _fused_case(False, True)
    tables = jnp.pad(batch.block_tables, ((0, 0), (0, 1024 - batch.block_tables.shape[1])))
    batch = ForwardBatch(None, batch.positions, batch.slot_mapping, batch.row_of_token, tables, None,
                         first_in_step=batch.first_in_step)
    T = batch.positions.shape[0]
    assert pa.fused_splits(T, 1024) > pa.fused_splits(T)
    layer = 1
    lp = LayerWeights(stacks, layer)
    q, k, v = split_qkv(cfg, lp, qkv, batch.positions)
    kv = write_kv({"k": k_pool, "v": v_pool}, layer, batch, k, v)
    want = paged_attention_reference(q, kv["k"], kv["v"], layer, batch, bs)
    want = jnp.where((batch.slot_mapping < k_pool.shape[1])[:, None], want, 0)
    cos, sin = rope_cos_sin(batch.positions, rope_inv_freq(cfg))
    out, _, _ = fused_attention_fn(cfg, lp, qkv, cos, sin, k_pool, v_pool, layer, batch, bs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
