"""Mapping HF-named tensors into the params pytree described in `jaxspec.models.config`.

Every loader (GGUF, safetensors directory) ends here: it supplies `get_tensor(hf_name) -> np.ndarray`
and this module checks shapes, casts and stacks the per-layer tensors on a leading L axis.
"""
from __future__ import annotations

from typing import Callable

import jax
import ml_dtypes
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.errors import CorruptModelFileError

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}

# params["layers"] key -> HF tensor name inside `model.layers.{i}.`
LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
TOP_TENSORS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def resolve_dtype(dtype) -> str:
    """'bfloat16' or 'float32' from a name ('bf16', 'fp32' too) or a numpy/jax dtype; ValueError otherwise."""
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: 'bfloat16', 'float32' (or jnp.bfloat16, jnp.float32)")
    return name


def layer_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer shape (without the leading L axis) of every tensor in params['layers'] for this config."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes = {
        "attn_norm": (d,), "q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
        "mlp_norm": (d,), "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f),
    }
    if config.qkv_bias:
        shapes.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
    if config.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    return shapes


def param_shapes(config: ModelConfig) -> dict:
    """The full params pytree of shapes (tuples) for this config, layers stacked on a leading L axis."""
    d, v = config.hidden_size, config.vocab_size
    shapes: dict = {"embed": (v, d), "final_norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (v, d)
    shapes["layers"] = {k: (config.num_layers, *s) for k, s in layer_param_shapes(config).items()}
    return shapes


def hf_tensor_names(config: ModelConfig) -> list[str]:
    """The HF tensor names `params_from_hf_tensors` reads for this config, in reading order."""
    names = [TOP_TENSORS["embed"]]
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{LAYER_TENSORS[k]}" for k in layer_param_shapes(config)]
    names.append(TOP_TENSORS["final_norm"])
    if not config.tie_word_embeddings:
        names.append(TOP_TENSORS["lm_head"])
    return names


def _read(get_tensor: Callable[[str], np.ndarray], name: str, shape: tuple[int, ...], np_dtype) -> np.ndarray:
    try:
        value = get_tensor(name)
    except KeyError:
        raise CorruptModelFileError(f"the checkpoint has no tensor {name!r} (needed for this model config)") from None
    value = np.asarray(value)
    if tuple(value.shape) != tuple(shape):
        raise CorruptModelFileError(f"tensor {name!r} has shape {tuple(value.shape)}; the config implies {tuple(shape)}")
    return value.astype(np_dtype, copy=False)


def params_from_hf_tensors(config: ModelConfig, get_tensor: Callable[[str], np.ndarray], dtype="float32") -> dict:
    """Build the params pytree (jnp arrays in `dtype`) from tensors fetched one at a time by HF name.

    Tensors are converted one by one into preallocated host buffers of the target dtype, so peak host
    memory is about the model in `dtype` plus one source tensor. A missing tensor or a shape that does
    not match `config` raises `CorruptModelFileError` naming the tensor.
    """
    np_dtype = DTYPES[resolve_dtype(dtype)]
    shapes = param_shapes(config)
    host: dict = {}
    for key in ("embed", "final_norm", "lm_head"):
        if key in shapes:
            host[key] = _read(get_tensor, TOP_TENSORS[key], shapes[key], np_dtype)
    stacked = {k: np.empty(s, np_dtype) for k, s in shapes["layers"].items()}
    for i in range(config.num_layers):
        for key, buf in stacked.items():
            buf[i] = _read(get_tensor, f"model.layers.{i}.{LAYER_TENSORS[key]}", buf.shape[1:], np_dtype)
    host["layers"] = stacked
    # Move to the device tensor by tensor, dropping each host buffer once it is copied.
    params: dict = {"layers": {}}
    for key in [k for k in host if k != "layers"]:
        params[key] = jax.device_put(host.pop(key))
    for key in list(stacked):
        params["layers"][key] = jax.device_put(stacked.pop(key))
    return params
