"""FP8 weights (jaxspec.nn.quant): the quantized matmul (MoE experts' grouped one too) against a numpy reference of
the same e4m3 bytes and scales, the engine's fp8 target decoding losslessly with every drafter (draft models and
EAGLE / EAGLE-3 / MTP heads quantized with it), async == sync, a hybrid MoE model with every projection quantized,
scales placed with their weights under tensor parallelism, and greedy agreement with the unquantized model at the
rate measured on a real model."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec import LLM, SamplingParams
from jaxspec.nn import quant, schema
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


def silu_product(y):
    """A gate/up pair's output [..., F, 2] -> silu(gate) * up [..., F]."""
    return y[..., 0] / (1 + np.exp(-y[..., 0])) * y[..., 1]


@pytest.mark.parametrize("pairs", [False, True])
def test_fp8_experts_equal_the_dequantized_reference(pairs):
    """MoE experts [E, K, N...] are quantized per expert and output channel, over K (the axis the grouped matmul sums:
    not the last one here), and Ops.linear's grouped matmul over them (rows grouped by expert, one group empty; W8A16
    even where a step would quantize activations) equals numpy: each row times its own expert's dequantized weight.
    The experts' channels differ in scale by up to e^4, so another expert's scales are far off. XLA's ragged_dot and
    the grouped-matmul kernel alike."""
    rng = np.random.default_rng(5)
    E, K, N, M = 4, 48, 32, 11
    shape = (E, K, N, 2) if pairs else (E, K, N)
    w = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 1, (E, 1, *shape[2:])))
    name = "experts_gate_up" if pairs else "experts_down"
    params = {k: np.asarray(v) for k, v in quant.quantize_params({name: w.astype(np.float32)}).items()}
    q, scale = params[name], params[name + "_scale"]
    k_last = np.moveaxis(w.astype(np.float32), 1, -1)                                  # [E, N..., K]
    assert q.shape == shape and scale.shape == (E, *shape[2:])
    np.testing.assert_allclose(scale, numpy_quantize(k_last)[1], rtol=2e-7)
    np.testing.assert_array_equal(np.moveaxis(q, 1, -1).view(np.uint8),
                                  (k_last / scale[..., None]).astype(E4M3).view(np.uint8))
    group_sizes = np.array([3, 0, 6, 2], np.int32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    expert = np.repeat(np.arange(E), group_sizes)                                       # each row's expert
    dequant = q.astype(np.float64) * scale[:, None]                                     # [E, K, N...]
    ref = np.einsum("mk,mk...->m...", x.astype(np.float64), dequant[expert])
    ref = silu_product(ref) if pairs else ref
    tolerance = 1e-6 * np.abs(ref).max()   # float32 accumulation over K
    from jaxspec.nn import kernels
    assert kernels.grouped_linear(x, params, name, group_sizes) is not None   # the kernel takes these shapes
    for ops in (Ops(), Ops(w8a8_from_tokens=1), Ops(grouped_matmul="pallas")):   # (the kernel: a GPU's default)
        y = np.asarray(ops.linear(x, params, name, group_sizes=group_sizes))
        np.testing.assert_allclose(y, ref, rtol=2e-6, atol=tolerance)
    shifted = {name: q, name + "_scale": np.roll(scale, 1, axis=0)}                    # the previous expert's scales
    assert np.abs(np.asarray(Ops().linear(x, shifted, name, group_sizes=group_sizes)) - ref).max() > 1000 * tolerance


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


TARGET_NAMES = [f"layers.attention.{name}" for name in ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")]


def assert_declared(declared, params, what: str):
    """The params are the arrays `declared` (a schema) says, in shape and, where it names one, dtype (e4m3 weights,
    float32 scales): what placement, sharding and the step's program specs are built from."""
    schema.check(declared, params, what)
    specs = dict(jax.tree_util.tree_flatten_with_path(declared, is_leaf=schema.is_spec)[0])
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        if specs[path].dtype is not None:
            assert value.dtype == jnp.dtype(specs[path].dtype), f"{what}{jax.tree_util.keystr(path)}: {value.dtype}"


def test_fp8_target_decodes_its_own_argmax(fp8_plain, target):  # noqa: F811
    llm, prompts, tokens = fp8_plain
    report = llm.stats()["quantization"]
    assert report["scheme"] == "fp8" and sorted(report["target"]) == TARGET_NAMES
    assert str(llm.model.params["layers"]["attention"]["qkv_proj"].dtype) == "float8_e4m3fn"
    assert target.quantization is None and target.params["layers"]["attention"]["qkv_proj"].dtype == np.float32
    assert_greedy_lossless(llm.model, prompts, [type("O", (), {"token_ids": t}) for t in tokens])
    full = run(LLM(target, **{**ENGINE, "warmup": False}), prompts, SamplingParams(temperature=0, max_tokens=16))
    assert [o.token_ids for o in full] != tokens   # the fp8 weights are what ran (not the float32 ones)


@pytest.mark.parametrize("method", METHODS)
def test_speculation_over_an_fp8_target_is_lossless(fp8_plain, target, drafters, method):  # noqa: F811
    """Every drafter over the fp8 target emits the fp8 target's own greedy tokens, with drafts accepted and
    rejected; a draft model and an EAGLE / EAGLE-3 head are quantized with it (fc and the layers' projections; an
    EAGLE-3 head's lm_head kept, as the target's is), and the drafter declares the params it holds. Sync scheduling
    gives the same tokens and counts."""
    _, prompts, tokens = fp8_plain
    params = SamplingParams(temperature=0, max_tokens=16)
    llm = make_llm(target, drafters, method, 3, quantization="fp8")
    outs = run(llm, prompts, params)
    assert [o.token_ids for o in outs] == tokens
    stats = llm.stats()
    assert_partial_acceptance(stats["spec"], 1)
    expected = {"ngram": [], "draft_model": TARGET_NAMES}.get(method, ["fc"] + TARGET_NAMES)
    assert sorted(stats["quantization"]["drafter"]) == expected
    runner = llm.engine.runner
    if method != "ngram":
        assert_declared(runner.drafter.param_schema(), runner.drafter_params, method)
    if method == "eagle3":
        assert runner.drafter_params["lm_head"].dtype == np.float32
    if method == "draft_model":   # a pool without preemption (which moves step boundaries): async == sync
        counts = {}
        for mode in (True, False):
            llm = make_llm(target, drafters, method, 3, quantization="fp8", async_scheduling=mode, num_kv_blocks=40)
            outs = run(llm, prompts, params)
            assert llm.stats()["num_preemptions"] == 0 and [o.token_ids for o in outs] == tokens
            counts[mode] = ([(o.metrics["num_draft_tokens"], o.metrics["num_accepted_tokens"]) for o in outs],
                            llm.stats()["spec"]["per_position_acceptance"])
        assert counts[True] == counts[False]


def scale_placement(weight_spec, ndim: int, contracted: int) -> tuple:
    """Where a weight's scale belongs, given the weight's placement: split as its output channels are, whole where the
    weight splits the contracted axis (row-parallel: every device computes part of every output channel)."""
    dims = list(weight_spec) + [None] * (ndim - len(weight_spec))
    if dims[contracted] is not None:
        return ()
    del dims[contracted]
    return spec_tuple(dims)


def spec_tuple(spec) -> tuple:
    """A PartitionSpec as a tuple without trailing Nones (P(None, "tp") and P(None, "tp", None) are one placement)."""
    dims = list(spec)
    while dims and dims[-1] is None:
        dims.pop()
    return tuple(dims)


def assert_scales_placed_with_weights(shardings: dict, declared: dict, where: str) -> list[str]:
    """Every quantized weight's scale in `shardings` (a tree of PartitionSpecs, as `declared`) is placed as
    `scale_placement` says. -> the weights whose scales are split."""
    split = []
    for name, value in declared.items():
        if isinstance(value, dict):
            split += assert_scales_placed_with_weights(shardings[name], value, f"{where}{name}.")
        elif name in quant.QUANTIZED and name + quant.SCALE in declared:
            want = scale_placement(shardings[name], len(value.shape), quant.CONTRACTED[name])
            got = spec_tuple(shardings[name + quant.SCALE])
            assert got == want, f"{where}{name}_scale placed {got}, its weight {tuple(shardings[name])}"
            split += [where + name] if want else []
    return split


def test_fp8_under_tensor_parallelism_places_each_scale_with_its_weight(fp8_plain, target, drafters):  # noqa: F811
    """Two devices, the fp8 target and an fp8 EAGLE-3 head: each scale is split with a column-parallel weight (q/k/v,
    gate/up) and whole beside a row-parallel one (o, down), and greedy speculation emits one device's fp8 tokens. The
    declarations place a hybrid MoE model's scales alike (experts' gate/up split with their columns, their down
    whole)."""
    from jaxspec.nn.decoder import Decoder
    from jaxspec.nn.sharding import PARAM_RULES, TensorParallel
    _, prompts, tokens = fp8_plain
    llm = make_llm(target, drafters, "eagle3", 3, quantization="fp8", tensor_parallel_size=2, num_kv_blocks=40)
    runner = llm.engine.runner
    placed = {"target": (runner.params, runner.target.param_schema()),
              "head": (runner.drafter_params, runner.drafter.param_schema())}
    for what, (params, declared) in placed.items():
        specs = jax.tree_util.tree_map(lambda a: a.sharding.spec, params)
        split = assert_scales_placed_with_weights(specs, declared, f"{what}:")
        assert sorted(split) == [f"{what}:layers.attention.{n}" for n in ("gate_up_proj", "qkv_proj")]
    assert [o.token_ids for o in run(llm, prompts, SamplingParams(temperature=0, max_tokens=16))] == tokens
    config = hybrid_moe_model().config
    tp = TensorParallel.create(2, [config])
    declared = Decoder(config, Ops(quantization="fp8")).param_schema()
    specs = jax.tree_util.tree_map(lambda s: s.spec, tp.shardings(declared, PARAM_RULES))
    split = assert_scales_placed_with_weights(specs, declared, "")
    assert sorted(split) == sorted(["layers.gated_attention.qkv_proj"] + [
        f"layers.{kind}.{n}" for kind in ("gated_deltanet", "gated_attention")
        for n in ("experts_gate_up", "shared_gate_up")])


def hybrid_moe_model():
    """The Qwen3-Next hybrid of tests/test_hybrid.py (a Gated DeltaNet and a gated attention layer, each with 4 experts,
    top 2, and a gated shared expert), its weights drawn here at unit gain: quantizing needs no checkpoint."""
    from test_hybrid import DIMS, HYBRIDS
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.model import Model
    from jaxspec.nn.decoder import Decoder
    hf = {k: v for k, v in {**DIMS, **HYBRIDS["qwen3_next"][1]}.items() if v is not None}
    config = ModelConfig.from_hf({"model_type": "qwen3_next", **hf})
    params = schema.initialize(Decoder(config).param_schema(), jnp.float32, jax.random.PRNGKey(7))
    return Model(config, params, name="tiny-qwen3-next")


def test_fp8_hybrid_moe_quantizes_every_projection_and_speculates_losslessly():
    """A hybrid MoE model in fp8 with MTP drafting: every projection of the target quantized (Gated DeltaNet in/out,
    attention q/k/v and o, the experts and the shared expert; routers and gates kept) and of the MTP head (its fc and
    layer, experts included), and through chunked prefill and rejected drafts (the head's weights are random) every
    token emitted is the fp8 model's own argmax."""
    from jaxspec.decode.drafters.mtp import random_mtp_params
    model = hybrid_moe_model()
    prompts = [[5, 9, 17, 3, 5, 9, 17, 3, 5], [100, 2, 60]]
    llm = LLM(model, max_num_seqs=2, max_model_len=48, block_size=4, max_num_batched_tokens=8, warmup=False,
              quantization="fp8", speculative_config=dict(method="mtp", num_speculative_tokens=2,
                                                          model=random_mtp_params(model.config, "float32")))
    outs = run(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stats, runner = llm.stats(), llm.engine.runner
    ffn = ["experts_down", "experts_gate_up", "shared_down", "shared_gate_up"]
    layer = {"gated_deltanet": ["in_proj", "out_proj"], "gated_attention": ["o_proj", "qkv_proj"]}
    assert sorted(stats["quantization"]["target"]) == sorted(
        f"layers.{kind}.{n}" for kind, names in layer.items() for n in names + ffn)
    assert sorted(stats["quantization"]["drafter"]) == ["fc"] + sorted(
        f"layers.gated_attention.{n}" for n in layer["gated_attention"] + ffn)
    assert_declared(runner.target.param_schema(), llm.model.params, "target")
    assert_declared(runner.drafter.param_schema(), runner.drafter_params, "mtp")
    assert stats["spec"]["draft_tokens"] > 0
    assert_greedy_lossless(llm.model, prompts, outs)


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


@pytest.mark.parametrize("pairs", [False, True])
def test_fp8_gemv_reads_large_weights_as_uint16_pairs(pairs):
    """A one-byte weight of 2^31 elements or more (8B's stacked FP8 gate/up) is read as uint16 pairs (Pallas's
    Triton offsets wrap past 2^31 elements): forced here at a small size, the pairs' bytes interleaved back give
    exactly the plain kernel's output, with the norm, split K and gate/up pairs. The GPU's own check, at 2^31
    elements: tests/gpu/test_fp8_kernels.py."""
    from jaxspec.pallas.gemv import Tiling, gemv, needs_packing
    rng = np.random.default_rng(5)
    L, N, K, T = 3, 32, 256, 5
    w = rng.standard_normal((L, N, 2, K) if pairs else (L, N, K)).astype(np.float32) / 16
    q, scale = quant.quantize_fp8(w)
    x = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
    g = jnp.asarray(1 + 0.3 * rng.standard_normal((L, K)), jnp.float32)
    assert not needs_packing(q) and needs_packing(jax.ShapeDtypeStruct((2 ** 31,), jnp.float8_e4m3fn))
    modes = [dict(tiling=Tiling(16, 64), norm=g, eps=1e-6)] + ([] if pairs else [dict(tiling=Tiling(32, 32, 4))])
    for kw in modes:
        want = np.asarray(gemv(x, q, 1, scale=scale, packed=False, **kw))
        got = np.asarray(gemv(x, q, 1, scale=scale, packed=True, **kw))
        np.testing.assert_array_equal(got, want)
        assert np.abs(want).max() > 0.5
