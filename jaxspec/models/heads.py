"""Draft heads on disk: what the drafters read and the trainer writes, in one place.

  EAGLE-1 / EAGLE-3 heads: a directory of config.json + safetensors in the published HF layouts (the EAGLE
      repository's; the aux-layer ids of vLLM's and SGLang / SpecForge's configs), read by `load_eagle_head`;
      `save_head` writes the EAGLE-3 layout that jaxspec.train produces and the same loader reads back.
  MTP heads: the `mtp.*` tensors a Qwen3-Next / Qwen3.5 checkpoint ships beside the model (`load_mtp_head`).
  Draft models: a smaller model of the target's vocabulary, loaded as any model is (`load_draft_model`).

Each loader returns the head's module (jaxspec.nn.eagle.EagleHead, jaxspec.nn.mtp.MtpHead) or model and its
declared params; the drafters (jaxspec.decode.drafters) are built from those and never open a file themselves.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import DRAFT_HEAD_ROPE_TYPES, ModelConfig
from jaxspec.models.weights import layer_sources, plus_one, read_layer_weight, read_top_weight
from jaxspec.nn.eagle import EagleHead
from jaxspec.nn.mtp import MTP_LAYER_KIND, MtpHead

if TYPE_CHECKING:   # imported where a file is read: an engine of random weights reads none (nor needs gguf)
    from jaxspec.models.hf_loader import SafetensorsDir

# ---- EAGLE-1 / EAGLE-3 heads ---------------------------------------------------------------------------------

EAGLE3_LAYER_PREFIX = "midlayer."   # EAGLE-3's one layer; EAGLE-1's are layers.{i}.
# The head's params outside its layers and their HF tensor names, read and written alike (each head reads those
# its schema declares: EAGLE-1 fc [+ fc_bias] [+ norm]; EAGLE-3 fc, hidden_norm, norm, lm_head [+ the placeholders
# of a parallel head])
EAGLE_TOP_TENSORS = {"fc": "fc.weight", "fc_bias": "fc.bias", "norm": "norm.weight",
                     "hidden_norm": EAGLE3_LAYER_PREFIX + "hidden_norm.weight", "lm_head": "lm_head.weight",
                     "mask_embed": "mask_embed", "mask_hidden": "mask_hidden"}


def read_head_dir(path) -> tuple[dict, SafetensorsDir]:
    """(config.json as a dict, its model_type "llama" unless it names one; the directory's tensors) of an EAGLE
    head directory. A FileNotFoundError names the path and what it lacks."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"EAGLE head {str(path)!r} is not a directory (expected config.json + "
                                "model.safetensors in the published HF layout)")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"EAGLE head directory {str(path)!r} has no config.json")
    hf = json.loads(config_path.read_text())
    from jaxspec.models.hf_loader import SafetensorsDir
    return {"model_type": "llama", **hf}, SafetensorsDir(path)


def read_head_tensor(tensors: SafetensorsDir, name: str, shape: tuple, dtype) -> np.ndarray:
    """One tensor of an EAGLE head, checked to have the shape its schema declares, cast to dtype."""
    if name not in tensors:
        raise ValueError(f"the EAGLE head has no tensor {name!r}")
    value = np.asarray(tensors.get_tensor(name))
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"EAGLE head tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    return value.astype(dtype)


def draft_to_target_ids(tensors: SafetensorsDir, draft_vocab: int, vocab_size: int) -> np.ndarray:
    """The target id of each draft id (i32 [draft_vocab]) from an EAGLE-3 head's `d2t` (the offset of each draft
    id's target id); without one, the draft vocabulary must be the target's own."""
    if "d2t" in tensors:
        d2t = np.asarray(tensors.get_tensor("d2t")).astype(np.int64)
        if d2t.shape != (draft_vocab,):
            raise ValueError(f"EAGLE-3 d2t has shape {d2t.shape}, expected ({draft_vocab},)")
        target_ids = np.arange(draft_vocab) + d2t
    elif draft_vocab == vocab_size:
        target_ids = np.arange(draft_vocab)
    else:
        raise ValueError("the EAGLE-3 head has a draft vocabulary smaller than the target's but no 'd2t' map")
    if target_ids.min() < 0 or target_ids.max() >= vocab_size or len(set(target_ids.tolist())) != draft_vocab:
        raise ValueError(f"EAGLE-3 d2t maps draft ids outside the target vocabulary [0, {vocab_size}) or "
                         "maps two draft ids to one target id")
    return target_ids.astype(np.int32)


