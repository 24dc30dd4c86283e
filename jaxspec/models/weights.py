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


# ---- hybrids (Qwen3-Next, Qwen3.5) -----------------------------------------------------------------------

def plus_one(c, w):
    """Zero-centred RMSNorm weights (HF computes x * (1 + w)) as the plain weight our RMSNorm multiplies by."""
    return w.astype(np.float32) + 1.0


def group_gated_qkv(c, q, k, v):
    """HF q_proj [Hq * 2hd, D] (each head's q then its gate), k/v [Hkv*hd, D] -> rows grouped per kv head:
    [its G q heads, its G gate heads, its k, its v]."""
    Hkv, hd = c.num_kv_heads, c.head_dim
    G = c.num_heads // Hkv
    qg = q.reshape(Hkv, G, 2, hd, -1)
    parts = [qg[:, :, 0], qg[:, :, 1], k.reshape(Hkv, 1, hd, -1), v.reshape(Hkv, 1, hd, -1)]
    return np.concatenate(parts, axis=1).reshape(-1, q.shape[-1])


def concat_rows(c, *parts):
    return np.concatenate(parts, axis=0)


def qwen3_next_in_proj(c, qkvz, ba):
    """Qwen3-Next's in_proj_qkvz (per key head: q, k, its G value heads' v, their z) and in_proj_ba (per key head:
    its G b, its G a) -> Qwen3.5's order [q | k | v | z | b | a]."""
    Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    G = Hv // Hk
    D = qkvz.shape[-1]
    w = qkvz.reshape(Hk, 2 * dk + 2 * G * dv, D)
    q, k = w[:, :dk], w[:, dk:2 * dk]
    v, z = w[:, 2 * dk:2 * dk + G * dv], w[:, 2 * dk + G * dv:]
    ba = ba.reshape(Hk, 2 * G, D)
    return np.concatenate([x.reshape(-1, D) for x in (q, k, v, z, ba[:, :G], ba[:, G:])], axis=0)


def conv_kernel(c, w):
    """HF depthwise conv1d weight [C, 1, K] -> [K, C]."""
    return w[:, 0, :].T


def stack_expert_gate_up(c, *parts):
    """Per-expert gate/up [F, D] (all gates, then all ups) -> [E, D, F, 2]."""
    E = c.num_experts
    gate, up = np.stack(parts[:E]), np.stack(parts[E:])                                 # [E, F, D]
    return np.stack([gate, up], axis=-1).transpose(0, 2, 1, 3)


def stack_expert_down(c, *parts):
    """Per-expert down [D, F] -> [E, F, D]."""
    return np.stack(parts).transpose(0, 2, 1)


def _experts(proj: str):
    def names(c):
        if proj == "down_proj":
            return tuple(f"mlp.experts.{e}.down_proj.weight" for e in range(c.num_experts))
        return tuple(f"mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj") for e in range(c.num_experts))
    return names


