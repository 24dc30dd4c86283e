"""The decode-sized matmul kernels (jaxspec.pallas.gemv, interpreted on the CPU) against plain jnp, mode by mode,
and an engine whose dense layers run them against one that does not."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.nn.kernels import LayerWeights, gemv_linear
from jaxspec.nn.ops import Ops, gemv_matmuls, rms_norm
from jaxspec.pallas.gemv import Tiling, gemv

EPS = 1e-6
L, N, K = 3, 64, 256   # 3 stacked layers; the kernel reads layer 1 in place


def arrays(seed, T, pairs=False):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    w = f(L, N, 2, K) / np.sqrt(K) if pairs else f(L, N, K) / np.sqrt(K)
    return f(T, K), w, 1 + 0.3 * f(L, K), f(T, N)


@pytest.mark.parametrize("T", [1, 5, 16, 20])   # 20: the 32-row tile
def test_plain_and_split_k(T):
    x, w, _, _ = arrays(0, T)
    want = x @ w[1].T
    got = gemv(x, w, 1, tiling=Tiling(block_n=16, block_k=64))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    parts = gemv(x, w, 1, tiling=Tiling(block_n=32, block_k=32, splits=4))   # f32 partial sums over K / 4 each
    assert parts.shape == (4, T, N)
    np.testing.assert_allclose(parts.sum(0), want, rtol=1e-5, atol=1e-5)
    # each split holds its own quarter of K, not the whole product
    np.testing.assert_allclose(parts[2], x[:, 128:192] @ w[1, :, 128:192].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [3, 16])
def test_norm_residual_and_pairs(T):
    x, w, g, r = arrays(1, T)
    normed = rms_norm(x, g[2], EPS)
    got = gemv(x, w, 2, g, r, tiling=Tiling(block_n=16, block_k=128), eps=EPS)   # r + rms_norm(x) @ W.T
    np.testing.assert_allclose(got, r + normed @ w[2].T, rtol=1e-5, atol=1e-5)

    _, wp, _, _ = arrays(2, T, pairs=True)
    gu = (rms_norm(x, g[0], EPS) @ wp[0].reshape(-1, K).T).reshape(T, N, 2)
    got = gemv(x, wp, 0, g, tiling=Tiling(block_n=16, block_k=64), eps=EPS)     # silu(gate) * up
    np.testing.assert_allclose(got, jax.nn.silu(gu[..., 0]) * gu[..., 1], rtol=1e-5, atol=1e-5)


def test_linear_picks_the_stacked_layer_and_rejects_bad_shapes():
    x, w, g, r = arrays(3, 4)
    lp = LayerWeights({"w": w, "g": g}, 2)
    assert set(lp) == {"w", "g"} and lp["w"].shape == (N, K)   # a plain dict of the layer's slices
    want = r + rms_norm(x, g[2], EPS) @ w[2].T
    # the kernel alone, Ops.linear through the kernel (the weight named in `gemv`), and XLA's dot
    for got in (gemv_linear(x, lp, "w", norm="g", eps=EPS, residual=r),
                Ops(gemv=frozenset({"w"})).linear(x, lp, "w", norm="g", eps=EPS, residual=r),
                Ops().linear(x, lp, "w", norm="g", eps=EPS, residual=r)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert gemv_linear(x[:, :100], LayerWeights({"w": w[:, :, :100]}, 2), "w") is None   # no tiling fits K = 100
    with pytest.raises(ValueError, match="an input norm needs both"):
        Ops().linear(x, lp, "w", norm="g")
    with pytest.raises(ValueError, match="at most 32 rows"):
        gemv(jnp.zeros((33, K)), w, 0)
    with pytest.raises(ValueError, match="does not divide"):
        gemv(x, w, 0, tiling=Tiling(block_n=48))
    with pytest.raises(ValueError, match="valid: 'all' or a comma list"):
        gemv_matmuls("qkv,mlp")
    assert gemv_matmuls("all") == gemv_matmuls("qkv, o,gate_up,down") and gemv_matmuls("") == frozenset()


@pytest.mark.parametrize("unroll", [False, True])
def test_engine_with_gemv_layers_matches_xla_layers(monkeypatch, unroll):
    """Greedy tokens and their logprobs of an engine whose decode steps run every dense matmul as a kernel equal
    those of the plain XLA layers (the prefill, over 16 tokens, takes the XLA path in both)."""
    from conftest import random_model
    from jaxspec import LLM, SamplingParams
    model = random_model(3, hidden_size=64, intermediate_size=128, vocab_size=96)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [[5, 9, 2, 41, 7] * 4, [17, 3, 88]]
    outs = {}
    for spec in ("", "all"):
        monkeypatch.setenv("JAXSPEC_GEMV", spec)
        llm = LLM(model, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, warmup=False,
                  unroll_layers=unroll)
        ops = llm.engine.runner.ops
        assert ops.use_gemv(8) == (spec == "all") and not ops.use_gemv(17)
        assert not dataclasses.replace(ops, tp=object()).use_gemv(8)   # a split model keeps XLA's sharded matmuls
        outs[spec] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(outs[""], outs["all"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [d["logprob"] for d in a.outputs[0].logprobs]
        lb = [d["logprob"] for d in b.outputs[0].logprobs]
        np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-4)
