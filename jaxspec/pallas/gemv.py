"""Matmuls of decode-sized steps (a few tokens against a layer's weight) at the weight-read bandwidth, with the
small operations around them done in the same kernel:

    y [T, N] = x [T, K] @ W[layer] [N, K].T                         (W stacked [L, N, K], read in place)
      prologue  x <- rms_norm(x) * norm[layer]                      (the layer's input norm)
      pairs     W[layer] [F, 2, K] (gate and up rows interleaved):  y [T, F] = silu(x @ gate.T) * (x @ up.T)
      epilogue  y <- residual + y                                   (the residual add)
      split K   S programs share one output block, each over K / S: f32 partial sums [S, T, N] the caller adds
                (the sum fuses into whatever XLA fusion reads them)

With T <= 32 tokens a matmul reads ~2 bytes of weight per 2T flops: the step is as fast as the weight streams.
Here one program owns a block of BN output columns (and one K split), keeps the x rows in a [R, BK] tile (R = 16
or 32 rows, the matrix unit's smallest tile, rows past T masked) and walks its K range BK at a time; the loop is
software-pipelined so several weight tiles are in flight. The norm is folded in as rstd * ((x * g) @ W.T): each
program sums the row's squares in the same loop and scales its output at the end.

Measured on an H100 (Qwen2.5-Coder-1.5B shapes, docs/lab/2026-11-24-gemv-kernels.md): on down (K = 8960) the
kernel with K split 5 ways reads the weight at 72-74% of the copy bandwidth against XLA's 60-68%, and the engine's
step is 4% faster with it; on the small q/k/v and o matrices (K = 1536) and on gate/up it is slower than XLA's
GEMMs, so the engine runs down alone through it by default (Ops.gemv, JAXSPEC_GEMV).

One-byte weights of 2^31 elements or more (Llama-3.1-8B's stacked FP8 gate/up, [32, 14336, 2, 4096], is 3.76e9)
are read as uint16 pairs: Pallas's Triton lowering indexes an array below 2^32 bytes with 32-bit signed element
offsets, which wrap past 2^31 elements and faulted on an H100 (CUDA_ERROR_ILLEGAL_ADDRESS). Viewed as uint16 the
same bytes are half as many elements; the kernel splits each loaded pair into its two bytes and interleaves them
back into the tile.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.common import interpreted

MAX_ROWS = 32   # tokens the kernel takes; larger steps are matrix-bound and go to XLA's GEMMs


@dataclasses.dataclass(frozen=True)
class Tiling:
    """block_n output columns (pairs for gate/up) per program, block_k per loop iteration, splits of K, and
    Triton's warps and pipeline stages."""
    block_n: int = 32
    block_k: int = 256
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 4


def _rows_tile(T: int) -> int:
    return 16 if T <= 16 else 32


