"""The prefill attention kernel (query tiles; interpret mode on CPU) equals the reference attention: rows whose chunks
cross tile boundaries, decode rows of one token beside them, padding, GQA groups, a sliding window and sinks."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.nn.ops import ForwardBatch, paged_attention_reference
from jaxspec.pallas.prefill_attention import prefill_attention, tile_starts


def step_layout(rng, row_tokens, row_starts, block_size, num_blocks, max_blocks, padding):
    """A step as the engine lays it out: each row's tokens contiguous at consecutive positions from its start
    (earlier positions already in the pool), then `padding` tokens. -> (ForwardBatch, first_in_step)."""
    tables = rng.permutation(num_blocks)[:len(row_tokens) * max_blocks].reshape(len(row_tokens), max_blocks)
    positions, rows, first = [], [], []
    for r, (n, p0) in enumerate(zip(row_tokens, row_starts)):
        first += [len(positions)] * n
        positions += list(range(p0, p0 + n))
        rows += [r] * n
    positions += [-1] * padding
    rows += [0] * padding
    first += list(range(len(first), len(first) + padding))
    batch = ForwardBatch(None, jnp.asarray(positions, jnp.int32), None, jnp.asarray(rows, jnp.int32),
                         jnp.asarray(tables.astype(np.int32)), None, first_in_step=jnp.asarray(first, jnp.int32))
    return batch


CASES = {   # rows' (tokens this step, first position), and padding
    "one_chunk_over_many_tiles": ([45], [0], 0),
    "chunk_after_a_cached_prefix": ([37], [29], 3),
    "chunks_and_decode_rows": ([1, 19, 1, 23, 2], [40, 0, 7, 50, 12], 4),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_kv_heads,group,head_dim,heads", [(2, 3, 16, 1), (1, 1, 8, 1), (2, 6, 32, 1),
                                                               (2, 3, 16, 3), (2, 6, 32, 2)])
def test_prefill_kernel_matches_reference(case, num_kv_heads, group, head_dim, heads):
    """q_tile 16 so that chunks cross tiles; a row's tokens see the pool's earlier keys and the chunk's own. One
    program per query head, and per several of a kv head's (`heads`: each page group read once for them)."""
    row_tokens, row_starts, padding = CASES[case]
    rng = np.random.default_rng(num_kv_heads * 10 + group)
    layers, block_size, num_blocks, max_blocks = 2, 4, 96, 19
    batch = step_layout(rng, row_tokens, row_starts, block_size, num_blocks, max_blocks, padding)
    T = batch.positions.shape[0]
    pool = lambda: jnp.asarray(rng.standard_normal((layers, num_blocks * block_size, num_kv_heads, head_dim)),  # noqa: E731
                               jnp.float32)
    k_pool, v_pool = pool(), pool()
    q = jnp.asarray(rng.standard_normal((T, num_kv_heads * group, head_dim)), jnp.float32)
    # the interpreter runs the tiles in order, a GPU in none: in reverse too (a tile that wrote past its row's tokens
    # would be overwritten by the next row's tile in order, but not in reverse)
    starts = tile_starts(batch.first_in_step, batch.positions, 16, T)[::-1]
    for layer, order in ((0, None), (1, None), (1, starts)):
        out = prefill_attention(q, k_pool, v_pool, jnp.int32(layer), batch.positions, batch.first_in_step,
                                batch.row_of_token, batch.block_tables, block_size=block_size, q_tile=16,
                                heads_per_program=heads, interpret=True, starts=order)
        ref = paged_attention_reference(q, k_pool, v_pool, layer, batch, block_size)
        real = np.asarray(batch.positions) >= 0
        np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(out)[~real] == 0)


