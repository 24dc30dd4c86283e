"""FP8 weights: float8 e4m3 with one float32 scale per output channel, quantized on load.

A quantized projection `name` [..., N, K] is stored as the e4m3 values `name` (same shape) and `name_scale`
f32[..., N] (the schema declares both, the scale with the weight's axes but the last, so tensor parallelism splits
it with its rows). `Ops.linear` finds the scale beside the weight and runs one of:

    W8A16   y = (x @ dequant-free(w).T) * scale      the weight converted to x's dtype inside the matmul
    W8A8    y = (q(x) @ w.T) * x_scale * scale       x quantized per token to e4m3 too: an FP8 GEMM

Decode reads weights, so halving their bytes is the point; which of the two is faster at a token bucket is measured
on the GPU (Ops.w8a8_from_tokens). Embeddings, norms, biases, the lm_head, routers and MoE experts stay in the model's
dtype (`quantized_names` says which weights are quantized).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.nn.schema import Spec, is_spec
from jaxspec.sched.config import QUANTIZATION_SCHEMES as SCHEMES

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0   # the largest finite e4m3fn value
# The projections quantized: every weight a layer multiplies through Ops.linear one matrix at a time (MoE experts,
# a grouped matmul, stay in the model's dtype, as do routers and gates of one row).
QUANTIZED = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "in_proj", "out_proj", "shared_gate_up",
                       "shared_down"})
SCALE = "_scale"


def check_scheme(quantization):
    if quantization is not None and quantization not in SCHEMES:
        raise ValueError(f"quantization={quantization!r} is not supported; valid: None, {', '.join(map(repr, SCHEMES))}")


def quantized_schema(schema):
    """The schema with every QUANTIZED weight declared as e4m3 and its per-output-channel scale beside it."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for name, spec in schema.items():
        if name in QUANTIZED and is_spec(spec) and len(spec.shape) >= 2:
            out[name] = Spec(spec.shape, spec.axes, spec.init, FP8)
            out[name + SCALE] = Spec(spec.shape[:-1], spec.axes[:-1], "ones", jnp.float32)
        else:
            out[name] = quantized_schema(spec)
    return out


def _to_e4m3(x):
    """x [..., K] -> (e4m3 [..., K], f32 scale [..., 1]): each row scaled so that its largest magnitude is e4m3's
    largest finite value (an all-zero row keeps scale 1)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x / scale).astype(FP8), scale


@jax.jit
def quantize_fp8(w):
    """w [..., N, K] -> (e4m3 values [..., N, K], f32 scales [..., N]): one scale per output channel (row)."""
    q, scale = _to_e4m3(w)
    return q, scale[..., 0]


def quantize_params(params):
    """A model's params (nested dicts of arrays) with every QUANTIZED weight quantized (`quantize_fp8`); each
    original weight is released as its quantized one is made."""
    if not isinstance(params, dict):
        return params
    out = {}
    for name in list(params):
        value = params[name]
        if name in QUANTIZED and hasattr(value, "ndim") and value.ndim >= 2:
            out[name], out[name + SCALE] = quantize_fp8(value)
            del value
        else:
            out[name] = quantize_params(value)
    return out


def quantized_names(params, prefix: str = "") -> list[str]:
    """The weights of a params tree stored quantized (those with a scale beside them), as 'layers.attention.qkv_proj'."""
    names = []
    for name, value in params.items():
        if isinstance(value, dict):
            names += quantized_names(value, f"{prefix}{name}.")
        elif name + SCALE in params:
            names.append(prefix + name)
    return names


def fp8_matmul(x, w, scale, *, w8a8: bool, out_dtype=None):
    """x [..., K] @ w.T with w e4m3 [N, K] and its scales f32[N] -> [..., N] in out_dtype (None: x's dtype).
    W8A16 (w8a8 False): w converted to x's dtype inside the matmul, f32 accumulation, scaled after. W8A8: x
    quantized per token, an e4m3 x e4m3 matmul with f32 accumulation, both scales applied after."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if w8a8:
        xq, x_scale = _to_e4m3(x)   # per token
        y = jnp.einsum("...k,nk->...n", xq, w, preferred_element_type=jnp.float32)
        return (y * x_scale * scale).astype(out_dtype)
    y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(out_dtype)
