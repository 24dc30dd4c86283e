"""Randomly initialised EAGLE heads in the published HF layouts (config.json + model.safetensors), sized for
a given (tiny) target: what `jaxspec.decode.drafters.eagle` loads, since real heads are not available offline.

EAGLE-1 (the yuhuili/EAGLE-LLaMA3-Instruct-8B layout): fc.weight [D, 2D] (+ fc.bias), layers.{i}.* with no
input_layernorm in layer 0, embed_tokens.weight (unused: the target's embedding is shared).
EAGLE-3 (the yuhuili/EAGLE3-LLaMA3.1-Instruct-8B layout): fc.weight [D, 3D], midlayer.* with q/k/v over 2D,
midlayer.hidden_norm, norm.weight, lm_head.weight [draft_vocab, D], d2t (int64) and t2d (bool).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def _head_config(target_config, num_layers: int, **extra) -> dict:
    c = target_config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": 2 * c.hidden_size, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": num_layers, "rms_norm_eps": 1e-5,
            "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "max_position_embeddings": 2048,
            "torch_dtype": "float32", **extra}


def _layer(rng, prefix: str, cfg: dict, attn_in: int, with_input_norm: bool) -> dict:
    D, F = cfg["hidden_size"], cfg["intermediate_size"]
    hd = D // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    out = {f"{prefix}self_attn.q_proj.weight": mat(q, attn_in), f"{prefix}self_attn.k_proj.weight": mat(kv, attn_in),
           f"{prefix}self_attn.v_proj.weight": mat(kv, attn_in), f"{prefix}self_attn.o_proj.weight": mat(D, q),
           f"{prefix}mlp.gate_proj.weight": mat(F, D), f"{prefix}mlp.up_proj.weight": mat(F, D),
           f"{prefix}mlp.down_proj.weight": mat(D, F),
           f"{prefix}post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)}
    if with_input_norm:
        out[f"{prefix}input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    return out


def write_eagle1_head(path, target_config, seed: int = 0, num_layers: int = 1, fc_bias: bool = True) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cfg = _head_config(target_config, num_layers, bias=fc_bias)
    D = cfg["hidden_size"]
    tensors = {"fc.weight": (rng.standard_normal((D, 2 * D)) / np.sqrt(2 * D)).astype(np.float32),
               "embed_tokens.weight": rng.standard_normal((cfg["vocab_size"], D)).astype(np.float32)}
    if fc_bias:
        tensors["fc.bias"] = (0.1 * rng.standard_normal(D)).astype(np.float32)
    for i in range(num_layers):
        tensors.update(_layer(rng, f"layers.{i}.", cfg, D, with_input_norm=i > 0))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def write_eagle3_head(path, target_config, seed: int = 0, draft_vocab_size: int | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    V = target_config.vocab_size
    Vd = draft_vocab_size or V // 2
    cfg = _head_config(target_config, 1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=Vd)
    D = cfg["hidden_size"]
    draft_to_target = np.sort(rng.choice(V, Vd, replace=False))
    t2d = np.zeros(V, bool)
    t2d[draft_to_target] = True
    tensors = {"fc.weight": (rng.standard_normal((D, 3 * D)) / np.sqrt(3 * D)).astype(np.float32),
               "midlayer.hidden_norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
               "norm.weight": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
               "lm_head.weight": (2 * rng.standard_normal((Vd, D)) / np.sqrt(D)).astype(np.float32),
               "d2t": (draft_to_target - np.arange(Vd)).astype(np.int64), "t2d": t2d}
    tensors.update(_layer(rng, "midlayer.", cfg, 2 * D, with_input_norm=True))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path
