"""FP8 weights: float8 e4m3 with one float32 scale per output channel, quantized on load.

A quantized projection `name` [..., N, K] is stored as the e4m3 values `name` (same shape) and `name_scale`
f32[..., N] (the schema declares both, the scale with the weight's axes but the last, so tensor parallelism splits
it with its rows). MoE experts, laid out [..., E, K, N...] for the grouped matmul, reduce their K axis instead: scales
f32[..., E, N...] (`CONTRACTED`). `Ops.linear` finds the scale beside the weight and runs one of:

    W8A16   y = (x @ dequant-free(w).T) * scale      the weight converted to x's dtype inside the matmul
    W8A8    y = (q(x) @ w.T) * x_scale * scale       x quantized per token to e4m3 too: an FP8 GEMM

Decode reads weights, so halving their bytes is the point; which of the two is faster at a token bucket is measured
on the GPU (Ops.w8a8_from_tokens); MoE experts run W8A16 at every size (`fp8_ragged_dot`). The target's, a draft
model's and an EAGLE / EAGLE-3 / MTP head's projections are quantized alike; embeddings, norms, biases, lm_heads
(the target's, an EAGLE-3 head's draft one), routers and gates stay in the model's dtype (`quantized_names` says
which weights are quantized).

Checkpoints stored in FP8 (jaxspec.models.fp8_checkpoint) load their e4m3 values as they are: per-channel and
per-tensor scales as the per-channel `name_scale` above; block-wise ones (128x128 blocks) as `name_scale`
f32[..., N, ceil(K/128)], expanded over rows, which `Ops.linear` multiplies exactly (`fp8_block_matmul`, below).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.nn.schema import Spec, is_spec

# The schemes implemented here (the engine offers them as jaxspec.sched.config.QUANTIZATION_SCHEMES, which imports no
# JAX: the command-line tools check their flags before loading anything)
SCHEMES = ("fp8",)
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0   # the largest finite e4m3fn value
# The projections quantized, each with the axis its product sums over (its input channels), counted from the end:
# every weight a layer, head or drafter multiplies through Ops.linear, one matrix [..., N, K] at a time (the last
# axis; `fc`: an EAGLE / MTP head's input projection), or grouped by expert [..., E, K, N...] (MoE experts, run by
# jax.lax.ragged_dot: the axis after E, so that each expert has one scale per output channel). Routers and gates of
# one row stay in the model's dtype.
CONTRACTED = {**dict.fromkeys(("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "in_proj", "out_proj",
                               "shared_gate_up", "shared_down", "fc"), -1),
              "experts_gate_up": -3, "experts_down": -2}   # [E, K=D, F, 2], [E, K=F, D]
QUANTIZED = frozenset(CONTRACTED)
SCALE = "_scale"


def check_scheme(quantization):
    if quantization is not None and quantization not in SCHEMES:
        raise ValueError(f"quantization={quantization!r} is not supported; valid: None, {', '.join(map(repr, SCHEMES))}")


def quantized_schema(schema):
    """The schema with every QUANTIZED weight declared as e4m3 and its per-output-channel scale beside it: the
    weight's shape and logical axes without the contracted one, so that tensor parallelism splits a scale with its
    weight's output channels (column-parallel) and keeps it whole where the weight splits its input (row-parallel)."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for name, spec in schema.items():
        if name in QUANTIZED and is_spec(spec) and len(spec.shape) > -CONTRACTED[name]:
            k = len(spec.shape) + CONTRACTED[name]
            out[name] = Spec(spec.shape, spec.axes, spec.init, FP8)
            out[name + SCALE] = Spec(spec.shape[:k] + spec.shape[k + 1:], spec.axes[:k] + spec.axes[k + 1:], "ones",
                                     jnp.float32)
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


@functools.partial(jax.jit, static_argnames="axis")
def quantize_fp8(w, axis: int = -1):
    """w -> (e4m3 values of w's shape, f32 scales of w's shape without `axis`): one scale per output channel, over
    the contracted axis (-1: a projection [..., N, K], scales [..., N]; -3: experts [..., E, K, F, 2] ->
    [..., E, F, 2])."""
    q, scale = _to_e4m3(jnp.moveaxis(w, axis, -1))
    return jnp.moveaxis(q, -1, axis), scale[..., 0]


