"""The experts' grouped-matmul kernel as Triton compiles it (the CPU suite interprets it), at the engine's tilings
for GPT-OSS-20B's and Qwen3-30B-A3B's expert shapes, against a float64 numpy reference of each row times its own
expert's weight: bf16 and FP8 (e4m3 with per-channel scales) experts, decode and verify row counts, a stack of
layers read in place."""
import numpy as np
import pytest

from jaxspec.nn import quant
from jaxspec.nn.kernels import LayerWeights, grouped_linear

pytestmark = pytest.mark.gpu

# (E, K, N): GPT-OSS-20B gate/up and down, Qwen3-30B-A3B gate/up (as [K, 2F]) and down
SHAPES = {"gpt_oss_gate_up": (32, 2880, 5760), "gpt_oss_down": (32, 2880, 2880),
          "qwen3_moe_gate_up": (128, 2048, 1536), "qwen3_moe_down": (128, 768, 2048)}


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [4, 32, 160])
@pytest.mark.parametrize("name", list(SHAPES))
def test_grouped_matmul_matches_numpy(name, rows, fp8):
    check_against_numpy(*SHAPES[name], rows, fp8)


def check_against_numpy(E, K, N, rows, fp8):
    """The weights drawn on the device; the reference in float64 one routed expert at a time (each [K, N], not a
    [rows, K, N] stack: 21 GB at 160 rows of GPT-OSS's gate/up, which kept the file from finishing in minutes)."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(rows)
    L = 2
    w = jax.random.normal(jax.random.PRNGKey(rows), (L, E, K, N), jnp.float32) / np.sqrt(K)
    group_sizes = np.bincount(rng.integers(0, E, rows), minlength=E).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((rows, K)), jnp.bfloat16)
    if fp8:
        q, scale = quant.quantize_fp8(w, axis=-2)   # per expert and output column, over K
        stacks = {"w": q, "w_scale": scale}
        dequant = lambda e: (np.asarray(q[1, e], np.float64)                                  # noqa: E731
                             * np.asarray(scale[1, e], np.float64)[None, :])
    else:
        stacks = {"w": w.astype(jnp.bfloat16)}
        dequant = lambda e: np.asarray(stacks["w"][1, e], np.float64)                         # noqa: E731
    del w
    got = grouped_linear(x, LayerWeights(stacks, 1), "w", jnp.asarray(group_sizes), out_dtype=jnp.float32)
    assert got is not None
    x64, ends = np.asarray(x, np.float64), np.cumsum(group_sizes)
    starts = ends - group_sizes
    want = np.zeros((rows, N))
    for e in np.flatnonzero(group_sizes):
        want[starts[e]:ends[e]] = x64[starts[e]:ends[e]] @ dequant(e)
    # bf16 products are exact in float32; the sums' rounding over K
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max() * np.sqrt(K / 64))
