"""The gemv kernel over FP8 weights as Triton compiles it (the CPU suite interprets it) against a reference over
the same e4m3 bytes and scales (numpy, float64), at the engine's tilings for Qwen2.5-Coder-1.5B's shapes, float32
activations (exact up to the order of accumulation) and bf16 (within bf16's rounding); the engine's default path
(the kernel's product, the norm and SwiGLU around it) and the fused one."""
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
    fused = gemv_linear(x, lp, "w", **kw)   # the norm and SwiGLU inside the kernel
    plain = Ops(gemv=frozenset({"w"}), quantization="fp8", fp8_gemv="plain").linear(x, lp, "w", **kw)
    assert fused is not None
    # the reference in numpy, float64 (XLA's float32 matmul on a GPU defaults to TF32, too coarse to compare with)
    xr = np.asarray(x, np.float64)
    if mode is not None:
        g = np.asarray(stacks["g"][1], np.float64)
        xr = xr / np.sqrt((xr * xr).mean(-1, keepdims=True) + 1e-6) * g
    dequant = np.asarray(q[1], np.float64) * np.asarray(scale[1], np.float64)[..., None]
    want = xr @ dequant.reshape(-1, K).T
    if mode == "pairs":
        gu = want.reshape(T, N, 2)
        want = gu[..., 0] / (1 + np.exp(-gu[..., 0])) * gu[..., 1]
    tol = 1e-4 if dtype == "float32" else 3e-2
    for path, got in (("plain", plain), ("fused", fused)):
        err = np.abs(np.asarray(got, np.float64) - want).max()
        print(f"{name} T={T} {dtype} {path}: max error {err:.2e}")
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol, err_msg=path)
