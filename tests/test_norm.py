"""The residual add + RMSNorm kernel (jaxspec.pallas.norm, interpreted on the CPU) against XLA's ops, and an engine
whose decode steps carry the residual stream pending (ops.Residual) against one that adds it at once."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.pallas.norm import add_rms_norm, add_rms_norm_reference

EPS = 1e-6


@pytest.mark.parametrize("T,D,delta", [(1, 96, None), (3, 96, "full"), (5, 64, 4), (2, 100, 3)])
def test_kernel_adds_and_norms_like_xla(T, D, delta):
    """delta None (a norm alone: the first layer), [T, D] (o's output), f32 partial sums [S, T, D] (a split-K
    gemv); D = 96 and 100 are not powers of two (the kernel's tile is, its lanes past D masked)."""
    rng = np.random.default_rng(T * D)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    h, weight = f(T, D), 1 + 0.3 * f(3, D)
    d = None if delta is None else f(T, D) if delta == "full" else f(delta, T, D)
    got_h, got_x = add_rms_norm(h, d, weight, 1, eps=EPS)
    want_h, want_x = add_rms_norm_reference(h, d, weight, 1, eps=EPS)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-5)
    # layer 1's weight, not another's; every split counted
    assert not np.allclose(got_x, add_rms_norm_reference(h, d, weight, 2, eps=EPS)[1], atol=1e-3)
    if delta not in (None, "full"):
        assert not np.allclose(got_h, add_rms_norm_reference(h, d[1:], weight, 1, eps=EPS)[0], atol=1e-3)


def test_kernel_rejects_shapes_that_do_not_fit():
    h = jnp.ones((2, 8))
    with pytest.raises(ValueError, match=r"stacked norm weights \[L, 8\]"):
        add_rms_norm(h, None, jnp.ones((8,)), 0, eps=EPS)
    with pytest.raises(ValueError, match=r"must be \[2, 8\] or partial sums \[S, 2, 8\]"):
        add_rms_norm(h, jnp.ones((3, 8)), jnp.ones((1, 8)), 0, eps=EPS)


def test_engine_with_pending_residuals_matches_the_plain_layers(monkeypatch):
    """Greedy tokens, logprobs and drafted / accepted counts of an engine whose decode and verify steps add each
    residual in the norm kernel after it equal those of the plain layers; a draft model (the target with noise:
    some drafts accepted, some not) runs the same decoder, so both of its steps and the target's verify steps
    take the kernel's path."""
    from conftest import random_model
    from jaxspec import LLM, SamplingParams
    target = random_model(5, hidden_size=48, intermediate_size=96, vocab_size=96, num_heads=4, num_kv_heads=2)
    draft = random_model(6, hidden_size=48, intermediate_size=96, vocab_size=96, num_heads=4, num_kv_heads=2,
                         base=target, noise=0.4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 2, 41, 7] * 4, [17, 3, 88])]
    outs, spec = {}, {}
    for fused in ("0", "1"):
        monkeypatch.setenv("JAXSPEC_FUSED_NORM", fused)
        llm = LLM(target, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, warmup=False,
                  unroll_layers=True, speculative_config={"method": "draft_model", "model": draft,
                                                          "num_speculative_tokens": 3})
        ops = llm.engine.runner.ops
        assert ops.fuses_norms(8) == (fused == "1") and not ops.fuses_norms(65)
        outs[fused] = llm.generate(prompts, params, use_tqdm=False)
        spec[fused] = {k: llm.stats()["spec"][k] for k in ("draft_tokens", "accepted_tokens")}
    assert spec["0"] == spec["1"] and 0 < spec["1"]["accepted_tokens"] < spec["1"]["draft_tokens"], spec
    for a, b in zip(outs["0"], outs["1"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [d["logprob"] for d in a.outputs[0].logprobs]
        lb = [d["logprob"] for d in b.outputs[0].logprobs]
        np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-5)
