"""No silent error: a config (HF config.json, GGUF metadata, a checkpoint's tensors) that asks for something jaxspec
does not implement is refused at load, naming the field, its value and what is supported; what jaxspec does implement
(or what transformers itself ignores) keeps loading. Pure config dicts and tiny headers: no model weights."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from gguf_testing import write_gguf

from jaxspec.models.config import ModelConfig
from jaxspec.models.errors import UnsupportedModelError
from jaxspec.models.gguf_loader import config_from_gguf, open_gguf
from jaxspec.models.hf_loader import refuse_unread_tensors
from jaxspec.models.weights import hf_tensor_names

# The published config.json files (trimmed of keys jaxspec never reads).
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000}
MISTRAL_7B_INSTRUCT_V02 = {**MISTRAL_7B_V01, "rope_theta": 1000000.0, "sliding_window": None}
QWEN25_05B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
LLAMA31_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 128256}
TINY_QWEN3_NEXT = {
    "model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "partial_rotary_factor": 0.25,
    "full_attention_interval": 4, "rope_scaling": None, "rope_theta": 10000000}
# Qwen2.5's long-context recipe (its model cards: add this to config.json past 32768 tokens)
QWEN25_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}


def refused(hf: dict, *patterns: str) -> str:
    """The UnsupportedModelError message for `hf`, checked to name each of `patterns` (regexes)."""
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf(hf)
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    return message


# ---- sliding windows ------------------------------------------------------------------------------------------

def test_mistral_sliding_window_is_every_layers_window_unless_null_or_never_biting():
    assert ModelConfig.from_hf(MISTRAL_7B_V01).sliding_window == 4096
    # absent: transformers' MistralConfig default, 4096, which applies
    assert ModelConfig.from_hf({k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"}).sliding_window \
        == 4096
    assert ModelConfig.from_hf(MISTRAL_7B_INSTRUCT_V02).sliding_window is None
    assert ModelConfig.from_hf({**MISTRAL_7B_V01, "sliding_window": 32768}).sliding_window is None   # >= positions
    assert ModelConfig.from_hf(LLAMA31_8B_INSTRUCT).sliding_window is None


def test_qwen_sliding_window_only_when_use_sliding_window_and_it_reaches_a_layer():
    def window(hf):
        c = ModelConfig.from_hf(hf)
        return c.sliding_window, c.sliding_layers
    assert window(QWEN25_05B_INSTRUCT) == (None, None)                        # use_sliding_window false: unused
    on = {**QWEN25_05B_INSTRUCT, "use_sliding_window": True, "sliding_window": 4096}
    assert window(on) == (4096, (False,) * 21 + (True,) * 3)                  # layers >= max_window_layers (21)
    assert window({**on, "max_window_layers": 24}) == (None, None)            # no layer at or past 24
    assert window({**on, "sliding_window": 32768}) == (None, None)            # never bites
    full, one_sliding = ["full_attention"] * 24, ["full_attention"] * 23 + ["sliding_attention"]
    assert window({**on, "layer_types": full}) == (None, None)               # layer_types over max_window_layers
    assert window({**on, "layer_types": one_sliding}) == (4096, (False,) * 23 + (True,))
    assert window({**QWEN25_05B_INSTRUCT, "layer_types": one_sliding}) == (None, None)   # use_sliding_window false
    assert window({**QWEN3_8B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0}) \
        == (4096, None)                                                       # every layer
    assert ModelConfig.from_hf(QWEN3_8B).arch == "qwen3"


def test_qwen3_moe_window_is_every_layers_and_per_layer_tables_need_one_layer_kind():
    """Qwen3-MoE's use_sliding_window windows every layer, its dense ones (mlp_only_layers) too, as transformers does
    (it was dropped before: a silent wrong decode past the window). A layer kind runs its layers by their index
    among its own kind, so a per-layer table of windows (or of Gemma 3's local rotary) with several kinds is refused."""
    moe = {**QWEN3_8B, "model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2,
           "mlp_only_layers": [0]}
    c = ModelConfig.from_hf(moe)
    assert (c.sliding_window, c.sliding_layers) == (64, None) and len(set(c.layer_types)) == 2
    assert ModelConfig.from_hf({**moe, "use_sliding_window": False}).sliding_window is None
    with pytest.raises(UnsupportedModelError, match="sliding_layers with layers of several kinds"):
        dataclasses.replace(c, sliding_layers=(False, False, True, True))


def test_unknown_or_sliding_layer_types_of_dense_models_are_refused():
    refused({**LLAMA31_8B_INSTRUCT, "layer_types": ["chunked_attention"] * 32}, r"layer_types \['chunked_attention'\]")
    sliding = {**LLAMA31_8B_INSTRUCT, "layer_types": ["sliding_attention", "full_attention"] * 16}
    refused({**sliding, "sliding_window": 4096}, "sliding_window=4096", "layer_types marks")
    ModelConfig.from_hf({**LLAMA31_8B_INSTRUCT, "sliding_window": 4096})    # transformers' Llama has no window


# ---- rope -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", [QWEN25_YARN, {"type": "dynamic", "factor": 2.0},
                                     {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}],
                         ids=lambda s: s.get("rope_type", s.get("type")))
