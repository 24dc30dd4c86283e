"""The experts' grouped matmul of a mixture-of-experts layer, reading only the experts that rows were routed to:

    y [R, N] = x [R, K] @ W[layer, e(r)] [K, N]     rows sorted by expert: the first group_sizes[0] rows go to
                                                     expert 0, the next group_sizes[1] to expert 1, ...
                                                     (W stacked [L, E, K, N], read in place)
      FP8       W in e4m3, converted to x's dtype tile by tile, each output column's sum times its expert's
                scale [L, E, N] (W8A16, as jaxspec.nn.quant.fp8_ragged_dot)

XLA lowers `jax.lax.ragged_dot` on a GPU to a dense product of every row with every expert ([R, E, N], then the
row's own expert selected): each step reads all E experts' weights, whatever the routing. A decode step of one
token routes to k of them (GPT-OSS-20B: 4 of 32, Qwen3-30B-A3B: 8 of 128), so the dense form reads 8-16x the
weights the step needs, and at speculative-verify sizes multiplies E-fold flops as well.

Here the rows are cut into tiles of at most `block_m` rows of one expert (`tile_table`, computed on the device from
the group sizes: no host round-trip), and one program owns a (tile, block of `block_n` output columns) pair: it
walks K `block_k` at a time, reading its expert's [block_k, block_n] weight tiles and its rows' x. An expert with
no rows has no tile and is never read; one with more than block_m rows is read once per tile. The grid is sized
for the worst case (ceil(R / block_m) + min(E, R) tiles); the programs of tiles past the last used one return at
once. A decode step has few rows (one token: k tiles of one row each), too few (tile, column block) programs to
keep every SM streaming; `splits` > 1 then also cuts K into that many parts, each program summing one part into a
float32 partial [splits, R, N] that one small fusion adds up.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.common import interpreted


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Rows per tile (one expert's), output columns and K per loop iteration, Triton's warps and stages, and the
    parts K is split into (each its own program)."""
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    splits: int = 1


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most tiles R rows can need: every group's last tile may be partial, so one more per non-empty group."""
    return -(-num_rows // block_m) + min(num_experts, num_rows)


def tile_table(group_sizes, num_rows: int, block_m: int):
    """group_sizes i32[E] (summing to num_rows) -> (expert, start, end) i32[max_tiles] each: tile t covers rows
    [start, end) of expert `expert`, at most block_m of them; tiles past the last used one are empty (start = end)."""
    E = group_sizes.shape[0]
    n = max_tiles(num_rows, E, block_m)
    group_sizes = group_sizes.astype(jnp.int32)
    group_end = jnp.cumsum(group_sizes)
    group_start = group_end - group_sizes
    tiles = (group_sizes + block_m - 1) // block_m                          # [E]: 0 for an empty group
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(n, dtype=jnp.int32)
    # compare_all: one fused [n, E] comparison; the default binary search is a while loop of ~log2(E) iterations,
    # each a few kernels and a host round-trip on a GPU (~0.2 ms a layer in GPT-OSS-20B's decode step)
    expert = jnp.minimum(jnp.searchsorted(tile_end, t, side="right", method="compare_all"), E - 1).astype(jnp.int32)
    first = tile_end[expert] - tiles[expert]                                 # the expert's first tile
    start = group_start[expert] + (t - first) * block_m
    end = jnp.minimum(start + block_m, group_end[expert])
    used = t < tile_end[-1]
    return expert, jnp.where(used, start, 0), jnp.where(used, end, 0)


def _kernel(expert_ref, start_ref, end_ref, layer_ref, x_ref, w_ref, *refs, K: int, tiling: Tiling, scaled: bool):
    scale_ref, o_ref = refs if scaled else (None, *refs)
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    t, n, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end, e, layer = start_ref[t], end_ref[t], expert_ref[t], layer_ref[0]
    n0, part = n * bn, -(-(K // bk) // tiling.splits)          # K steps of each split (the last may have fewer)
    first, last = split * part, jnp.minimum((split + 1) * part, K // bk)
    # float32 operands get float32 products (Triton's default for them is TF32)
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    @pl.when(end > start)
    def _():
        rows_ok = start + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 0) < end

        def step(j, acc):
            k = j * bk
            x = plgpu.load(x_ref.at[pl.ds(start, bm), pl.ds(k, bk)], mask=rows_ok, other=0.0)
            w = w_ref[layer, e, pl.ds(k, bk), pl.ds(n0, bn)].astype(x.dtype)
            return acc + jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                                             precision=precision)

        acc = jax.lax.fori_loop(first, jnp.maximum(last, first), step, jnp.zeros((bm, bn), jnp.float32))
        if scaled:
            acc = acc * scale_ref[layer, e, pl.ds(n0, bn)][None, :]
        out_ok = start + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < end
        plgpu.store(o_ref.at[split, pl.ds(start, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask=out_ok)


def _largest_dividing(n: int, options) -> int | None:
    return next((o for o in options if n % o == 0), None)


def tiling_for(N: int, K: int, num_rows: int | None = None, num_experts: int | None = None,
               num_sms: int = 132) -> Tiling | None:
    """The tiling measured fastest on an H100 (GPT-OSS-20B's experts, 1 to 160 tokens: benchmarks/kernels/
    bench_grouped_matmul.py --sweep, docs/lab/2026-11-27-moe-kernel.md): the widest column block and K step that
    divide the weight's [K, N], 4 warps, 4 stages; None where none divides it (the caller keeps XLA's ragged_dot).
    Given the rows and experts, K is split (1, 2, 4 or 8 parts) until the programs of the tiles a routing of that
    many rows is expected to use (one per routed expert, min(rows, experts), or one per block_m rows) fill the SMs
    twice over."""
    bn, bk = _largest_dividing(N, (128, 64, 32, 16)), _largest_dividing(K, (64, 32, 16))
    if bn is None or bk is None:
        return None
    splits = 1
    if num_rows is not None and num_experts is not None:
        tiles = max(min(num_rows, num_experts), -(-num_rows // Tiling.block_m))
        while splits < 8 and tiles * (N // bn) * splits < 2 * num_sms and 2 * splits <= K // bk:
            splits *= 2
    return Tiling(block_n=bn, block_k=bk, num_stages=4, splits=splits)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "interpret"))
def grouped_matmul(x, w, layer, group_sizes, scale=None, *, tiling: Tiling = Tiling(), out_dtype=None,
                   interpret: bool | None = None):
    """x [R, K] with its rows sorted by expert, w [L, E, K, N], layer: i32 scalar, group_sizes i32[E] (rows per
    expert, summing to R) -> [R, N] in out_dtype (None: x's dtype), float32 accumulation; as
    `jax.lax.ragged_dot(x, w[layer], group_sizes)`. scale f32[L, E, N]: w holds FP8 values, each expert's output
    column scaled by its own scale."""
    interpret = interpreted(interpret)
    R, K = x.shape
    L, E, Kw, N = w.shape
    if Kw != K or group_sizes.shape != (E,):
        raise ValueError(f"x {x.shape}, w {w.shape} and group_sizes {group_sizes.shape} disagree: expected x [R, K], "
                         f"w [L, E, K, N], group_sizes [E]")
    if N % tiling.block_n or K % tiling.block_k or not 1 <= tiling.splits <= K // tiling.block_k:
        raise ValueError(f"tiling {tiling} does not fit N={N}, K={K}: block_n and block_k must divide them, and "
                         f"splits be 1 to K / block_k")
    bm = tiling.block_m
    expert, start, end = tile_table(group_sizes, R, bm)
    # rows padded by one tile, so that a tile's block of rows never runs past the arrays (the interpreter clamps a
    # slice past the end instead of masking it)
    xp = jnp.pad(x, ((0, bm), (0, 0)))
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    args = [expert, start, end, jnp.reshape(layer, (1,)).astype(jnp.int32), xp, w]
    if scale is not None:
        if scale.shape != (L, E, N):
            raise ValueError(f"scale {scale.shape} does not match the weight {w.shape}: expected [L, E, N]")
        args.append(scale.astype(jnp.float32))
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(
        num_warps=tiling.num_warps, num_stages=tiling.num_stages))
    S = tiling.splits
    part_dtype = out_dtype if S == 1 else jnp.dtype(jnp.float32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, n, s: (0,) * a.ndim)  # noqa: E731
    out = pl.pallas_call(functools.partial(_kernel, K=K, tiling=tiling, scaled=scale is not None),
                         grid=(expert.shape[0], N // tiling.block_n, S), in_specs=[whole(a) for a in args],
                         out_specs=pl.BlockSpec((S, R + bm, N), lambda t, n, s: (0, 0, 0)),
                         out_shape=jax.ShapeDtypeStruct((S, R + bm, N), part_dtype), interpret=interpret,
                         name="grouped_matmul", **params)(*args)
    return out[0, :R] if S == 1 else out[:, :R].sum(0).astype(out_dtype)
