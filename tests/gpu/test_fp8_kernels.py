"""The gemv kernel over FP8 weights as Triton compiles it (the CPU suite interprets it) against XLA's FP8 matmul over
the same e4m3 bytes and scales, at the engine's tilings for Qwen2.5-Coder-1.5B's shapes, float32 activations (exact
up to the order of accumulation) and bf16 (within bf16's rounding)."""
import numpy as np
import pytest

from jaxspec.nn import quant
from jaxspec.nn.kernels import LayerWeights, gemv_linear
from jaxspec.nn.ops import Ops

pytestmark = pytest.mark.gpu

SHAPES = {"qkv": (2048, 1536, "norm"), "o": (1536, 1536, None), "gate_up": (8960, 1536, "pairs"),
          "down": (1536, 8960, None)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [8, 32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_fp8_gemv_matches_xla(name, T, dtype):
    import jax.numpy as jnp
    N, K, mode = SHAPES[name]
    rng = np.random.default_rng(0)
    L = 2
    w = rng.standard_normal((L, N, 2, K) if mode == "pairs" else (L, N, K)).astype(np.float32) / np.sqrt(K)
    q, scale = quant.quantize_fp8(w)
    x = jnp.asarray(rng.standard_normal((T, K)), dtype)
    stacks = {"w": q, "w_scale": scale, "g": jnp.asarray(1 + 0.1 * rng.standard_normal((L, K)), dtype)}
    kw = dict(norm="g", eps=1e-6) if mode is not None else {}
    lp = LayerWeights(stacks, 1)
    got = gemv_linear(x, lp, "w", **kw)
    assert got is not None
    want = Ops().linear(x, dict(lp), "w", **kw)
    tol = 2e-4 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