def check_aux_layers(hf: dict, head: EagleHead):
    """A head config may name the target layers it reads: top level in vLLM's numbering (id j: the output of
    layer j-1), under "eagle_config" in SGLang / SpecForge's (id j: the output of layer j). The engine reads
    the default layers only (outputs of 1, L//2-1 and L-4), which both projects use when no ids are given."""
    ours = list(head.aux_layers)
    for ids, offset, where in ((hf.get("eagle_aux_hidden_state_layer_ids"), 1, "eagle_aux_hidden_state_layer_ids"),
                               ((hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), 0,
                                "eagle_config.eagle_aux_hidden_state_layer_ids")):
        if ids and [int(i) - offset for i in ids] != ours:
            raise ValueError(f"the EAGLE-3 head's {where}={list(ids)} names other target layers than the ones "
                             f"jaxspec feeds it (the outputs of layers {ours}, i.e. {where}="
                             f"{[i + offset for i in ours]}); heads trained on other layers are not supported")


def load_eagle_head(path, target_config, dtype) -> tuple[EagleHead, dict]:
    """(EagleHead, its declared params) from a head directory in the published layout (EAGLE-1: fc [+ bias],
    layers.{i}.*, optional norm; EAGLE-3: fc, midlayer.* with hidden_norm, norm, lm_head, d2t)."""
    hf, tensors = read_head_dir(path)
    config = ModelConfig.from_hf(hf, draft_head=True)   # its rotary: its target's global one, any family's
    tc = target_config
    D = tc.hidden_size
    if config.hidden_size != D:
        raise ValueError(f"the EAGLE head has hidden_size={config.hidden_size} but the target has {D}: "
                         "the head was trained for another target model")
    if config.vocab_size != tc.vocab_size:
        raise ValueError(f"the EAGLE head has vocab_size={config.vocab_size} but the target has {tc.vocab_size}: "
                         "it must share the target's tokenizer and vocabulary")
    eagle3 = EAGLE3_LAYER_PREFIX + "self_attn.q_proj.weight" in tensors
    parallel = eagle3 and "mask_hidden" in tensors
    if bool(hf.get("parallel_drafting")) != parallel:
        raise ValueError(f"the EAGLE head's config says parallel_drafting={hf.get('parallel_drafting')!r} but its "
                         f"tensors {'have' if parallel else 'lack'} the placeholders 'mask_embed' and 'mask_hidden'")
    head = EagleHead("eagle3" if eagle3 else "eagle", config, tc, fc_bias="fc.bias" in tensors,
                     final_norm="norm.weight" in tensors and not eagle3,
                     draft_vocab_size=int(hf.get("draft_vocab_size", config.vocab_size)) if eagle3 else 0,
                     parallel=parallel)
    if eagle3:
        check_aux_layers(hf, head)
    schema = head.param_schema()
    np_dtype = np.dtype(dtype)
    get = tensors.get_tensor
    layers = {name: np.empty(spec.shape, np_dtype) for name, spec in schema["layers"]["attention"].items()}
    prefixes = [EAGLE3_LAYER_PREFIX] if eagle3 else [f"layers.{i}." for i in range(config.num_layers)]
    for i, prefix in enumerate(prefixes):
        for name, buf in layers.items():
            value = read_layer_weight(get, "attention", name, prefix, config, buf.shape[1:], np_dtype,
                                      optional=name == "attn_norm" and not eagle3)
            buf[i] = 1 if value is None else value    # EAGLE-1's first layer has no input norm (and uses none)
    params = {"layers": {"attention": layers}}
    if eagle3 and not all(prefix + "input_layernorm.weight" in tensors for prefix in prefixes):
        raise ValueError(f"the EAGLE-3 head has no tensor '{EAGLE3_LAYER_PREFIX}input_layernorm.weight'")
    for key, name in EAGLE_TOP_TENSORS.items():
        if key in schema:
            params[key] = read_head_tensor(tensors, name, schema[key].shape, np_dtype)
    if eagle3:
        params["draft_to_target"] = draft_to_target_ids(tensors, head.draft_vocab_size, tc.vocab_size)
    return head, jax.tree_util.tree_map(jnp.asarray, params)


