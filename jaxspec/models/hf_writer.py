"""A model's params written back in the HF layout (config.json + model.safetensors + its tokenizer's files), which
`load_hf_dir` reads back to the same params: the inverse of `params_from_hf_tensors` for the families whose layers
are all of the `attention` kind (Llama, Mistral, Qwen2, Qwen3). What jaxspec.train.pard writes a fine-tuned draft
model with.

The config.json is the source directory's own (the model was loaded from it: `Model.source`) with `extra` keys added,
or, for a model that has none (a GGUF file, a model built in memory), one written from its ModelConfig and checked to
read back to it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np

from jaxspec.models.families.tensors import group_qkv, interleave_gate_up

# The one layer kind written: its HF tensors and their combines are the Llama-like families' (families/llama.py)
WRITABLE_LAYER_KINDS = ("attention",)
# Files of a source directory never copied: the weights (written here) and the config (rewritten here)
NOT_COPIED = ("config.json", "model.safetensors.index.json")


def split_weight(config, rule, value: np.ndarray) -> dict[str, np.ndarray]:
    """One declared weight -> {HF name (within its layer): tensor}: what `rule` (a TensorRule) assembled it from."""
    names = rule.names(config)
    if rule.combine is None:
        (name,) = names
        return {name: value}
    if rule.combine is group_qkv:   # rows grouped per kv head: [its G q heads, its k, its v] (see group_qkv)
        Hkv, hd = config.num_kv_heads, config.head_dim
        G = config.num_heads // Hkv
        grouped = value.reshape(Hkv, G + 2, hd, *value.shape[1:])
        q, k, v = (grouped[:, :G], grouped[:, G], grouped[:, G + 1])
        return {names[0]: q.reshape(Hkv * G * hd, *value.shape[1:]), names[1]: k.reshape(Hkv * hd, *value.shape[1:]),
                names[2]: v.reshape(Hkv * hd, *value.shape[1:])}
    if rule.combine is interleave_gate_up:   # [F, 2, D]
        return {names[0]: value[:, 0], names[1]: value[:, 1]}
    raise ValueError(f"cannot write HF tensors {', '.join(names)} of a {config.arch} model (combined by "
                     f"{getattr(rule.combine, '__name__', rule.combine)!r}); supported: models whose layers are all "
                     f"{', '.join(WRITABLE_LAYER_KINDS)} (Llama, Mistral, Qwen2, Qwen3)")


def check_writable(config) -> None:
    """Refuses by name a model whose layers this writer cannot write back."""
    from jaxspec.nn.decoder import Decoder
    kinds = sorted(set(Decoder(config).layer_types) - set(WRITABLE_LAYER_KINDS))
    if kinds:
        raise ValueError(f"a {config.arch} model with layer kinds {', '.join(kinds)} cannot be written in the HF "
                         f"layout here; supported: models whose layers are all {', '.join(WRITABLE_LAYER_KINDS)} "
                         "(Llama, Mistral, Qwen2, Qwen3)")
    if config.rope_freq_factors is not None:
        raise ValueError("a model with rope_freq_factors (GGUF rope_freqs) cannot be written in the HF layout: no "
                         "config.json field holds them; load the model from its HF directory instead")


def hf_tensors(config, params: dict) -> dict[str, np.ndarray]:
    """The HF-named float32 tensors of `params` (Decoder.param_schema's layout, unquantized)."""
    from jaxspec.models.weights import layer_rule, top_rule
    check_writable(config)
    host = jax.device_get(params)
    tensors = {}
    for key in ("embed", "final_norm", "lm_head"):
        if key in host:
            tensors.update(split_weight(config, top_rule(config, key), np.asarray(host[key], np.float32)))
    for kind, weights in host["layers"].items():
        for name, stacked in weights.items():
            rule = layer_rule(config, kind, name)
            for i in range(stacked.shape[0]):   # every layer of the one writable kind: layer i is model.layers.i
                for hf_name, t in split_weight(config, rule, np.asarray(stacked[i], np.float32)).items():
                    tensors[f"model.layers.{i}.{hf_name}"] = t
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def config_json(config) -> dict:
    """A config.json for a model that has none of its own (built from its ModelConfig), checked to read back to
    the same ModelConfig."""
    import dataclasses

    from jaxspec.models.config import ModelConfig
    from jaxspec.models.heads import head_rope_scaling
    c = config
    hf = {"architectures": [f"{c.arch.capitalize()}ForCausalLM"], "model_type": c.arch, "vocab_size": c.vocab_size,
          "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
          "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
          "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
          "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
          "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids), "torch_dtype": "float32"}
    if c.sliding_window is not None:
        hf.update(sliding_window=c.sliding_window, use_sliding_window=True)
    rope_scaling = head_rope_scaling(c)
    if rope_scaling is not None:
        hf["rope_scaling"] = rope_scaling
    try:
        back = ModelConfig.from_hf(hf)
    except Exception as e:   # noqa: BLE001 (any refusal: the same answer)
        back = e
    if not isinstance(back, ModelConfig) or dataclasses.replace(back, eos_token_ids=c.eos_token_ids) != c:
        raise ValueError(f"this {c.arch} model's config cannot be written as a config.json that reads back to it; "
                         "load the model from its HF directory (whose config.json is then kept)")
    return hf


def save_hf_model(path, config, params: dict, *, source: str | os.PathLike | None = None, tokenizer=None,
                  extra: dict | None = None) -> Path:
    """Writes `params` to `path` as config.json + model.safetensors (float32) + the tokenizer's files, loadable
    by jaxspec.models.loader.load_model: `source` (an HF directory the model was loaded from): its config.json
    (with `extra` added) and every file but its weights copied; otherwise a config.json from `config` and the
    `tokenizer`'s files when it has one."""
    from safetensors.numpy import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(config, params)
    source = Path(source) if source is not None and (Path(source) / "config.json").is_file() else None
    if source is not None:
        hf = json.loads((source / "config.json").read_text())
        hf["torch_dtype"] = "float32"
        for f in sorted(source.iterdir()):
            if f.is_file() and f.name not in NOT_COPIED and f.suffix != ".safetensors":
                shutil.copyfile(f, path / f.name)
    else:
        hf = config_json(config)
        if tokenizer is not None:
            tokenizer.hf.save_pretrained(str(path))
    hf.update(extra or {})
    tmp = path / "model.safetensors.tmp"   # written whole, then renamed: a reader never sees half a file
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(hf, indent=1))
    return path
