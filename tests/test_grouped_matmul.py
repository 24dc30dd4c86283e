"""The experts' grouped-matmul kernel (jaxspec.pallas.grouped_matmul, interpret mode on the CPU) against
jax.lax.ragged_dot: groups empty, smaller than a tile, spanning several tiles, all rows on one expert; the
layer read in place from the stack; bf16 weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas.grouped_matmul import Tiling, grouped_matmul, max_tiles, tile_table

TILING = Tiling(block_m=8, block_n=16, block_k=16)
# K = 48 is 3 steps of 16: split in 2, the second part has one step fewer than the first
SPLIT = Tiling(block_m=8, block_n=16, block_k=16, splits=2)
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
@pytest.mark.parametrize("dtype,tiling", [("float32", TILING), ("bfloat16", TILING), ("float32", SPLIT)],
                         ids=["float32", "bfloat16", "float32-split-k"])
def test_equals_ragged_dot_on_each_layer_of_the_stack(group_sizes, dtype, tiling):
    rng = np.random.default_rng(len(group_sizes) + sum(group_sizes))
    L, E, K, N = 2, len(group_sizes), 48, 48
    gs = jnp.asarray(group_sizes, jnp.int32)
    R = int(gs.sum())
    w = jnp.asarray(rng.standard_normal((L, E, K, N)), dtype)
    x = jnp.asarray(rng.standard_normal((R, K)), dtype)
    for layer in range(L):
        got = grouped_matmul(x, w, jnp.int32(layer), gs, tiling=tiling, out_dtype=jnp.float32)
        want = jax.lax.ragged_dot(x, w[layer], gs, preferred_element_type=jnp.float32,
                                  precision=jax.lax.Precision.HIGHEST)
        scale = float(jnp.max(jnp.abs(want)))
        # float32: rounding of 48-term sums; bf16 operands give exact products, the sums in float32 either way
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
    for layer, tiling in zip(range(L), (TILING, Tiling(block_m=8, block_n=16, block_k=16, splits=2))):
        got = grouped_matmul(x, w, jnp.int32(layer), gs, scale, tiling=tiling, out_dtype=jnp.float32)
        want = quant.fp8_ragged_dot(x, w[layer], scale[layer], gs, out_dtype=jnp.float32)
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * float(jnp.max(jnp.abs(want))), layer


def test_the_routing_compiles_without_a_loop():
    """The tile table and fp8_ragged_dot's row experts are one comparison each: a binary search lowers to a while
    loop, which a GPU runs as several kernels per iteration with a host round-trip each (~0.2 ms a layer)."""
    from jaxspec.nn import quant
    gs = jnp.asarray([5, 0, 9, 2], jnp.int32)
    table = jax.jit(lambda gs: tile_table(gs, 16, 8)).lower(gs).as_text()
    assert "while" not in table
    w = jnp.zeros((4, 32, 48), jnp.float8_e4m3fn)
    fp8 = jax.jit(quant.fp8_ragged_dot).lower(jnp.zeros((16, 32), jnp.bfloat16), w, jnp.ones((4, 48)), gs)
    assert "while" not in fp8.as_text()


def test_split_k_for_few_rows():
    """tiling_for splits K where one token's tiles leave the SMs idle, not where the rows already fill them."""
    from jaxspec.pallas.grouped_matmul import tiling_for
    assert tiling_for(5760, 2880, 4, 32).splits > 1          # GPT-OSS-20B, one token: 4 tiles x 45 column blocks
    assert tiling_for(5760, 2880, 128, 32).splits == 1
    assert tiling_for(1536, 2048, 8, 128).splits > 1         # Qwen3-30B-A3B, one token