def head_rope_scaling(c: ModelConfig) -> dict | None:
    """The head's rope scaling as its config.json's `rope_scaling`, its type named (the loaders require one), each
    field as the head loader (ModelConfig.from_hf, draft_head) reads it back to the same ModelConfig.rope_scaling:
    linear (Gemma 3's global layers), llama3 (held without a type), yarn. None: plain rope."""
    written = tuple(t for t in DRAFT_HEAD_ROPE_TYPES if t != "default")
    if c.rope_freq_factors is not None:   # a GGUF target's per-frequency divisors: no config.json field holds them
        raise ValueError(f"a head with rope_freq_factors (GGUF rope_freqs) cannot be written in the HF layout; "
                         f"supported: rope_scaling of type {', '.join(written)}, or none")
    scaling = c.rope_scaling_dict
    if not scaling:
        return None
    if c.rope_type not in written:
        raise ValueError(f"the head's rope scaling {scaling!r} (type {c.rope_type!r}) cannot be written in its "
                         f"config.json; supported: {', '.join(written)}")
    return {**scaling, "rope_type": c.rope_type}


def save_head(path, head: EagleHead, params: dict, d2t: np.ndarray) -> Path:
    """config.json + model.safetensors in the published EAGLE-3 layout: fc, midlayer.* (q/k/v/o, gate/up/down,
    input_layernorm, hidden_norm, post_attention_layernorm), norm, lm_head over the draft vocabulary, d2t (the
    offset of each draft id's target id) and t2d (the target ids that are in the draft vocabulary); a parallel
    head adds its placeholders mask_embed and mask_hidden and `"parallel_drafting": true` in config.json.
    `load_eagle_head` reads it back to the same head and params."""
    from safetensors.numpy import save_file
    if head.method != "eagle3":
        raise ValueError(f"save_head writes EAGLE-3 heads (the layout jaxspec trains); this head's method is "
                         f"{head.method!r}")
    path = Path(path)
    c, tc = head.config, head.target_config
    lp = {k: np.asarray(w[0], np.float32) for k, w in jax.device_get(params["layers"]["attention"]).items()}
    Hkv, G, hd = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
    qkv = lp["qkv_proj"].reshape(Hkv, G + 2, hd, -1)
    m = EAGLE3_LAYER_PREFIX
    tensors = {name: params[key] for key, name in EAGLE_TOP_TENSORS.items() if key in params}
    tensors.update({
        m + "input_layernorm.weight": lp["attn_norm"], m + "post_attention_layernorm.weight": lp["mlp_norm"],
        m + "self_attn.q_proj.weight": qkv[:, :G].reshape(Hkv * G * hd, -1),
        m + "self_attn.k_proj.weight": qkv[:, G].reshape(Hkv * hd, -1),
        m + "self_attn.v_proj.weight": qkv[:, G + 1].reshape(Hkv * hd, -1),
        m + "self_attn.o_proj.weight": lp["o_proj"],
        m + "mlp.gate_proj.weight": lp["gate_up_proj"][:, 0], m + "mlp.up_proj.weight": lp["gate_up_proj"][:, 1],
        m + "mlp.down_proj.weight": lp["down_proj"]})
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()}
    t2d = np.zeros(tc.vocab_size, bool)
    t2d[d2t] = True
    tensors["d2t"] = (np.asarray(d2t, np.int64) - np.arange(len(d2t)))
    tensors["t2d"] = t2d
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": hd, "num_hidden_layers": 1,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": tc.vocab_size,
              "draft_vocab_size": len(d2t), "max_position_embeddings": c.max_position_embeddings,
              "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids), "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    if head.parallel:
        config["parallel_drafting"] = True
    # No eagle_aux_hidden_state_layer_ids: vLLM reads those ids as "the output of layer id-1" and SGLang as "the
    # output of layer id", so any value is wrong in one of them; both default to the layers this head reads.
    rope_scaling = head_rope_scaling(c)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    tmp = path / "model.safetensors.tmp"   # written whole, then renamed: a reader never sees half a file
    save_file(tensors, str(tmp))
    tmp.replace(path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# ---- MTP heads -------------------------------------------------------------------------------------------------

MTP_TOP_TENSORS = {"fc": "mtp.fc.weight", "pre_fc_norm_embedding": "mtp.pre_fc_norm_embedding.weight",
                   "pre_fc_norm_hidden": "mtp.pre_fc_norm_hidden.weight", "norm": "mtp.norm.weight"}
MTP_LAYER_PREFIX = "mtp.layers.0."
# zero-centred in the checkpoint (as all of the hybrids' norms are): stored as 1 + w
ZERO_CENTRED = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def mtp_tensor_names(config) -> list[str]:
    """Every HF tensor the MTP head of a model with this config is read from."""
    layer = MtpHead(config).param_schema()["layers"][MTP_LAYER_KIND]
    names = [MTP_LAYER_PREFIX + s for name in layer for s in layer_sources(MTP_LAYER_KIND, name, config)]
    return list(MTP_TOP_TENSORS.values()) + names


def load_mtp_head(path, target_config, dtype) -> tuple[MtpHead, dict]:
    """(MtpHead, its declared params) from the `mtp.*` tensors of the checkpoint directory `path`. A ValueError
    names the checkpoint and what it lacks: MTP weights at all, some of them, or it has more than one layer."""
    from jaxspec.models.hf_loader import SafetensorsDir
    tensors = SafetensorsDir(path)
    if not any(name.startswith("mtp.") for name in tensors.file_of):
        raise ValueError(f"the checkpoint {str(path)!r} has no MTP weights (no 'mtp.*' tensors): speculative method "
                         "'mtp' reads the MTP head that Qwen3-Next / Qwen3.5 checkpoints ship beside the model; use "
                         "a checkpoint that has them, or another method")
    layers = sorted({int(m.group(1)) for name in tensors.file_of if (m := re.match(r"mtp\.layers\.(\d+)\.", name))})
    if layers != [0]:
        raise ValueError(f"the checkpoint {str(path)!r} has MTP layers {layers}; jaxspec runs exactly one "
                         "(mtp.layers.0.*, reused for every draft position)")
    missing = [name for name in mtp_tensor_names(target_config) if name not in tensors]
    if missing:
        raise ValueError(f"the checkpoint {str(path)!r} lacks MTP tensor(s) {missing[:6]}"
                         f"{f' and {len(missing) - 6} more' if len(missing) > 6 else ''} that a "
                         f"{target_config.arch} MTP head of this config needs")
    head = MtpHead(target_config)
    schema = head.param_schema()
    np_dtype = np.dtype(dtype)
    params = {}
    for key, name in MTP_TOP_TENSORS.items():
        value = read_top_weight(tensors.get_tensor, name, schema[key].shape, np.float32)
        params[key] = (plus_one(target_config, value) if key in ZERO_CENTRED else value).astype(np_dtype)
    params["layers"] = {MTP_LAYER_KIND: {
        name: read_layer_weight(tensors.get_tensor, MTP_LAYER_KIND, name, MTP_LAYER_PREFIX, target_config,
                                spec.shape[1:], np_dtype)[None]
        for name, spec in schema["layers"][MTP_LAYER_KIND].items()}}
    return head, jax.tree_util.tree_map(jnp.asarray, params)


# ---- draft models ----------------------------------------------------------------------------------------------

def load_draft_model(model, dtype_name: str):
    """(draft Model, its params in `dtype_name`): a Model given is used as it is, its floating params cast (the
    drafter runs in the target's dtype); a preset, GGUF file or directory is loaded (jaxspec.models.loader)."""
    from jaxspec.models.loader import load_model
    if hasattr(model, "params"):
        dtype = jnp.dtype(dtype_name)
        params = jax.tree_util.tree_map(
            lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, model.params)
        return model, params
    model = load_model(model, dtype=dtype_name)
    return model, model.params
