"""Checkpoints stored in FP8 (jaxspec.models.fp8_checkpoint), loaded as they are: the block-scaled matmul against a
numpy reference of the same e4m3 bytes and scales; tiny checkpoints written in each supported format (compressed-
tensors channel / tensor / block scales, the block-wise "fp8" of Qwen3-FP8 and DeepSeek-V3) load to the weights
they store and give the logits of their dequantized weights; everything else refused by name."""
import json

import jax
import ml_dtypes
import numpy as np
import pytest

from conftest import random_model
from jaxspec.models.errors import CorruptModelFileError
from jaxspec.models.hf_loader import SafetensorsDir, load_hf_dir
from jaxspec.models.model import Model
from jaxspec.models.weights import params_from_hf_tensors
from jaxspec.nn import quant
from jaxspec.nn.ops import Ops

E4M3 = ml_dtypes.float8_e4m3fn
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
IDS = np.array([3, 17, 5, 99, 42, 7, 64, 1, 120, 33], np.int32)
# Shapes with several 128-column blocks and ragged last ones (K = 160 and 300), q/k/v row counts (160, 80, 80)
# whose 128-row blocks straddle the fused qkv's kv-head groups.
DIMS = dict(vocab_size=128, hidden_size=160, num_heads=4, num_kv_heads=2, intermediate_size=300)


# ---- numpy references ---------------------------------------------------------------------------------------------

def block_quantize(w, bn, bk):
    """w [N, K] -> (e4m3 [N, K], f32 scales [ceil(N/bn), ceil(K/bk)]): each block's largest magnitude at e4m3's max."""
    N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = np.zeros((nb * bn, kb * bk), np.float32)
    padded[:N, :K] = np.abs(w)
    amax = padded.reshape(nb, bn, kb, bk).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    return (w / block_expand(scale, N, K, bn, bk)).astype(E4M3), scale


def block_expand(scale, N, K, bn, bk):
    """[ceil(N/bn), ceil(K/bk)] -> [N, K]: each block's scale on each of its elements."""
    return np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)[:N, :K]


def block_dequantize(q, scale, bn, bk):
    return q.astype(np.float32) * block_expand(scale, *q.shape, bn, bk)


def quantize_per_token(x):
    """x rounded as W8A8 rounds it: per token to e4m3, then scaled back."""
    x_scale = np.abs(x).max(axis=-1, keepdims=True) / 448.0
    return (x / x_scale).astype(E4M3).astype(np.float32) * x_scale


# ---- the block-scaled matmul -------------------------------------------------------------------------------------

