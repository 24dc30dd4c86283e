"""The residual add and the RMSNorm after it, in one kernel, for decode-sized steps:

    h' = h + delta                                  delta [T, D], or f32 partial sums [S, T, D] (their sum)
    x  = rms_norm(h') * weight[layer]               (h' rounded to h's dtype first, as the unfused layer does)

A decode layer has two such points: after o (the attention's update, then the MLP's norm) and after down (the
MLP's update, then the next layer's attention norm). XLA ran each as one or two small kernels of 1.3-3.6 us (an
H100 trace of the 1.5B: the add and the norm apart after o at batch 1, the split-K sum of down's gemv, the add and
the norm as one 2.7-3.1 us fusion after down; at batch 32 the add and norm after down apart), latency-bound on
rows of a few KB. One program per token row reads the row (and each partial sum) once and writes both outputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _kernel(layer_ref, h_ref, *refs, D: int, width: int, eps: float, splits: int | None):
    refs = list(refs)
    delta_ref = refs.pop(0) if splits is not None else None
    w_ref, h_out_ref, x_out_ref = refs
    t = pl.program_id(0)
    cols = pl.ds(0, width)                       # the row as one power-of-two tile, lanes past D masked
    ok = jax.lax.broadcasted_iota(jnp.int32, (width,), 0) < D
    h = plgpu.load(h_ref.at[t, cols], mask=ok, other=0.0).astype(jnp.float32)
    if splits == 0:          # delta [T, D] in the stream's dtype
        h = h + plgpu.load(delta_ref.at[t, cols], mask=ok, other=0.0).astype(jnp.float32)
    elif splits:             # f32 partial sums [S, T, D]: summed first, then added (as XLA's sum(0) + h did)
        part = lambda s: plgpu.load(delta_ref.at[jnp.int32(s), t, cols], mask=ok, other=0.0)  # noqa: E731
        total = part(0)
        for s in range(1, splits):
            total = total + part(s)
        h = h + total
    h = h.astype(h_out_ref.dtype)
    plgpu.store(h_out_ref.at[t, cols], h, mask=ok)
    h = h.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.sum(h * h) / D + eps)
    g = plgpu.load(w_ref.at[layer_ref[0], cols], mask=ok, other=0.0).astype(jnp.float32)
    plgpu.store(x_out_ref.at[t, cols], (g * (h * rstd)).astype(x_out_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(h, delta, weight, layer, *, eps: float, interpret: bool | None = None):
    """h [T, D]; delta: [T, D] in h's dtype, f32 partial sums [S, T, D], or None (no add); weight [L, D] stacked
    norm weights, `layer` (i32 scalar) the one to use. -> (h + delta, rms_norm(h + delta) * weight[layer]), both
    [T, D] in h's dtype."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    T, D = h.shape
    if weight.ndim != 2 or weight.shape[1] != D:
        raise ValueError(f"weight {weight.shape} must be stacked norm weights [L, {D}] for h {h.shape}")
    if delta is not None and (delta.ndim not in (2, 3) or delta.shape[-2:] != (T, D)):
        raise ValueError(f"delta {delta.shape} must be [{T}, {D}] or partial sums [S, {T}, {D}] for h {h.shape}")
    splits = None if delta is None else (0 if delta.ndim == 2 else delta.shape[0])
    width = _next_pow2(D)
    # On a GPU masked lanes touch no memory; the interpreter slices instead (clamping past the end): pad there.
    pad = (lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - D)])) if interpret and width != D else None
    args = [jnp.reshape(layer, (1,)).astype(jnp.int32), h, *([] if delta is None else [delta]), weight]
    if pad:
        args = args[:1] + [pad(a) for a in args[1:]]
    Dp = args[1].shape[1]
    out_shape = [jax.ShapeDtypeStruct((T, Dp), h.dtype)] * 2
    whole = lambda a: pl.BlockSpec(a.shape, lambda t: (0,) * a.ndim)  # noqa: E731
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))
    h_new, x = pl.pallas_call(
        functools.partial(_kernel, D=D, width=width, eps=eps, splits=splits),
        grid=(T,), in_specs=[whole(a) for a in args], out_specs=[whole(o) for o in out_shape], out_shape=out_shape,
        interpret=interpret, name="add_rms_norm", **params)(*args)
    return (h_new[:, :D], x[:, :D]) if Dp != D else (h_new, x)


def add_rms_norm_reference(h, delta, weight, layer, *, eps: float):
    """What the kernel computes, with XLA's ops (the unfused layer's arithmetic)."""
    from jaxspec.nn.ops import rms_norm
    if delta is not None:
        h = (h.astype(jnp.float32) + (delta.sum(0) if delta.ndim == 3 else delta.astype(jnp.float32))).astype(h.dtype)
    return h, rms_norm(h, weight[layer], eps)
