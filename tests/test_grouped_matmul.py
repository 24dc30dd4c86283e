"""The experts' grouped-matmul kernel (jaxspec.pallas.grouped_matmul, interpret mode on the CPU) against
jax.lax.ragged_dot: groups empty, smaller than a tile, spanning several tiles, all rows on one expert; the
layer read in place from the stack; bf16 weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas.grouped_matmul import Tiling, grouped_matmul, max_tiles, tile_table

TILING = Tiling(block_m=8, block_n=16, block_k=16)
GROUPS = [[3, 0, 20, 1, 0], [0, 0, 0, 0, 7], [8, 8, 0, 0, 1], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("group_sizes", GROUPS)
def test_tiles_cover_each_expert_rows_once(group_sizes):
    gs = np.array(group_sizes)
    R = int(gs.sum())
    expert, start, end = (np.asarray(a) for a in tile_table(jnp.asarray(gs, jnp.int32), R, 8))
    assert len(expert) == max_tiles(R, len(gs), 8)
    covered = np.full(R, -1)
    for e, s, t in zip(expert, start, end):
        assert 0 <= t - s <= 8
        assert (covered[s:t] == -1).all()
        covered[s:t] = e
    assert (covered == np.repeat(np.arange(len(gs)), gs)).all()   # every row once, by its own expert


@pytest.mark.parametrize("group_sizes", GROUPS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_equals_ragged_dot_on_each_layer_of_the_stack(group_sizes, dtype):
    rng = np.random.default_rng(len(group_sizes) + sum(group_sizes))
    L, E, K, N = 2, len(group_sizes), 32, 48
    gs = jnp.asarray(group_sizes, jnp.int32)
    R = int(gs.sum())
    w = jnp.asarray(rng.standard_normal((L, E, K, N)), dtype)
    x = jnp.asarray(rng.standard_normal((R, K)), dtype)
    for layer in range(L):
        got = grouped_matmul(x, w, jnp.int32(layer), gs, tiling=TILING, out_dtype=jnp.float32)
        want = jax.lax.ragged_dot(x, w[layer], gs, preferred_element_type=jnp.float32,
                                  precision=jax.lax.Precision.HIGHEST)
        scale = float(jnp.max(jnp.abs(want)))
        # float32: rounding of 32-term sums; bf16 operands give exact products, the sums in float32 either way
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * scale, (layer, group_sizes)


def test_fp8_experts_equal_the_scaled_ragged_dot():
    """e4m3 experts with per-channel scales (W8A16): the kernel against jaxspec.nn.quant.fp8_ragged_dot."""
    from jaxspec.nn import quant
    rng = np.random.default_rng(7)
    L, E, K, N = 2, 4, 32, 48
    gs = jnp.asarray([5, 0, 9, 2], jnp.int32)
    w = jnp.asarray(rng.standard_normal((L, E, K, N)), jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (L, E, N)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((16, K)), jnp.bfloat16)
    for layer in range(L):
        got = grouped_matmul(x, w, jnp.int32(layer), gs, scale, tiling=TILING, out_dtype=jnp.float32)
        want = quant.fp8_ragged_dot(x, w[layer], scale[layer], gs, out_dtype=jnp.float32)
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * float(jnp.max(jnp.abs(want))), layer