@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("pairs", [False, True])
def test_block_scaled_linear_equals_the_dequantized_reference(w8a8, pairs):
    """Ops.linear over e4m3 bytes with 128x128 block scales (kept expanded over rows, f32[N, ceil(K/128)]) against
    numpy's x @ (q * scale per block).T; N = 200, K = 300: ragged last blocks both ways. A gate/up pair [F, 2, K]
    (its rows interleaved, [2F, K]) too."""
    rng = np.random.default_rng(0)
    N, K, T = 200, 300, 5
    w = rng.standard_normal((N, K)).astype(np.float32) * np.exp(rng.uniform(-4, 2, (N, 1))) * 0.05
    w[:, 256:] *= 30.0   # the last (ragged) column block on a scale of its own
    x = rng.standard_normal((T, K)).astype(np.float32)
    q, scale = block_quantize(w, 128, 128)
    rows = np.repeat(scale, 128, axis=0)[:N]                                      # [N, 3]
    dequant = block_dequantize(q, scale, 128, 128)
    ref = (quantize_per_token(x) if w8a8 else x) @ dequant.T
    lp = {"w": q, "w_scale": rows}
    if pairs:   # rows 2f and 2f+1 as the pair (gate f, up f)
        lp = {"w": q.reshape(N // 2, 2, K), "w_scale": rows.reshape(N // 2, 2, -1)}
        ref = ref.reshape(T, N // 2, 2)
        ref = ref[..., 0] * np.exp(-np.logaddexp(0, -ref[..., 0])) * ref[..., 1]   # silu(gate) * up
    ops = Ops(w8a8_from_tokens=1 if w8a8 else None)
    y = np.asarray(ops.linear(x, lp, "w"))
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-5 * np.abs(ref).max())
    wrong = dict(lp, w_scale=lp["w_scale"].copy())
    wrong["w_scale"][..., 2] *= 1.01   # the ragged block's scale is read
    assert np.abs(np.asarray(ops.linear(x, wrong, "w")) - ref).max() > 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("fp8_gemv", ["plain", "fused"])
def test_block_scaled_weights_take_xla_where_the_gemv_kernel_would_run(fp8_gemv):
    """A decode-sized step whose weight the gemv kernel would multiply (per-channel scales only: jaxspec.pallas.gemv)
    runs XLA's block-scaled matmul instead, with the norm and residual around it: the numpy reference's result."""
    from jaxspec.nn.kernels import LayerWeights
    rng = np.random.default_rng(2)
    L, N, K, T = 2, 32, 256, 3
    q, scale = zip(*(block_quantize(rng.standard_normal((N, K)).astype(np.float32) / 16, 16, 128) for _ in range(L)))
    rows = np.stack([np.repeat(s, 16, axis=0) for s in scale])                          # [L, N, 2]
    g = (1 + 0.3 * rng.standard_normal((L, K))).astype(np.float32)
    x, r = rng.standard_normal((T, K)).astype(np.float32), rng.standard_normal((T, N)).astype(np.float32)
    lp = LayerWeights({"w": np.stack(q), "w_scale": rows, "g": g}, 1)
    ops = Ops(gemv=frozenset({"w"}), quantization="fp8", fp8_gemv=fp8_gemv)
    got = np.asarray(ops.linear(x, lp, "w", norm="g", eps=1e-6, residual=r))
    xn = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g[1]
    np.testing.assert_allclose(got, r + xn @ block_dequantize(q[1], scale[1], 16, 128).T, rtol=2e-5, atol=2e-5)


# ---- tiny checkpoints in each format ----------------------------------------------------------------------------

def hf_config(model: Model, quantization_config: dict) -> dict:
    c = model.config
    return {"model_type": c.arch, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "tie_word_embeddings": False,
            "max_position_embeddings": c.max_position_embeddings, "quantization_config": quantization_config}


def write_checkpoint(path, config: dict, tensors: dict):
    """config.json and model.safetensors as transformers writes them (e4m3 tensors as safetensors' F8_E4M3)."""
    import torch
    from safetensors.torch import save_file

    def to_torch(a):
        if a.dtype == E4M3:
            return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        return torch.from_numpy(np.array(a))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: to_torch(v) for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def compressed_tensors_config(strategy="channel", block=None, activations=True) -> dict:
    weights = {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": block, "observer": "minmax"}
    acts = {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts if activations else None}}}


def fp8_config(block=(128, 128)) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def projection_names(model: Model) -> list[str]:
    return [f"model.layers.{i}.{p}.weight" for i in range(model.config.num_layers) for p in PROJECTIONS]


def assert_trees_equal(a, b, scale_rtol: float = 0.0):
    """Bit for bit (e4m3 compared as bytes), the scales up to scale_rtol."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y, where = np.asarray(x), np.asarray(y), jax.tree_util.keystr(path)
        assert x.dtype == y.dtype and x.shape == y.shape, where
        if where.endswith("_scale']"):
            np.testing.assert_allclose(x, y, rtol=scale_rtol, atol=0, err_msg=where)
        else:
            np.testing.assert_array_equal(x.view(np.uint8) if x.dtype == E4M3 else x,
                                          y.view(np.uint8) if y.dtype == E4M3 else y, err_msg=where)


@pytest.fixture(scope="module")
def f32_model():
    """A tiny random Qwen2 (q/k/v biases) with the awkward shapes of DIMS, its HF-named float32 tensors beside."""
    return random_model(5, arch="qwen2", num_layers=2, **DIMS)


def test_compressed_tensors_channel_loads_the_online_quantized_weights(f32_model, tmp_path):
    """Per-channel scales as RedHatAI's FP8-dynamic models store them ([N, 1]), made by the engine's own quantizer:
    the checkpoint loads to exactly the params that quantizing the float32 checkpoint on load gives (fused q/k/v and
    gate/up with their scales' rows where the weights' go), so the same logits. One projection stored unquantized
    (as a module in `ignore` is) is quantized per row on load, as the engine would."""
    t = dict(f32_model.hf_tensors)
    kept = "model.layers.1.mlp.up_proj.weight"
    for name in projection_names(f32_model):
        if name != kept:
            q, s = quant.quantize_fp8(t[name])
            t[name], t[name + "_scale"] = np.asarray(q), np.asarray(s)[:, None]
    path = write_checkpoint(tmp_path / "ct", hf_config(f32_model, compressed_tensors_config()), t)
    model = load_hf_dir(path, "float32")
    assert model.quantization == "fp8"
    assert "compressed-tensors" in model.quantization_detail and "per output channel" in model.quantization_detail
    assert "model.layers.*.mlp.up_proj.weight" in model.quantization_detail   # said to be quantized on load
    online = quant.quantize_params(f32_model.params)
    assert_trees_equal(model.params, online)
    np.testing.assert_array_equal(model.score(IDS), Model(f32_model.config, online).score(IDS))


def test_compressed_tensors_tensor_scale_gives_the_dequantized_logits(f32_model, tmp_path):
    """One scale per tensor (strategy "tensor"), no activation quantization: each q/k/v keeps its own scale on its
    rows of the fused qkv; logits those of the dequantized float32 weights up to f32 rounding."""
    t, dequantized = dict(f32_model.hf_tensors), dict(f32_model.hf_tensors)
    for name in projection_names(f32_model):
        s = np.float32(np.abs(t[name]).max() / 448.0)
        q = (t[name] / s).astype(E4M3)
        t[name], t[name + "_scale"] = q, np.array([s], np.float32)
        dequantized[name] = q.astype(np.float32) * s
    path = write_checkpoint(tmp_path / "ct", hf_config(f32_model, compressed_tensors_config("tensor",
                                                                                           activations=False)), t)
    model = load_hf_dir(path, "float32")
    scales = np.asarray(model.params["layers"]["attention"]["qkv_proj_scale"])
    assert scales.shape == (2, 320) and len(np.unique(scales[0])) == 3   # q, k and v's own
    reference = Model(f32_model.config, params_from_hf_tensors(f32_model.config, dequantized.__getitem__))
    ref = reference.score(IDS)
    np.testing.assert_allclose(model.score(IDS), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("method, bn, bk", [("fp8", 128, 128), ("fp8", 96, 256), ("compressed-tensors", 128, 128)])
def test_block_scaled_checkpoint_gives_the_dequantized_logits(f32_model, tmp_path, method, bn, bk):
    """Block-wise scales (weight_scale_inv of Qwen3-FP8 / DeepSeek-V3, compressed-tensors' "block"), the lm_head
    quantized too (dequantized on load, as the model's dtype keeps it): the e4m3 bytes are kept, not requantized,
    and the logits (W8A16) equal those of a float32 model of the block-dequantized weights."""
    suffix = "_scale_inv" if method == "fp8" else "_scale"
    qc = fp8_config((bn, bk)) if method == "fp8" else compressed_tensors_config("block", [bn, bk])
    t, dequantized = dict(f32_model.hf_tensors), dict(f32_model.hf_tensors)
    for name in projection_names(f32_model) + ["lm_head.weight"]:
        q, s = block_quantize(t[name], bn, bk)
        t[name], t[name + suffix] = q, s
        dequantized[name] = block_dequantize(q, s, bn, bk)
    model = load_hf_dir(write_checkpoint(tmp_path / "m", hf_config(f32_model, qc), t), "float32")
    assert f"{bn}x{bk} block" in model.quantization_detail and "lm_head.weight" in model.quantization_detail
    layers = model.params["layers"]["attention"]
    assert layers["down_proj_scale"].shape == (2, 160, 3) and layers["qkv_proj_scale"].shape == (2, 320, 2)
    assert layers["gate_up_proj_scale"].shape == (2, 300, 2, 2)
    reference = Model(f32_model.config, params_from_hf_tensors(f32_model.config, dequantized.__getitem__))
    ref = reference.score(IDS)
    np.testing.assert_allclose(model.score(IDS), ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert np.abs(model.score(IDS) - Model(f32_model.config, quant.quantize_params(f32_model.params))
                  .score(IDS)).max() > 1e-3 * np.abs(ref).max()   # not what per-channel requantizing gives


def test_llm_runs_an_fp8_checkpoint_as_fp8(f32_model, tmp_path):
    """LLM(dir) of a checkpoint stored in FP8 runs it as quantization='fp8' without being asked (vLLM takes the
    checkpoint's scheme too), says where the weights came from, and decodes the tokens the same weights decode
    when quantized on load."""
    from jaxspec import LLM, SamplingParams
    t = dict(f32_model.hf_tensors)
    for name in projection_names(f32_model):
        q, s = quant.quantize_fp8(t[name])
        t[name], t[name + "_scale"] = np.asarray(q), np.asarray(s)
    path = write_checkpoint(tmp_path / "ct", hf_config(f32_model, compressed_tensors_config()), t)
    engine = dict(dtype="float32", max_num_seqs=2, max_model_len=32, max_num_batched_tokens=8, block_size=4,
                  num_kv_blocks=16, warmup=False)
    params = SamplingParams(temperature=0, max_tokens=6)
    llm = LLM(str(path), **engine)
    report = llm.stats()["quantization"]
    assert report["scheme"] == "fp8" and "from the checkpoint (compressed-tensors)" in report["weights"]
    got = [o.token_ids for o in llm.generate([[3, 17, 5], [99, 42]], params, use_tqdm=False)]
    online = LLM(Model(f32_model.config, f32_model.params), **engine, quantization="fp8")
    assert got == [o.token_ids for o in online.generate([[3, 17, 5], [99, 42]], params, use_tqdm=False)]


QWEN3_5_MOE = dict(model_type="qwen3_5_moe_text", vocab_size=128, hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=2,
                   layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=256)


def hf_shape(name: str, c) -> tuple:
    """The shape of a Qwen3.5-MoE tensor by its HF name (as transformers' save_pretrained writes them)."""
    D, hd, Hv, E = c.hidden_size, c.head_dim, c.linear_num_value_heads, c.num_experts
    qk, v = c.linear_num_key_heads * c.linear_key_head_dim, Hv * c.linear_value_head_dim
    F, S = c.moe_intermediate_size, c.shared_expert_intermediate_size
    by_suffix = {"embed_tokens.weight": (c.vocab_size, D), "lm_head.weight": (c.vocab_size, D),
                 "layernorm.weight": (D,), "model.norm.weight": (D,), "q_proj.weight": (2 * c.num_heads * hd, D),
                 "k_proj.weight": (c.num_kv_heads * hd, D), "v_proj.weight": (c.num_kv_heads * hd, D),
                 "o_proj.weight": (D, c.num_heads * hd), "q_norm.weight": (hd,), "k_norm.weight": (hd,),
                 "in_proj_qkv.weight": (2 * qk + v, D), "in_proj_z.weight": (v, D), "in_proj_b.weight": (Hv, D),
                 "in_proj_a.weight": (Hv, D), "conv1d.weight": (2 * qk + v, 1, c.linear_conv_kernel_dim),
                 "dt_bias": (Hv,), "A_log": (Hv,), "linear_attn.norm.weight": (c.linear_value_head_dim,),
                 "out_proj.weight": (D, v), "mlp.gate.weight": (E, D), "shared_expert_gate.weight": (1, D),
                 "shared_expert.down_proj.weight": (D, S), "shared_expert.gate_proj.weight": (S, D),
                 "shared_expert.up_proj.weight": (S, D), "down_proj.weight": (D, F), "gate_proj.weight": (F, D),
                 "up_proj.weight": (F, D)}
    return next(shape for suffix, shape in by_suffix.items() if name.endswith(suffix))


def test_moe_hybrid_checkpoint_keeps_its_layout(tmp_path):
    """A tiny Qwen3.5-MoE stored as Qwen's FP8 releases store it: every projection e4m3 with per-row scales
    (compressed-tensors channel), the Gated DeltaNet's in_proj_a/b, routers and gates kept in float32. Its gated q
    (q and gate rows interleaved per head), the in_proj [qkv | z | b | a] mixing e4m3 and float parts, the shared
    expert and the experts (the grouped matmul's layout, dequantized and quantized per channel again) load to the
    params of quantizing its dequantized weights on load, so the same logits."""
    from jaxspec.models.config import ModelConfig
    from jaxspec.models.weights import hf_tensor_names
    config = ModelConfig.from_hf(QWEN3_5_MOE)
    rng = np.random.default_rng(3)
    t = {}
    for name in hf_tensor_names(config):
        shape = hf_shape(name, config)
        t[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1]) if len(shape) > 1 and "conv1d" not in name
                   else 1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    kept = ("embed_tokens", "lm_head", "in_proj_a", "in_proj_b", "mlp.gate.", "shared_expert_gate")
    dequantized = dict(t)
    for name in [n for n, v in t.items() if v.ndim == 2 and not any(k in n for k in kept)]:
        q, s = (np.asarray(a) for a in quant.quantize_fp8(t[name]))
        t[name], t[name + "_scale"] = q, s[:, None]
        dequantized[name] = q.astype(np.float32) * s[:, None]
    hf = {**QWEN3_5_MOE, "quantization_config": compressed_tensors_config()}
    model = load_hf_dir(write_checkpoint(tmp_path / "fp8", hf, t), "float32")
    for part in ("in_proj_a", "in_proj_b"):
        assert f"model.layers.*.linear_attn.{part}.weight" in model.quantization_detail
    assert "again: model.layers.*.mlp.experts.*.down_proj.weight" in model.quantization_detail
    online = quant.quantize_params(params_from_hf_tensors(model.config, dequantized.__getitem__))
    assert_trees_equal(model.params, online, scale_rtol=2.5e-7)   # requantized: max(q) * s / 448 may move s by 1 ulp
    ref = Model(model.config, online).score(IDS)
    np.testing.assert_allclose(model.score(IDS), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


# ---- refused by name ----------------------------------------------------------------------------------------------

def refused(qc) -> str:
    from jaxspec.models.config import ModelConfig
    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "quantization_config": qc}
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(hf)
    return str(e.value)


def with_group(**changes) -> dict:
    qc = compressed_tensors_config()
    group = qc["config_groups"]["group_0"]
    for key, value in changes.items():
        part, field = key.split("__")
        group[part][field] = value
    return qc


@pytest.mark.parametrize("qc, says", [
    (with_group(input_activations__dynamic=False), "input_activations.dynamic=False is not supported.*static"),
    (with_group(weights__strategy="group"), "weights.strategy='group' is not supported.*'channel', 'tensor'"),
    (with_group(weights__num_bits=4), "weights.num_bits=4 is not supported.*8"),
    (with_group(weights__type="int"), "weights.type='int' is not supported.*'float'"),
    ({**compressed_tensors_config(), "format": "pack-quantized"}, "format='pack-quantized' is not supported"),
    ({**compressed_tensors_config(), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme=.* is not supported"),
    ({**fp8_config(), "activation_scheme": "static"}, "activation_scheme='static' is not supported.*'dynamic'"),
    (fp8_config((64, 64)), r"weight_block_size=\[64, 64\] is not supported.*multiple of 128"),
    ({**fp8_config(), "fmt": "e5m2"}, "fmt='e5m2' is not supported.*'e4m3'"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq' is not supported; supported: 'compressed-tensors'"),
    ({"quant_method": "awq"}, "quant_method='awq' is not supported.*'fp8'"),
    ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes' is not supported"),
    ({"quant_method": "mxfp4"}, "quant_method='mxfp4' is not supported"),
])
def test_unsupported_quantization_configs_are_refused_by_name(qc, says):
    import re
    assert re.search(says, refused(qc)), refused(qc)


def test_malformed_fp8_tensors_are_refused_by_name(f32_model, tmp_path):
    """A block scale of the wrong shape, a missing scale, and an e4m3 tensor in a checkpoint that does not say it
    is quantized: each a CorruptModelFileError naming the tensor."""
    t = dict(f32_model.hf_tensors)
    for name in projection_names(f32_model):
        t[name], t[name + "_scale_inv"] = block_quantize(t[name], 128, 128)
    down = "model.layers.0.mlp.down_proj.weight"
    bad = dict(t, **{down + "_scale_inv": t[down + "_scale_inv"].T.copy()})
    config = hf_config(f32_model, fp8_config())
    with pytest.raises(CorruptModelFileError, match=f"'{down}_scale_inv' has shape \\[3, 2\\].*needs \\[2, 3\\]"):
        load_hf_dir(write_checkpoint(tmp_path / "transposed", config, bad), "float32")
    k = "model.layers.1.self_attn.k_proj.weight"
    missing = {n: v for n, v in t.items() if n != k + "_scale_inv"}
    with pytest.raises(CorruptModelFileError, match=f"no '{k}_scale_inv'"):
        load_hf_dir(write_checkpoint(tmp_path / "missing", config, missing), "float32")
    path = write_checkpoint(tmp_path / "unsaid", {k: v for k, v in config.items() if k != "quantization_config"}, t)
    with pytest.raises(CorruptModelFileError, match="float8_e4m3fn"):
        load_hf_dir(path, "float32")
    assert SafetensorsDir(path).get_raw(down).dtype == E4M3
