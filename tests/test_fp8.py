"""FP8 weights (jaxspec.nn.quant): the quantized matmul against a numpy reference of the same e4m3 bytes and scales,
the engine's fp8 target decoding losslessly with every drafter, async == sync, and greedy agreement with the
unquantized model at the rate measured on a real model."""
import ml_dtypes
import numpy as np
import pytest

from jaxspec import LLM, SamplingParams
from jaxspec.nn import quant
from jaxspec.nn.ops import Ops
from test_spec import (ENGINE, METHODS, assert_greedy_lossless, assert_partial_acceptance, drafters,  # noqa: F401
                       make_llm, prompt_of, run, target)

E4M3 = ml_dtypes.float8_e4m3fn


def numpy_quantize(w):
    """The reference's own per-row quantization: e4m3 bytes and float32 scales."""
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    return (w / scale[..., None]).astype(E4M3), scale


def test_quantized_weights_are_per_channel_e4m3():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 40)) * np.exp(rng.uniform(-6, 2, (6, 1)))).astype(np.float32)
    w[2] = 0.0   # an all-zero row keeps scale 1
    q, scale = (np.asarray(a) for a in quant.quantize_fp8(w))
    ref_q, ref_scale = numpy_quantize(w)
    assert q.dtype == E4M3 and scale.shape == (6,)
    np.testing.assert_allclose(scale, ref_scale, rtol=2e-7)   # XLA may divide by a reciprocal: 1 ulp
    np.testing.assert_array_equal(q.view(np.uint8), (w / scale[:, None]).astype(E4M3).view(np.uint8))
    assert scale[2] == 1.0 and not q[2].astype(np.float32).any()
    rows = [r for r in range(6) if r != 2]
    assert (np.abs(q[rows].astype(np.float32)).max(axis=-1) == 448.0).all()   # each row's largest at e4m3's max
    dequant = q.astype(np.float32) * scale[:, None]
    assert np.abs(dequant - w).max() <= np.abs(w).max() / 16   # 3 mantissa bits


@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("pairs", [False, True])
def test_fp8_linear_equals_the_dequantized_reference(w8a8, pairs):
    """Ops.linear over an e4m3 weight and its scales (a gate/up pair too) against numpy: x (quantized per token
    with W8A8) times the dequantized weight, in float32; equal up to the order of accumulation."""
    rng = np.random.default_rng(1)
    K, F, T = 48, 24, 5
    w = rng.standard_normal((F, 2, K) if pairs else (F, K)).astype(np.float32) * 0.05
    x = rng.standard_normal((T, K)).astype(np.float32)
    q, scale = numpy_quantize(w)
    ops = Ops(w8a8_from_tokens=1 if w8a8 else None)
    y = np.asarray(ops.linear(x, {"w": q, "w_scale": scale}, "w"))
    xr = x
    if w8a8:
        x_amax = np.abs(x).max(axis=-1, keepdims=True)
        x_scale = x_amax / 448.0
        xr = (x / x_scale).astype(E4M3).astype(np.float32) * x_scale
    dequant = (q.astype(np.float32) * scale[..., None]).reshape(-1, K)
    ref = xr @ dequant.T
    if pairs:
        ref = ref.reshape(T, F, 2)
        ref = ref[..., 0] / (1 + np.exp(-ref[..., 0])) * ref[..., 1]
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6)
    wrong = np.asarray(ops.linear(x, {"w": q, "w_scale": scale * 1.01}, "w"))   # the scale is read
    assert np.abs(wrong - ref).max() > 100 * 2e-6


def test_serve_and_bench_pass_quantization_through():
    import argparse

    from jaxspec.bench.cli import build_parser
    from jaxspec.cli import add_engine_args, engine_kwargs
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["quantization"] is None
    assert engine_kwargs(parser.parse_args(["--quantization", "fp8"]))["quantization"] == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])
    assert build_parser().parse_args(["-q", "fp8"]).quantization == "fp8"