def test_unimplemented_rope_scaling_types_are_refused(scaling):
    kind = scaling.get("rope_type", scaling.get("type"))
    refused({**QWEN25_05B_INSTRUCT, "rope_scaling": scaling}, f"rope scaling type '{kind}'", "rope_scaling=",
            "supported: default, llama3")
    # transformers >= 5 spelling
    refused({**QWEN3_8B, "rope_scaling": None, "rope_parameters": {**scaling, "rope_theta": 1e6}},
            f"rope scaling type '{kind}'", "rope_parameters=")


def test_rope_scaling_without_a_type_or_with_missing_llama3_keys_is_refused():
    refused({**LLAMA31_8B_INSTRUCT, "rope_scaling": {"factor": 8.0}}, "rope_scaling=.*names no rope_type", "factor")
    llama3 = dict(LLAMA31_8B_INSTRUCT["rope_scaling"])
    del llama3["low_freq_factor"]
    refused({**LLAMA31_8B_INSTRUCT, "rope_scaling": llama3}, "'llama3' lacks low_freq_factor")


def test_implemented_rope_keeps_loading():
    config = ModelConfig.from_hf(LLAMA31_8B_INSTRUCT)
    assert config.rope_scaling_dict == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192}
    v5 = {**QWEN3_8B, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert ModelConfig.from_hf(v5).rope_scaling is None and ModelConfig.from_hf(v5).rope_theta == 1e6
    assert ModelConfig.from_hf({**QWEN3_8B, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    hybrid = ModelConfig.from_hf(TINY_QWEN3_NEXT)
    assert hybrid.rotary_dim == 2 and hybrid.rope_scaling is None


def test_partial_rotary_and_hybrid_rope_scaling_are_refused():
    refused({**LLAMA31_8B_INSTRUCT, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5", "supported: 1.0")
    refused({**QWEN3_8B, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor=0.5")
    refused({**TINY_QWEN3_NEXT, "rope_scaling": LLAMA31_8B_INSTRUCT["rope_scaling"]},
            "rope_scaling type 'llama3' is not supported for qwen3_next", "supported: rope_type 'default'")


# ---- biases, activation, soft-capping -------------------------------------------------------------------------

def test_biases_jaxspec_would_ignore_are_refused():
    refused({**LLAMA31_8B_INSTRUCT, "attention_bias": True}, "attention_bias=true", "model_type='llama'",
            "supported: attention_bias false")
    refused({**QWEN3_8B, "attention_bias": True}, "attention_bias=true", "model_type='qwen3'")
    refused({**LLAMA31_8B_INSTRUCT, "mlp_bias": True}, "mlp_bias=true", "supported: mlp_bias false")
    ModelConfig.from_hf({**QWEN25_05B_INSTRUCT, "attention_bias": True})   # Qwen2: q/k/v biases, implemented


def test_activation_and_soft_capping_are_refused():
    refused({**MISTRAL_7B_INSTRUCT_V02, "hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'",
            "supported: silu, swish")
    ModelConfig.from_hf({**MISTRAL_7B_INSTRUCT_V02, "hidden_act": "swish"})
    for field, value in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        refused({**LLAMA31_8B_INSTRUCT, field: value}, f"{field}={value}", f"supported: {field} null")
        ModelConfig.from_hf({**LLAMA31_8B_INSTRUCT, field: None})


# ---- checkpoint tensors the config's model would not read -----------------------------------------------------

def tiny(hf: dict) -> ModelConfig:
    return ModelConfig.from_hf({**hf, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32})


def test_unread_biases_sinks_and_norms_in_a_checkpoint_are_refused():
    llama = tiny(LLAMA31_8B_INSTRUCT)
    names = hf_tensor_names(llama)
    refuse_unread_tensors(llama, names + ["model.layers.0.self_attn.rotary_emb.inv_freq"])   # harmless: recomputed
    for extra in ("model.layers.1.self_attn.q_proj.bias", "model.layers.0.self_attn.o_proj.bias",
                  "model.layers.0.mlp.down_proj.bias", "model.layers.0.self_attn.sinks",
                  "model.layers.0.pre_feedforward_layernorm.weight"):
        with pytest.raises(UnsupportedModelError, match=rf"tensor '{extra}'.*would be ignored.*supported: .*"
                                                        r"input_layernorm\.weight"):
            refuse_unread_tensors(llama, names + [extra])
    qwen2 = tiny(QWEN25_05B_INSTRUCT)
    refuse_unread_tensors(qwen2, hf_tensor_names(qwen2))
    assert "model.layers.0.self_attn.q_proj.bias" in hf_tensor_names(qwen2)
    with pytest.raises(UnsupportedModelError, match="o_proj.bias"):
        refuse_unread_tensors(qwen2, hf_tensor_names(qwen2) + ["model.layers.0.self_attn.o_proj.bias"])
    # a vision-language checkpoint's text tensors are under model.language_model.*
    with pytest.raises(UnsupportedModelError, match="language_model.layers.0.self_attn.sinks"):
        refuse_unread_tensors(llama, ["model.language_model.layers.0.self_attn.sinks"])


# ---- GGUF metadata --------------------------------------------------------------------------------------------

def tiny_gguf(path, arch: str = "llama", meta: dict | None = None, tensors: tuple[str, ...] = ()):
    """A GGUF header with just what config_from_gguf reads (head_dim 16, context 64) and 1-element tensors."""
    meta = {f"{arch}.context_length": 64, f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 128,
            f"{arch}.block_count": 2, f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
            f"{arch}.rope.dimension_count": 16, **(meta or {})}
    arrays = {"token_embd.weight": (np.zeros((32, 64), np.float32), None)}
    arrays.update({name: (np.zeros(4, np.float32), None) for name in tensors})
    return config_from_gguf(open_gguf(write_gguf(path, arch, arrays, meta)))


def test_gguf_sliding_window_soft_capping_experts_partial_rotary_are_refused(tmp_path):
    assert tiny_gguf(tmp_path / "plain.gguf").arch == "llama"
    assert tiny_gguf(tmp_path / "big.gguf", meta={"llama.attention.sliding_window": 64}).arch == "llama"
    assert tiny_gguf(tmp_path / "off.gguf", meta={"llama.attention.sliding_window": 0}).arch == "llama"
    assert tiny_gguf(tmp_path / "none.gguf", meta={"llama.attention.sliding_window": 16,
                                                  "llama.attention.sliding_window_pattern": [False, False]})
    cases = {"llama.attention.sliding_window": (16, r"sliding_window=16 .*at least llama\.context_length=64"),
             "llama.final_logit_softcapping": (30.0, "final_logit_softcapping=30.0"),
             "llama.attn_logit_softcapping": (50.0, "attn_logit_softcapping=50.0"),
             "llama.expert_count": (8, "expert_count=8"),
             "llama.rope.dimension_count": (8, r"rope\.dimension_count=8 .*supported: the head dimension, 16")}
    for i, (key, (value, pattern)) in enumerate(cases.items()):
        with pytest.raises(UnsupportedModelError, match=pattern):
            tiny_gguf(tmp_path / f"{i}.gguf", meta={key: value})
    with pytest.raises(UnsupportedModelError, match=r"rope\.dimension_count=8"):
        tiny_gguf(tmp_path / "q.gguf", "qwen2", meta={"qwen2.rope.dimension_count": 8})


def test_gguf_block_tensors_the_model_would_not_read_are_refused(tmp_path):
    assert tiny_gguf(tmp_path / "qwen2.gguf", "qwen2", tensors=("blk.0.attn_q.bias",)).arch == "qwen2"
    for i, name in enumerate(("blk.0.attn_q.bias", "blk.1.attn_output.bias", "blk.0.attn_sinks.weight",
                              "blk.0.post_attention_norm.weight")):
        with pytest.raises(UnsupportedModelError, match=rf"GGUF tensor '{name}' .*would be ignored.*attn_norm"):
            tiny_gguf(tmp_path / f"{i}.gguf", tensors=(name,))


def test_hybrid_attention_bias_is_refused():
    refused({**TINY_QWEN3_NEXT, "attention_bias": True}, "attention_bias=true", "model_type='qwen3_next'")
    refused({**TINY_QWEN3_NEXT, "model_type": "qwen3_5_text", "attention_bias": True}, "attention_bias=true")