def _gdn_in_proj(c):
    if c.arch == "qwen3_next":
        return (LIN + "in_proj_qkvz.weight", LIN + "in_proj_ba.weight")
    return tuple(LIN + f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a"))


def _gdn_in_proj_combine(c, *parts):
    return qwen3_next_in_proj(c, *parts) if c.arch == "qwen3_next" else concat_rows(c, *parts)


LIN = "linear_attn."
_HYBRID_FFN = {
    "mlp_norm": (("post_attention_layernorm.weight",), plus_one),
    "gate_up_proj": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), interleave_gate_up),
    "down_proj": (("mlp.down_proj.weight",), None),
    "router": (("mlp.gate.weight",), None),
    "experts_gate_up": (_experts("gate_up"), stack_expert_gate_up),
    "experts_down": (_experts("down_proj"), stack_expert_down),
    "shared_gate_up": (("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
                       interleave_gate_up),
    "shared_down": (("mlp.shared_expert.down_proj.weight",), None),
    "shared_gate": (("mlp.shared_expert_gate.weight",), None),
}
HF_LAYER_TENSORS["gated_attention"] = {
    "attn_norm": (("input_layernorm.weight",), plus_one),
    "qkv_proj": ((ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"), group_gated_qkv),
    "q_norm": ((ATTN + "q_norm.weight",), plus_one),
    "k_norm": ((ATTN + "k_norm.weight",), plus_one),
    "o_proj": ((ATTN + "o_proj.weight",), None),
    **_HYBRID_FFN,
}
HF_LAYER_TENSORS["gated_deltanet"] = {
    "attn_norm": (("input_layernorm.weight",), plus_one),
    "in_proj": (_gdn_in_proj, _gdn_in_proj_combine),
    "conv_weight": ((LIN + "conv1d.weight",), conv_kernel),
    "dt_bias": ((LIN + "dt_bias",), None),
    "A_log": ((LIN + "A_log",), None),
    "gdn_norm": ((LIN + "norm.weight",), None),
    "out_proj": ((LIN + "out_proj.weight",), None),
    **_HYBRID_FFN,
}
# Qwen3-MoE's sparse layers: the attention layer's tensors, and the experts where the MLP was (plain RMSNorm weights).
HF_LAYER_TENSORS["attention_moe"] = {
    **{name: v for name, v in HF_LAYER_TENSORS["attention"].items() if name not in ("gate_up_proj", "down_proj")},
    **{name: _HYBRID_FFN[name] for name in ("router", "experts_gate_up", "experts_down")},
}
# Gemma 3: four norms a layer, each weight w applied as (1 + w) in float32 (`plus_one`, declared float32).
HF_LAYER_TENSORS["gemma3_attention"] = {
    "attn_norm": (("input_layernorm.weight",), plus_one),
    "qkv_proj": ((ATTN + "q_proj.weight", ATTN + "k_proj.weight", ATTN + "v_proj.weight"), group_qkv),
    "q_norm": ((ATTN + "q_norm.weight",), plus_one),
    "k_norm": ((ATTN + "k_norm.weight",), plus_one),
    "o_proj": ((ATTN + "o_proj.weight",), None),
    "post_attn_norm": (("post_attention_layernorm.weight",), plus_one),
    "mlp_norm": (("pre_feedforward_layernorm.weight",), plus_one),
    "gate_up_proj": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), interleave_gate_up),
    "down_proj": (("mlp.down_proj.weight",), None),
    "post_mlp_norm": (("post_feedforward_layernorm.weight",), plus_one),
}

# GPT-OSS: the attention layer's q/k/v (with biases), o_proj and its bias, the sinks; the router with its bias; the
# experts as stored ([E, D, 2F] and [E, F, D]: the grouped matmul's layout; an MXFP4 checkpoint's are dequantized by
# the loader, jaxspec.models.hf_loader).
EXPERTS = "mlp.experts."
HF_LAYER_TENSORS["gpt_oss"] = {
    **{name: HF_LAYER_TENSORS["attention"][name] for name in ("attn_norm", "qkv_proj", "qkv_bias", "o_proj",
                                                                  "mlp_norm")},
    "o_bias": ((ATTN + "o_proj.bias",), None),
    "sinks": ((ATTN + "sinks",), None),
    "router": (("mlp.router.weight",), None),
    "router_bias": (("mlp.router.bias",), None),
    "experts_gate_up_proj": ((EXPERTS + "gate_up_proj",), None),
    "experts_gate_up_bias": ((EXPERTS + "gate_up_proj_bias",), None),
    "experts_down_proj": ((EXPERTS + "down_proj",), None),
    "experts_down_bias": ((EXPERTS + "down_proj_bias",), None),
}
# Combines that read the model config (first argument).
_CONFIG_COMBINES = {plus_one, group_gated_qkv, concat_rows, _gdn_in_proj_combine, conv_kernel, stack_expert_gate_up,
                    stack_expert_down}
# Combines that only order, group and concatenate their tensors' rows (the last axis carried along): a per-row
# array of each tensor (an FP8 checkpoint's scales, jaxspec.models.fp8_checkpoint) combines into the weight's rows.
ROW_COMBINES = {None, group_qkv, interleave_gate_up, concat_rows, group_gated_qkv, _gdn_in_proj_combine}


def layer_sources(kind: str, name: str, config) -> tuple[str, ...]:
    sources = HF_LAYER_TENSORS[kind][name][0]
    return sources(config) if callable(sources) else sources


def resolve_dtype(dtype) -> str:
    """'bfloat16' or 'float32' from a name ('bf16', 'fp32' too; 'auto': bfloat16 on a GPU, float32 elsewhere) or a
    numpy/jax dtype; ValueError otherwise."""
    if dtype == "auto":
        import jax
        return "bfloat16" if jax.default_backend() == "gpu" else "float32"
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: 'auto', 'bfloat16', 'float32' (or jnp.bfloat16, "
                         "jnp.float32)")
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
    combine = HF_LAYER_TENSORS[kind][name][1]
    names = [prefix + s for s in layer_sources(kind, name, config)]
    if optional and not all(_has(get_tensor, n) for n in names):
        return None
    parts = [_read(get_tensor, n) for n in names]
    value = combine_parts(combine, parts, config)
    if tuple(value.shape) != tuple(shape):
        shown = ", ".join(f"{n} {tuple(p.shape)}" for n, p in list(zip(names, parts))[:4])
        raise CorruptModelFileError(f"{shown}: give {name} of shape {tuple(value.shape)}; the config implies "
                                    f"{tuple(shape)}")
    return value.astype(np_dtype, copy=False)


