"""HF-named tensors into the declared params (`jaxspec.nn`'s schemas).

Every loader (GGUF, safetensors directory, EAGLE heads) ends here: it supplies `get_tensor(hf_name) ->
np.ndarray`; this module reads, for every declared weight, the HF tensors it is made of, assembles them into
the declared layout (q/k/v grouped by kv head, gate/up interleaved), checks the declared shape, casts, and
stacks the layers of each kind.
"""
from __future__ import annotations

from typing import Callable

import jax
import ml_dtypes
import numpy as np

from jaxspec.models.errors import CorruptModelFileError

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}

TOP_TENSORS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def group_qkv(q, k, v, num_kv_heads: int):
    """HF q [Hq*hd, ...], k/v [Hkv*hd, ...] -> rows grouped per kv head: [its G q heads, its k, its v]."""
    tail = q.shape[1:]
    q = q.reshape(num_kv_heads, -1, *((k.shape[0] // num_kv_heads,) + tail))             # [Hkv, G, hd, ...]
    k = k.reshape(num_kv_heads, 1, *q.shape[2:])
    v = v.reshape(num_kv_heads, 1, *q.shape[2:])
    return np.concatenate([q, k, v], axis=1).reshape(-1, *tail)


def interleave_gate_up(gate, up):
    """HF gate/up [F, D] -> [F, 2, D]."""
    return np.stack([gate, up], axis=1)


# For each layer kind: declared weight -> (the HF tensors inside a layer it is made of, how they combine).
ATTN = "self_attn."
HF_LAYER_TENSORS: dict[str, dict[str, tuple[tuple[str, ...], Callable]]] = {
    "attention": {
        "attn_norm": (("input_layernorm.weight",), None),
        "qkv_proj": ((ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"), group_qkv),
        "qkv_bias": ((ATTN + "q_proj.bias", ATTN + "k_proj.bias", ATTN + "v_proj.bias"), group_qkv),
        "q_norm": ((ATTN + "q_norm.weight",), None),
        "k_norm": ((ATTN + "k_norm.weight",), None),
        "o_proj": ((ATTN + "o_proj.weight",), None),
        "mlp_norm": (("post_attention_layernorm.weight",), None),
        "gate_up_proj": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), interleave_gate_up),
        "down_proj": (("mlp.down_proj.weight",), None),
    },
}


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


def _read(get_tensor: Callable[[str], np.ndarray], name: str) -> np.ndarray:
    try:
        return np.asarray(get_tensor(name))
    except KeyError:
        raise CorruptModelFileError(f"the checkpoint has no tensor {name!r} (needed for this model config)") from None


def read_layer_weight(get_tensor, kind: str, name: str, prefix: str, config, shape, np_dtype,
                      optional: bool = False) -> np.ndarray | None:
    """One declared weight of one layer (HF names under `prefix`), assembled, shape-checked against the
    declaration and cast. `optional`: None when its HF tensors are absent (EAGLE-1's first layer norm)."""
    sources, combine = HF_LAYER_TENSORS[kind][name]
    names = [prefix + s for s in sources]
    if optional and not all(_has(get_tensor, n) for n in names):
        return None
    parts = [_read(get_tensor, n) for n in names]
    value = combine(*parts, config.num_kv_heads) if combine is group_qkv else (combine(*parts) if combine else parts[0])
    if tuple(value.shape) != tuple(shape):
        shown = ", ".join(f"{n} {tuple(p.shape)}" for n, p in zip(names, parts))
        raise CorruptModelFileError(f"{shown}: give {name} of shape {tuple(value.shape)}; the config implies "
                                    f"{tuple(shape)}")
    return value.astype(np_dtype, copy=False)


def _has(get_tensor, name: str) -> bool:
    try:
        get_tensor(name)
        return True
    except KeyError:
        return False


def read_top_weight(get_tensor, hf_name: str, shape, np_dtype) -> np.ndarray:
    value = _read(get_tensor, hf_name)
    if tuple(value.shape) != tuple(shape):
        raise CorruptModelFileError(f"tensor {hf_name!r} has shape {tuple(value.shape)}; the config implies {tuple(shape)}")
    return value.astype(np_dtype, copy=False)


def hf_tensor_names(config) -> list[str]:
    """The HF tensor names `params_from_hf_tensors` reads for this config, in reading order."""
    from jaxspec.nn.decoder import Decoder
    decoder = Decoder(config)
    schema = decoder.param_schema()
    names = [TOP_TENSORS["embed"]]
    for i, kind in enumerate(decoder.layer_types):
        for name in schema["layers"][kind]:
            names += [f"model.layers.{i}.{s}" for s in HF_LAYER_TENSORS[kind][name][0]]
    names.append(TOP_TENSORS["final_norm"])
    if "lm_head" in schema:
        names.append(TOP_TENSORS["lm_head"])
    return names


def params_from_hf_tensors(config, get_tensor: Callable[[str], np.ndarray], dtype="float32") -> dict:
    """The declared params (jnp arrays in `dtype`) from tensors fetched one at a time by HF name.

    Tensors are converted one by one into preallocated host buffers of the target dtype, so peak host
    memory is about the model in `dtype` plus one layer's source tensors. A missing tensor or a shape that
    does not match `config` raises `CorruptModelFileError` naming the tensor.
    """
    from jaxspec.nn.decoder import Decoder
    np_dtype = DTYPES[resolve_dtype(dtype)]
    decoder = Decoder(config)
    schema = decoder.param_schema()
    params: dict = {"layers": {}}
    for key in ("embed", "final_norm", "lm_head"):
        if key in schema:
            params[key] = jax.device_put(read_top_weight(get_tensor, TOP_TENSORS[key], schema[key].shape, np_dtype))
    index_in_kind: dict[str, int] = {}
    stacked = {kind: {name: np.empty(spec.shape, np_dtype) for name, spec in specs.items()}
               for kind, specs in schema["layers"].items()}
    for i, kind in enumerate(decoder.layer_types):
        j = index_in_kind.get(kind, 0)
        index_in_kind[kind] = j + 1
        for name, buf in stacked[kind].items():
            buf[j] = read_layer_weight(get_tensor, kind, name, f"model.layers.{i}.", config, buf.shape[1:], np_dtype)
    for kind, bufs in stacked.items():   # to the device weight kind by weight kind, dropping each host buffer
        params["layers"][kind] = {name: jax.device_put(bufs.pop(name)) for name in list(bufs)}
    return params