def test_unsupported_quantization_is_refused_by_name(target):  # noqa: F811
    with pytest.raises(ValueError, match="quantization='int4' is not supported; choose None or 'fp8'"):
        LLM(target, **ENGINE, quantization="int4")
    from jaxspec.models.config import ModelConfig
    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "quantization_config": {"quant_method": "compressed-tensors",
                                                            "format": "float-quantized"}}
    with pytest.raises(ValueError, match="quant_method='compressed-tensors' \\(float-quantized\\).*not supported"):
        ModelConfig.from_hf(hf)


@pytest.fixture(scope="module")
def fp8_plain(target):  # noqa: F811
    """The fp8 target's own greedy decoding (no speculation), and the fp8 model it ran."""
    llm = LLM(target, **{**ENGINE, "warmup": False}, quantization="fp8")
    prompts = [prompt_of(n, seed) for seed, n in enumerate([3, 9, 15, 20])]
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=16))
    return llm, prompts, [o.token_ids for o in outs]


def test_fp8_target_decodes_its_own_argmax(fp8_plain, target):  # noqa: F811
    llm, prompts, tokens = fp8_plain
    report = llm.stats()["quantization"]
    assert report["scheme"] == "fp8" and sorted(report["target"]) == [
        "layers.attention.down_proj", "layers.attention.gate_up_proj", "layers.attention.o_proj",
        "layers.attention.qkv_proj"]
    assert str(llm.model.params["layers"]["attention"]["qkv_proj"].dtype) == "float8_e4m3fn"
    assert target.quantization is None and target.params["layers"]["attention"]["qkv_proj"].dtype == np.float32
    assert_greedy_lossless(llm.model, prompts, [type("O", (), {"token_ids": t}) for t in tokens])
    full = run(LLM(target, **{**ENGINE, "warmup": False}), prompts, SamplingParams(temperature=0, max_tokens=16))
    assert [o.token_ids for o in full] != tokens   # the fp8 weights are what ran (not the float32 ones)