def _kernel(*refs, T: int, K: int, tiling: Tiling, rows: int, eps: float | None, pairs: bool, residual: bool,
            scaled: bool, packed: bool):
    layer_ref, x_ref, w_ref, *refs = refs
    norm_ref = refs.pop(0) if eps is not None else None
    res_ref = refs.pop(0) if residual else None
    scale_ref = refs.pop(0) if scaled else None
    # FP8 weights are converted to x's dtype tile by tile (the product's per-column scale applies after the sum)
    compute = x_ref.dtype if scaled else w_ref.dtype
    load_w = (lambda ref: ref.astype(compute)) if scaled else (lambda ref: ref)
    if packed:   # uint16 [bn, bk / 2]: the low byte holds an even k's e4m3 value, the high byte the next odd k's,
        def load_w(pairs16):   # interleaved back into the [bn, bk] tile of bytes
            lo, hi = (pairs16 & 0xFF).astype(jnp.uint8), (pairs16 >> 8).astype(jnp.uint8)
            tile = jnp.stack([lo, hi], axis=-1).reshape(lo.shape[0], 2 * lo.shape[1])
            return jax.lax.bitcast_convert_type(tile, jnp.float8_e4m3fn).astype(compute)
    (o_ref,) = refs
    bn, bk, S = tiling.block_n, tiling.block_k, tiling.splits
    n, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    n0 = n * bn
    row_ok = jax.lax.broadcasted_iota(jnp.int32, (rows, bk), 0) < T

    dims = (((1,), (1,)), ((), ()))
    # float32 weights get float32 products (Triton's default for them is TF32); bf16 is exact in either.
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=dims, preferred_element_type=jnp.float32,
                            precision=jax.lax.Precision.HIGHEST if compute == jnp.float32 else None)

    def step(j, carry):
        *accs, ss = carry
        k = s * (K // S) + j * bk
        x = plgpu.load(x_ref.at[pl.ds(0, rows), pl.ds(k, bk)], mask=row_ok, other=0.0)
        if eps is not None:   # rms_norm(x) @ W.T = rstd * ((x * g) @ W.T): the row's scale applies after the sum
            x32 = x.astype(jnp.float32)
            ss = ss + jnp.sum(x32 * x32, axis=1)
            x = (x32 * norm_ref[layer, pl.ds(k, bk)].astype(jnp.float32)[None, :]).astype(compute)
        wk = pl.ds(k // 2, bk // 2) if packed else pl.ds(k, bk)
        if pairs:
            gate = load_w(w_ref[layer, pl.ds(n0, bn), 0, wk])
            up = load_w(w_ref[layer, pl.ds(n0, bn), 1, wk])
            return accs[0] + dot(x, gate), accs[1] + dot(x, up), ss
        w = load_w(w_ref[layer, pl.ds(n0, bn), wk])
        return accs[0] + dot(x, w), ss

    zeros = jnp.zeros((rows, bn), jnp.float32)
    *accs, ss = jax.lax.fori_loop(0, K // S // bk, step,
                                  (zeros, zeros, jnp.zeros((rows,), jnp.float32)) if pairs else
                                  (zeros, jnp.zeros((rows,), jnp.float32)))
    if scaled:
        accs = ([accs[0] * scale_ref[layer, pl.ds(n0, bn), 0][None, :], accs[1] * scale_ref[layer, pl.ds(n0, bn), 1][None, :]]
                if pairs else [accs[0] * scale_ref[layer, pl.ds(n0, bn)][None, :]])
    if eps is not None:
        rstd = jax.lax.rsqrt(ss / K + eps)[:, None]
        accs = [a * rstd for a in accs]
    y = jax.nn.silu(accs[0]) * accs[1] if pairs else accs[0]
    out_ok = jax.lax.broadcasted_iota(jnp.int32, (rows, bn), 0) < T
    if S > 1:   # f32 partial sums; the caller adds the splits
        plgpu.store(o_ref.at[s, pl.ds(0, rows), pl.ds(n0, bn)], y, mask=out_ok)
        return
    if residual:
        y = y + plgpu.load(res_ref.at[pl.ds(0, rows), pl.ds(n0, bn)], mask=out_ok, other=0.0).astype(jnp.float32)
    plgpu.store(o_ref.at[pl.ds(0, rows), pl.ds(n0, bn)], y.astype(o_ref.dtype), mask=out_ok)


# Pallas's Triton lowering offsets an array under 2^32 bytes with signed 32-bit element indices (module docstring)
INT32_ELEMENTS = 2 ** 31


def needs_packing(w) -> bool:
    """Whether `w` must be read as uint16 pairs: one-byte elements, 2^31 or more of them."""
    return w.dtype.itemsize == 1 and w.size >= INT32_ELEMENTS


@functools.partial(jax.jit, static_argnames=("tiling", "eps", "interpret", "packed"))
def gemv(x, w, layer, norm=None, residual=None, scale=None, *, tiling: Tiling = Tiling(), eps: float | None = None,
         interpret: bool | None = None, packed: bool | None = None):
    """x [T, K] (T <= MAX_ROWS); w [L, N, K] or, for gate/up pairs, [L, F, 2, K]; layer: i32 scalar.
    norm [L, K] with eps: rms_norm x first. residual [T, N]: added to the output (one split only). scale f32[L, N]
    (pairs [L, F, 2]): w holds FP8 values (jaxspec.nn.quant), converted to x's dtype in the kernel, and each
    output column's sum is multiplied by its scale.
    -> [T, N] (pairs: silu(gate) * up [T, F]) in x's dtype, or with tiling.splits = S > 1 the f32 partial sums
    [S, T, N] (their sum is the product; residual not allowed). packed: read the FP8 weight as uint16 pairs
    (None: where `needs_packing`; True forces it, as the tests do at small sizes)."""
    interpret = interpreted(interpret)
    if packed is None:
        packed = needs_packing(w)
    if packed and (scale is None or w.dtype != jnp.float8_e4m3fn or w.shape[-1] % 2 or tiling.block_k % 2):
        raise ValueError(f"packed reading takes e4m3 weights with their scale, an even K and block_k "
                         f"(got {w.dtype}, K={w.shape[-1]}, block_k={tiling.block_k}, scale given: {scale is not None})")
    T, K = x.shape[0], w.shape[-1]
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"x {x.shape} does not match the weight {w.shape}: x must be [T, {K}]")
    pairs = w.ndim == 4
    N = w.shape[1]
    bn, bk, S = tiling.block_n, tiling.block_k, tiling.splits
    if T > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got T={T}; larger steps belong to XLA's GEMMs")
    if N % bn or K % (S * bk):
        raise ValueError(f"tiling {tiling} does not divide N={N}, K={K} (block_n must divide N, "
                         f"splits * block_k must divide K)")
    if (norm is None) != (eps is None):
        raise ValueError("norm and eps go together")
    if eps is not None and S > 1:
        raise ValueError("the norm needs the whole K in one program (its scale is the whole row's)")
    if pairs and S > 1:
        raise ValueError("gate/up pairs need the whole K in one program (SwiGLU is applied to the full sums)")
    if residual is not None and S > 1:
        raise ValueError("a residual is added by one-split kernels only; with splits the caller adds it")
    rows = _rows_tile(T)
    # The interpreter slices instead of masking (and clamps slices past the end): there the rows are padded.
    Tp = rows if interpret else T
    pad = lambda a: jnp.pad(a, ((0, Tp - T), (0, 0))) if Tp != T else a  # noqa: E731
    if packed:   # the same bytes as uint16 pairs (a bitcast: no copy)
        w = jax.lax.bitcast_convert_type(w.reshape(*w.shape[:-1], K // 2, 2), jnp.uint16)
    args = [jnp.reshape(layer, (1,)).astype(jnp.int32), pad(x), w]
    if norm is not None:
        args.append(norm)
    if residual is not None:
        args.append(pad(residual))
    if scale is not None:
        args.append(scale.astype(jnp.float32))
    out_shape = (jax.ShapeDtypeStruct((S, Tp, N), jnp.float32) if S > 1 else
                 jax.ShapeDtypeStruct((Tp, N), x.dtype))
    whole = lambda a: pl.BlockSpec(a.shape, lambda n, s: (0,) * len(a.shape))  # noqa: E731
    kernel = functools.partial(_kernel, T=T, K=K, tiling=tiling, rows=rows, eps=eps, pairs=pairs,
                               residual=residual is not None, scaled=scale is not None, packed=packed)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(
        num_warps=tiling.num_warps, num_stages=tiling.num_stages))
    out = pl.pallas_call(kernel, grid=(N // bn, S), in_specs=[whole(a) for a in args],
                         out_specs=pl.BlockSpec(out_shape.shape, lambda n, s: (0,) * len(out_shape.shape)),
                         out_shape=out_shape, interpret=interpret, name="gemv", **params)(*args)
    if Tp != T:
        out = out[:, :T] if S > 1 else out[:T]
    return out


# ---- which tiling for which matmul ---------------------------------------------------------------------------

def _largest_dividing(n: int, options) -> int | None:
    return next((o for o in options if n % o == 0), None)


# Shared memory a program's pipelined tiles may take: an H100 block has 227 KiB, and Triton's own scratch (the norm's
# sums, the layout conversions) took ~28 KiB more than the tiles where a float32 q/k/v-with-norm tiling asked for 244
# KiB and was refused (tests/gpu/test_fp8_kernels.py at 32 float32 rows).
TILE_SMEM_BYTES = 180 * 1024


def _tile_bytes(bn: int, bk: int, stages: int, *, rows: int, x_bytes: int, w_bytes: int, pairs: bool) -> int:
    """Shared memory of `stages` pipelined (x, w) tiles: x's [rows, bk] (rows padded to a power of two >= 16, as
    Triton pads a block) and w's [bn, bk] (two of them for gate/up pairs)."""
    rows = max(16, 1 << (rows - 1).bit_length())
    return stages * (rows * bk * x_bytes + (2 if pairs else 1) * bn * bk * w_bytes)


def tiling_for(N: int, K: int, *, norm: bool, pairs: bool, fp8: bool = False, rows: int = MAX_ROWS,
               x_bytes: int = 2, w_bytes: int | None = None) -> Tiling | None:
    """The tiling measured fastest on an H100 for each kind of layer matmul (Qwen2.5-Coder-1.5B shapes at 8 and
    16 tokens, benchmarks/kernels/bench_gemv.py's sweep; docs/lab/2026-11-24-gemv-kernels.md), adapted to shapes
    it divides; None where no block divides the shape (the caller uses XLA's GEMM). FP8 weights (one byte each)
    take K steps twice as long, 4 warps and 3 stages (benchmarks/profiles/fp8_matmul.py --sweep, 8 and 32 tokens,
    docs/lab/2026-11-27-fp8.md). Where `rows` activations of `x_bytes` each and the weight's tiles would not fit
    TILE_SMEM_BYTES (float32 activations at the long K steps), the K step is halved until they do."""
    w_bytes = (1 if fp8 else 2) if w_bytes is None else w_bytes
    fits = lambda bn, bk, stages: _tile_bytes(bn, bk, stages, rows=rows, x_bytes=x_bytes, w_bytes=w_bytes,  # noqa: E731
                                              pairs=pairs) <= TILE_SMEM_BYTES
    if pairs:      # gate/up with the norm and SwiGLU: 280 programs of 32 pairs
        bn, bk, S, warps, stages = 32, _largest_dividing(K, (256, 128, 64, 32, 16) if fp8 else (128, 64, 32, 16)), 1, \
            (4 if fp8 else 2), 3
    elif norm:     # q/k/v with the norm: 128 programs of 16 rows, long K steps
        bn, bk, S, warps, stages = 16, _largest_dividing(K, (512, 256, 128, 64, 32, 16)), 1, 4, 3
    else:          # o and down: K split so that each program walks ~1-2k of it
        bn, warps, stages = 32, (4 if fp8 else 2 if K >= 4096 else 4), (3 if fp8 else 5)
        bk = _largest_dividing(K, (256, 128, 64, 32, 16) if fp8 else (128, 64, 32, 16))
        while bk and bk > 16 and not fits(bn, bk, stages):
            bk //= 2
        S = next((s for s in (5, 7, 4, 3, 2, 1) if K % (s * bk) == 0 and K // s >= 512), 1) if bk else 1
    if bk is None or N % bn:
        bn = 16
        if bk is None or N % bn:
            return None
    while bk > 16 and not fits(bn, bk, stages):   # a halved K step still divides K
        bk //= 2
    return Tiling(bn, bk, S, warps, stages)