@pytest.mark.parametrize("window,sinks", [(6, False), (None, True), (9, True)])
def test_prefill_kernel_with_a_window_and_sinks_matches_reference(window, sinks):
    """The window skips the pages before a tile's first token's window and masks within it; sinks join each head's
    softmax sum. Both bite: the output without them differs."""
    rng = np.random.default_rng(3)
    block_size = 4
    batch = step_layout(rng, [30, 1, 12], [20, 33, 0], block_size, 64, 16, 2)
    T = batch.positions.shape[0]
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((1, 64 * block_size, 2, 16)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((T, 6, 16)), jnp.float32)
    sink_logits = jnp.asarray(rng.standard_normal(6) * 2, jnp.float32) if sinks else None
    run = lambda w, s, heads=1: prefill_attention(  # noqa: E731
        q, k_pool, v_pool, jnp.int32(0), batch.positions, batch.first_in_step, batch.row_of_token, batch.block_tables,
        block_size=block_size, q_tile=16, heads_per_program=heads, interpret=True, window=w, sinks=s)
    ref = paged_attention_reference(q, k_pool, v_pool, 0, batch, block_size, window, sink_logits)
    real = np.asarray(batch.positions) >= 0
    for heads in (1, 3):   # one program per query head, or per kv head (its 3 query heads)
        out = run(window, sink_logits, heads)
        np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-5)
    plain = np.asarray(run(None, None))[real]
    assert np.abs(plain - np.asarray(out)[real]).max() > 1e-2


def test_tiles_start_at_each_rows_first_token_and_every_q_tile_after():
    first = jnp.asarray([0, 0, 0, 0, 0, 5, 6, 6, 6, 9], jnp.int32)
    positions = jnp.asarray([0, 1, 2, 3, 4, 8, 3, 4, 5, -1], jnp.int32)
    starts = tile_starts(first, positions, 2, 8)
    np.testing.assert_array_equal(np.asarray(starts), [0, 2, 4, 5, 6, 8, 10, 10])


@pytest.mark.parametrize("heads_per_program", [1, 2])
def test_a_forward_whose_steps_take_the_prefill_kernel_matches_the_reference_forward(heads_per_program, monkeypatch):
    """A step of at least `prefill_attention_from_tokens` tokens writes its k/v by XLA's scatter and attends with the
    query tiles (not the fused kernel); its logits equal the reference attention's, and a smaller step keeps the
    fused kernel. With HEADS_PER_PROGRAM 2, a kv head's two query heads share a program."""
    import jaxspec.pallas.prefill_attention as prefill
    monkeypatch.setattr(prefill, "HEADS_PER_PROGRAM", heads_per_program)
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.random import random_params
    from jaxspec.nn import CacheShape, Decoder, Ops, schema
    cfg = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    params = random_params(cfg, "float32", seed=1, scale=0.3)
    rng = np.random.default_rng(0)
    bs = 4
    batch = step_layout(rng, [21, 1, 9], [0, 6, 3], bs, 24, 8, 1)
    T = batch.positions.shape[0]
    positions, rows = np.asarray(batch.positions), np.asarray(batch.row_of_token)
    tables = np.asarray(batch.block_tables)
    slots = np.where(positions >= 0, tables[rows, np.maximum(positions, 0) // bs] * bs + positions % bs, 24 * bs)
    batch = batch._replace(token_ids=jnp.asarray(rng.integers(0, cfg.vocab_size, T), jnp.int32),
                           slot_mapping=jnp.asarray(slots, jnp.int32), logits_indices=jnp.arange(T - 1))
    tiled = Ops(attention="pallas", block_size=bs, prefill_attention_from_tokens=T)
    assert tiled.uses_prefill_kernel(batch) and not tiled.fuses_kv_write(batch)
    assert not Ops(attention="pallas", block_size=bs, prefill_attention_from_tokens=T + 1).uses_prefill_kernel(batch)
    outs = []
    for ops in (Ops(attention="reference", block_size=bs), tiled):
        model = Decoder(cfg, ops)
        state = schema.initialize(model.state_schema(CacheShape(num_kv_slots=24 * bs, num_slots=3)), jnp.float32)
        # rows 1 and 2 start at positions 6 and 3: their earlier keys (zeros here) are read from the pool by both
        outs.append(model.forward(params, state, batch)[0])
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), rtol=1e-4, atol=1e-4)