def combine_parts(combine, parts: list, config) -> np.ndarray:
    """The HF tensors of one declared weight combined as HF_LAYER_TENSORS says (None: the one tensor as it is)."""
    if combine is group_qkv:
        return combine(*parts, config.num_kv_heads)
    if combine in _CONFIG_COMBINES:
        return combine(config, *parts)
    return combine(*parts) if combine else parts[0]


def read_layer_weights(get_tensor, kind: str, prefix: str, config, specs: dict, np_dtype) -> dict:
    """One layer's declared weights ({name: array}, `specs` the kind's stacked Specs), each as `read_layer_weight`
    reads it, in its declared dtype (np_dtype where it declares none)."""
    return {name: read_layer_weight(get_tensor, kind, name, prefix, config, spec.shape[1:],
                                    declared_dtype(spec, np_dtype))
            for name, spec in specs.items()}


def declared_dtype(spec, np_dtype):
    """The dtype a weight is declared in (Gemma 3's float32 norms), or the model's, np_dtype."""
    return np_dtype if spec.dtype is None else np.dtype(spec.dtype)


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
            names += [f"model.layers.{i}.{s}" for s in layer_sources(kind, name, config)]
    names.append(TOP_TENSORS["final_norm"])
    if "lm_head" in schema:
        names.append(TOP_TENSORS["lm_head"])
    return names


def params_from_hf_tensors(config, get_tensor: Callable[[str], np.ndarray], dtype="float32",
                           read_layer: Callable = read_layer_weights, quantization: str | None = None) -> dict:
    """The declared params (jnp arrays in `dtype`) from tensors fetched one at a time by HF name.

    Tensors are converted one by one into host buffers (allocated from the first layer of each kind), so peak
    host memory is about the model in `dtype` plus one layer's source tensors. A missing tensor or a shape that
    does not match `config` raises `CorruptModelFileError` naming the tensor. `read_layer` reads one layer's
    weights (`read_layer_weights`' signature) against the schema of `quantization` (None: the model's dtype); a
    checkpoint stored in FP8 passes its own (jaxspec.models.fp8_checkpoint), which keeps its e4m3 values.
    """
    from jaxspec.nn.decoder import Decoder
    from jaxspec.nn.ops import Ops
    np_dtype = DTYPES[resolve_dtype(dtype)]
    decoder = Decoder(config, Ops(quantization=quantization))
    schema = decoder.param_schema()
    params: dict = {"layers": {}}
    for key in ("embed", "final_norm", "lm_head"):
        if key in schema:
            dtype_of_key = declared_dtype(schema[key], np_dtype)
            value = read_top_weight(get_tensor, TOP_TENSORS[key], schema[key].shape, dtype_of_key)
            if key == "final_norm" and (config.hybrid or config.plus_one_norms):
                # zero-centred, as every norm of the hybrids but the gated one, and of Gemma 3 (float32)
                value = plus_one(config, value).astype(dtype_of_key)
            params[key] = jax.device_put(value)
    index_in_kind: dict[str, int] = {}
    counts = {kind: decoder.layer_types.count(kind) for kind in decoder.kinds}
    stacked: dict = {kind: {} for kind in schema["layers"]}
    for i, kind in enumerate(decoder.layer_types):
        j = index_in_kind.get(kind, 0)
        index_in_kind[kind] = j + 1
        prefix = f"model.layers.{i}."
        for name, value in read_layer(get_tensor, kind, prefix, config, schema["layers"][kind], np_dtype).items():
            if name not in stacked[kind]:
                stacked[kind][name] = np.empty((counts[kind], *value.shape), value.dtype)
            buf = stacked[kind][name]
            if buf.shape[1:] != value.shape or buf.dtype != value.dtype:
                raise CorruptModelFileError(f"{prefix}: {name} is {value.dtype}{list(value.shape)}, where the first "
                                            f"layer of its kind gave {buf.dtype}{list(buf.shape[1:])}")
            buf[j] = value
    for kind, bufs in stacked.items():   # to the device weight kind by weight kind, dropping each host buffer
        params["layers"][kind] = {name: jax.device_put(bufs.pop(name)) for name in list(bufs)}
    return params