def quantize_params(params):
    """A model's params (nested dicts of arrays) with every QUANTIZED weight quantized (`quantize_fp8`); each
    original weight is released as its quantized one is made."""
    if not isinstance(params, dict):
        return params
    out = {}
    for name in list(params):
        value = params[name]
        if name in QUANTIZED and hasattr(value, "ndim") and value.ndim > -CONTRACTED[name]:
            out[name], out[name + SCALE] = quantize_fp8(value, CONTRACTED[name])
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


def fp8_ragged_dot(x, w, scale, group_sizes, *, out_dtype=None):
    """x [M, K], its rows grouped by expert (the first group_sizes[0] rows go to expert 0, ...), times the e4m3
    experts w [E, K, N] with scales f32[E, N] -> [M, N] in out_dtype (None: x's dtype). W8A16: the experts converted
    to x's dtype inside jax.lax.ragged_dot (f32 accumulation); each row's product then scaled by its own expert's
    scales, y[m, n] = (x[m] @ w[e(m)])[n] * scale[e(m), n], e(m) found from the groups' ends (rows past the last
    group, which ragged_dot leaves zero, take the last expert's)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(x.shape[0])
    expert = jnp.minimum(jnp.searchsorted(ends, rows, side="right", method="compare_all"), w.shape[0] - 1)   # [M]
    return (y * scale[expert]).astype(out_dtype)


# ---- block-wise scales (FP8 checkpoints: jaxspec.models.fp8_checkpoint) ----------------------------------------
# A checkpoint stored with one scale per 128x128 block (Qwen3-FP8, DeepSeek-V3) keeps its e4m3 values as they are:
# requantizing them per channel would round twice. Its scales are kept beside the weight under the same `name_scale`
# key, expanded over rows only: f32[..., N, ceil(K / FP8_BLOCK_K)], one scale per row and per FP8_BLOCK_K columns
# (a block of more rows repeats its scale on each; a block of a multiple of FP8_BLOCK_K columns repeats it over
# those). Per row, q/k/v and gate/up fuse by concatenating rows as per-channel scales do, wherever the checkpoint's
# row blocks end. The scale then has the weight's rank (per-channel scales have one less): `is_blockwise`. The
# schema still declares the per-channel shape: tensor parallelism splits the scale with its rows, its last axis whole.
FP8_BLOCK_K = 128


def is_blockwise(w, scale) -> bool:
    """Whether `scale` beside the e4m3 weight `w` [..., N, K] is block-wise ([..., N, Kb]) rather than per channel
    ([..., N])."""
    return scale is not None and scale.ndim == w.ndim


def expand_block_scale(scale, k: int):
    """f32[..., N, Kb] row-expanded block scales -> [..., N, K] (Kb 1: one scale per row, broadcast)."""
    if scale.shape[-1] == 1:
        return scale
    return jnp.repeat(scale, FP8_BLOCK_K, axis=-1, total_repeat_length=scale.shape[-1] * FP8_BLOCK_K)[..., :k]


def fp8_block_matmul(x, w, scale, *, w8a8: bool, out_dtype=None):
    """x [..., K] @ (w * scale per block).T with w e4m3 [N, K] and its row-expanded block scales f32[N, Kb] ->
    [..., N] in out_dtype (None: x's dtype). The weight is dequantized in float32 (exact: e4m3 times the scale,
    rounded once) and multiplied in x's dtype with f32 accumulation; a bf16 x sees it rounded to bf16, as a bf16
    checkpoint of the same weights would be. W8A8: x quantized per token to e4m3 first, its scale applied after, as
    `fp8_matmul` does; the product itself is not an FP8 GEMM (the scale varies along K), so it rounds x the same
    way without being faster."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    dequant = (w.astype(jnp.float32) * expand_block_scale(scale, w.shape[-1])).astype(x.dtype)
    if w8a8:
        xq, x_scale = _to_e4m3(x)   # per token
        y = jnp.einsum("...k,nk->...n", xq.astype(x.dtype), dequant, preferred_element_type=jnp.float32)
        return (y * x_scale).astype(out_dtype)
    y = jnp.einsum("...k,nk->...n", x, dequant, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