@pytest.mark.parametrize("method", METHODS)
def test_speculation_over_an_fp8_target_is_lossless(fp8_plain, target, drafters, method):  # noqa: F811
    """Every drafter over the fp8 target emits the fp8 target's own greedy tokens, with drafts accepted and
    rejected; a draft model is quantized with it. Sync scheduling gives the same tokens and counts."""
    _, prompts, tokens = fp8_plain
    params = SamplingParams(temperature=0, max_tokens=16)
    llm = make_llm(target, drafters, method, 3, quantization="fp8")
    outs = run(llm, prompts, params)
    assert [o.token_ids for o in outs] == tokens
    stats = llm.stats()
    assert_partial_acceptance(stats["spec"], 1)
    assert bool(stats["quantization"]["drafter"]) == (method == "draft_model")
    if method == "draft_model":   # a pool without preemption (which moves step boundaries): async == sync
        counts = {}
        for mode in (True, False):
            llm = make_llm(target, drafters, method, 3, quantization="fp8", async_scheduling=mode, num_kv_blocks=40)
            outs = run(llm, prompts, params)
            assert llm.stats()["num_preemptions"] == 0 and [o.token_ids for o in outs] == tokens
            counts[mode] = ([(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs],
                            llm.stats()["spec"]["per_position_acceptance"])
        assert counts[True] == counts[False]


# Fixed text (the rates below were measured on it): prose, a list and code.
AGREEMENT_TEXT = """The capital of France is Paris, and the capital of Italy is Rome. A language model reads a sequence of
tokens and predicts the next one; when it decodes greedily it takes the most likely token at every step. Speculative
decoding asks a small drafter for several tokens at once and lets the large model check them all in one forward
pass, keeping the longest prefix it agrees with. The output is the same as if the large model had decoded alone.

Things to pack for a weekend in the mountains:
1. A warm jacket, because the evenings are cold even in summer.
2. Good walking shoes and two pairs of socks.
3. A map, a compass and a charged phone.
4. Water, bread, cheese and some fruit for the trail.

def fibonacci(n):
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def is_prime(n):
    if n < 2:
        return False
    for d in range(2, int(n ** 0.5) + 1):
        if n % d == 0:
            return False
    return True


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

Once upon a time, there was a small village at the edge of a forest. Every morning the baker opened his shop before
sunrise, and the smell of fresh bread drifted down the only street. The children walked to school past the river,
where the old miller told them stories about the winters of his youth, when the water froze so hard that carts could
cross it. In the spring the whole village gathered in the square to plant trees, and each family chose one to care
for until it was strong enough to stand on its own. Years later, the forest had grown right up to the houses.
"""


@pytest.mark.parametrize("w8a8,rate", [(False, 0.95), (True, 0.92)])
def test_fp8_agrees_with_the_full_precision_model_at_the_measured_rate(smollm2_model, w8a8, rate):
    """SmolLM2-135M (real weights), 449 tokens of text: the fp8 model's next-token argmax equals the float32
    model's at 96.0% of the positions with W8A16 and 93.1% with W8A8 (measured on the CPU, deterministic); one
    layer's o_proj scales doubled falls to 89.8% / 87.8%."""
    import jax

    from jaxspec.nn import Decoder
    m = smollm2_model
    text = AGREEMENT_TEXT
    ids = np.array(m.tokenizer.encode(text, add_special_tokens=True), np.int32)
    assert len(ids) == 449
    reference = np.asarray(jax.jit(Decoder(m.config).score)(m.params, ids)).argmax(-1)
    score = jax.jit(Decoder(m.config, Ops(w8a8_from_tokens=1 if w8a8 else None)).score)
    params = quant.quantize_params(m.params)
    agreement = (np.asarray(score(params, ids)).argmax(-1) == reference).mean()
    assert agreement >= rate, agreement
    attention = params["layers"]["attention"]
    attention["o_proj_scale"] = attention["o_proj_scale"].at[15].multiply(2.0)
    assert (np.asarray(score(params, ids)).argmax(-1) == reference).mean() < rate   # measured: 0.898 / 0.878


@pytest.mark.parametrize("mode", ["plain", "norm_residual", "pairs"])
def test_fp8_gemv_kernel_equals_the_xla_fp8_matmul(mode):
    """The decode-sized kernel (jaxspec.pallas.gemv, interpreted) over e4m3 weights and their scales, reading one
    layer of the stack in place, equals Ops.linear's XLA path over the same bytes and scales."""
    from jaxspec.nn.kernels import LayerWeights, gemv_linear, gemv_matmul
    rng = np.random.default_rng(4)
    L, N, K, T = 3, 32, 256, 5
    pairs = mode == "pairs"
    w = rng.standard_normal((L, N, 2, K) if pairs else (L, N, K)).astype(np.float32) / 16
    q, scale = (np.asarray(a) for a in quant.quantize_fp8(w))
    x = rng.standard_normal((T, K)).astype(np.float32)
    stacks = {"w": q, "w_scale": scale, "g": (1 + 0.3 * rng.standard_normal((L, K))).astype(np.float32)}
    kw = dict(norm="g", eps=1e-6, residual=rng.standard_normal((T, N)).astype(np.float32)) if mode != "plain" else {}
    lp = LayerWeights(stacks, 1)
    assert gemv_linear(x, lp, "w", **kw) is not None and gemv_matmul(x, lp, "w") is not None   # tilings fit
    want = np.asarray(Ops().linear(x, dict(lp), "w", **kw))
    for fp8_gemv in ("fused", "plain"):   # the norm, SwiGLU and residual in the kernel, or around it
        got = np.asarray(Ops(gemv=frozenset({"w"}), quantization="fp8", fp8_gemv=fp8_gemv).linear(x, lp, "w", **kw))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    wrong = np.asarray(Ops(gemv=frozenset({"w"})).linear(x, LayerWeights({**stacks, "w_scale": scale * 1.01}, 1),
                                                          "w", **kw))
    assert np.abs(wrong - want).max() > 1e-3
