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


@pytest.mark.parametrize("pairs", [False, True])
def test_fp8_gemv_past_2_31_elements(pairs):
    """A stacked e4m3 weight of 2^31 elements (Llama-3.1-8B's gate/up has 3.76e9): the kernel reads its last layer,
    whose offsets pass 2^31, as uint16 pairs, and equals the float64 reference over the same bytes (read the plain
    way it faulted: CUDA_ERROR_ILLEGAL_ADDRESS)."""
    import jax
    import jax.numpy as jnp
    from jaxspec.pallas.gemv import INT32_ELEMENTS, gemv, needs_packing, tiling_for
    L, N, K, T = 32, 16384, 4096, 8   # 2^31 elements
    shape = (L, N // 2, 2, K) if pairs else (L, N, K)
    q = jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * 4).astype(jnp.float8_e4m3fn))(jax.random.key(0))
    assert q.size >= INT32_ELEMENTS and needs_packing(q)
    scale = jnp.full(shape[:-1], 0.5, jnp.float32)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
    tiling = tiling_for(shape[1], K, norm=False, pairs=pairs, fp8=True)
    got = gemv(x, q, L - 1, scale=scale, tiling=tiling)
    got = np.asarray(got.sum(0) if tiling.splits > 1 else got, np.float64)
    w = np.asarray(q[L - 1].astype(jnp.float32), np.float64) * 0.5
    want = np.asarray(x, np.float64) @ w.reshape(-1, K).T
    if pairs:
        gu = want.reshape(T, N // 2, 2)
        want = gu[..., 0] / (1 + np.exp(-gu[..., 0])) * gu[..., 1]
    print(f"pairs={pairs}: max error {np.abs(got - want).max():.2e}")
    # float32 sums of 4096 terms ~1e2 in another order; SwiGLU multiplies two of them (measured 4.6e-5 of the max)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4 * np.abs(want).max())
