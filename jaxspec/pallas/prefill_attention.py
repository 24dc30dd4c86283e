"""Paged attention for prefill chunks: one program per (query tile, query head), where a query tile is up to `q_tile`
consecutive tokens of one row (or per (query tile, kv head) with `heads_per_program`: a kv head's query heads share
each page group read). The program streams the row's KV pages once for the whole tile, a few pages at a
time, with an online softmax, and stops at the tile's furthest position (causal: later pages are never read).

The decode kernel (jaxspec.pallas.paged_attention) runs one program per token, each walking the row's whole context
on its own: a chunk of T tokens over a context of C reads the context T times over. Here it is read once per tile,
and the scores of a tile are one [q_tile, keys] matrix product (the matrix unit's shape) instead of T of [G, keys].

The tiles are found on the device from the step's layout (`tile_starts`): a step's rows are contiguous at
consecutive positions (`ForwardBatch.first_in_step`), each row is cut into tiles from its first token, so a row of
n tokens has ceil(n / q_tile) tiles and a decode row one tile of one token. The grid has room for the most tiles a
step of T tokens over R rows can have; the programs past the step's tiles return at once.

Layout as the decode kernel's: the KV pool [L, num_blocks*block_size, Hkv, hd] viewed as pages
[L, num_blocks, block_size, Hkv, hd], the layer an input (the whole pool is passed, no per-layer slice).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.common import interpreted, next_pow2, page_group, softmax_update

Q_TILE = 64          # query tokens per program: the matrix unit's rows for one head
# Query heads per program (`prefill_attention`'s heads_per_program; the group's divisor at most this): 1, the measured
# default (docs/lab/2026-12-07-long-prompts-gpu.md), reads each K/V page group once per query head; more read it once
# for that many heads of a kv head, not yet timed on a GPU (benchmarks/kernels/bench_prefill_attention.py --heads).
HEADS_PER_PROGRAM = 1
PAGES_PER_ITER = 4   # pages each loop iteration loads at once (4 x 16 keys)


def tile_starts(first_in_step, positions, q_tile: int, max_tiles: int):
    """The index in T of each query tile's first token, i32 [max_tiles] (T past the last tile): a token starts a
    tile where it lies a multiple of `q_tile` tokens after its row's first token of the step, and is no padding
    (position >= 0)."""
    T = positions.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    starts = ((t - first_in_step) % q_tile == 0) & (positions >= 0)
    return jnp.nonzero(starts, size=max_tiles, fill_value=T)[0].astype(jnp.int32)


def _kernel(layer_ref, window_ref, start_ref, pos_ref, first_ref, row_ref, tables_ref, sinks_ref, q_ref, k_ref, v_ref,
            o_ref, *, block_size: int, max_blocks: int, num_tokens: int, scale: float, group: int, q_tile: int,
            head_dim: int, pages_per_iter: int, heads: int, has_window: bool, has_sinks: bool):
    """Program (i, hg): tile i's tokens for the query heads hg*heads .. hg*heads+heads-1 (one kv head's), each K/V
    page group read once for all of them."""
    i, hg = pl.program_id(0), pl.program_id(1)
    t0 = start_ref[i]

    @pl.when(t0 < num_tokens)
    def _tile():
        layer, row, kv_head = layer_ref[0], row_ref[t0], (hg * heads) // group
        window = window_ref[0] if has_window else None
        tokens = pl.ds(t0, q_tile)
        in_range = t0 + jax.lax.broadcasted_iota(jnp.int32, (q_tile,), 0) < num_tokens
        # the tile: the tokens from t0 on that belong to t0's row (a row's tokens are contiguous) and are no padding
        first = plgpu.load(first_ref.at[tokens], mask=in_range, other=-1)
        pos = plgpu.load(pos_ref.at[tokens], mask=in_range, other=-1)
        mine = in_range & (first == first_ref[t0]) & (pos >= 0)
        pos = jnp.where(mine, pos, -1)
        rows = jnp.broadcast_to(mine[:, None], (q_tile, head_dim))
        head_ids = [hg * heads + g for g in range(heads)]
        qs = [plgpu.load(q_ref.at[tokens, h, :], mask=rows, other=0.0) for h in head_ids]    # [q_tile, hd] each
        last = jnp.max(pos)
        num_pages = jnp.minimum(last // block_size + 1, max_blocks)
        keys = pages_per_iter * block_size
        lo = 0
        if window is not None:      # the page group of the window's first key for the tile's first token
            lo = jnp.maximum(jnp.min(jnp.where(mine, pos, last)) - (window - 1), 0) // keys

        def pages(j, carry):
            k, v = page_group(tables_ref, k_ref, v_ref, layer, row, kv_head, j, pages_per_iter, num_pages,
                              qs[0].dtype)
            key_pos = j * keys + jax.lax.broadcasted_iota(jnp.int32, (q_tile, keys), 1)
            visible = key_pos <= pos[:, None]
            if window is not None:
                visible &= key_pos > pos[:, None] - window
            out = []
            for q, (o, m, l) in zip(qs, carry):    # the page group's keys and values, once for every head
                s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
                m_new, correction, p, l = softmax_update(m, l, jnp.where(visible, s, -1e30))
                o = o * correction[:, None] + jax.lax.dot_general(
                    p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                out.append((o, m_new, l))
            return tuple(out)

        def start(h):
            o0 = jnp.zeros((q_tile, head_dim), jnp.float32)
            if has_sinks:   # the head's sink logit counted once: max = the sink, sum = exp(0); it adds nothing to o
                sink = sinks_ref[h].astype(jnp.float32)
                return o0, jnp.full((q_tile,), sink, jnp.float32), jnp.ones((q_tile,), jnp.float32)
            return o0, jnp.full((q_tile,), -1e30, jnp.float32), jnp.zeros((q_tile,), jnp.float32)

        num_iters = pl.cdiv(num_pages, pages_per_iter)
        carry = jax.lax.fori_loop(lo, jnp.maximum(num_iters, lo), pages, tuple(start(h) for h in head_ids))
        for h, (o, _, l) in zip(head_ids, carry):
            o = o / jnp.maximum(l, 1e-30)[:, None]
            plgpu.store(o_ref.at[tokens, h, :], o.astype(o_ref.dtype), mask=rows)


@functools.partial(jax.jit, static_argnames=("block_size", "q_tile", "heads_per_program", "interpret"))
def prefill_attention(q, k_pool, v_pool, layer, positions, first_in_step, row_of_token, block_tables, *,
                      block_size: int, q_tile: int = Q_TILE, heads_per_program: int = 1, interpret: bool | None = None,
                      window=None, sinks=None, starts=None):
    """q [T, Hq, hd]; k_pool/v_pool [L, S, Hkv, hd] with this step's k/v already written; layer: i32 scalar;
    positions [T] (-1: padding, which attends to nothing and is left 0); first_in_step [T]: the index in T of the
    token's row's first token this step (the step's rows contiguous at consecutive positions); row_of_token [T];
    block_tables [R, MB] (-1: no block). Each token attends to its row's keys at positions <= its own (and, with a
    sliding `window`, an i32 scalar, > its own - window: the pages before it are not read). `sinks`: f32 [Hq], each
    query head's attention-sink logit, or None. `starts`: the tiles' first tokens, i32 [n] (None: `tile_starts`, with
    room for the most tiles; GPU programs run in no order, so any order gives the same output). `heads_per_program`:
    query heads one program takes, all of one kv head's (a divisor of the group): each K/V page group is read once for
    them (1: one program per query head). -> [T, Hq*hd]."""
    interpret = interpreted(interpret)
    T, Hq, hd = q.shape
    L, S, Hkv, _ = k_pool.shape
    R, MB = block_tables.shape
    if (Hq // Hkv) % heads_per_program:
        raise ValueError(f"heads_per_program={heads_per_program} must divide the {Hq // Hkv} query heads of a kv head")
    q_tile = min(q_tile, max(16, next_pow2(T)))
    # the most tiles: every row's last tile may be partial
    if starts is None:
        max_tiles = min(T, -(-T // q_tile) + R)
        starts = tile_starts(first_in_step.astype(jnp.int32), positions.astype(jnp.int32), q_tile, max_tiles)
    P = min(PAGES_PER_ITER, next_pow2(MB))
    MBp = -(-MB // P) * P
    if MBp != MB:     # tables padded to whole iterations, so a page group never reads past a row's end
        block_tables = jnp.pad(block_tables, ((0, 0), (0, MBp - MB)), constant_values=-1)
    # On a GPU masked lanes touch no memory; the interpreter slices instead (and clamps slices that run past the
    # end), so there the token axis gets q_tile spare tokens.
    spare = q_tile if interpret else 0
    pad = lambda x, value=0: jnp.pad(x, [(0, spare)] + [(0, 0)] * (x.ndim - 1), constant_values=value)  # noqa: E731
    pages = (L, S // block_size, block_size, Hkv, hd)
    kernel = functools.partial(_kernel, block_size=block_size, max_blocks=MB, num_tokens=T, scale=hd ** -0.5,
                               group=Hq // Hkv, q_tile=q_tile, head_dim=hd, pages_per_iter=P, heads=heads_per_program,
                               has_window=window is not None, has_sinks=sinks is not None)
    ins = [jnp.reshape(layer, (1,)).astype(jnp.int32),
           jnp.reshape(jnp.asarray(0 if window is None else window, jnp.int32), (1,)),
           starts.astype(jnp.int32), pad(positions.astype(jnp.int32), -1), pad(first_in_step.astype(jnp.int32), -1),
           pad(row_of_token.astype(jnp.int32)), block_tables.astype(jnp.int32),
           jnp.zeros((Hq,), jnp.float32) if sinks is None else sinks.astype(jnp.float32).reshape(Hq),
           pad(q), k_pool.reshape(pages), v_pool.reshape(pages)]
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))  # noqa: E731
    out_shape = jax.ShapeDtypeStruct((T + spare, Hq, hd), q.dtype)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2))
    out = pl.pallas_call(
        kernel,
        grid=(starts.shape[0], Hq // heads_per_program),
        in_specs=[whole(x.shape) for x in ins],
        out_specs=whole(out_shape.shape),
        out_shape=out_shape,
        interpret=interpret,
        name="prefill_attention",
        **params,
    )(*ins)
    # tokens no tile covers (padding) are left as the output buffer was: zeroed here so they are defined
    out = jnp.where((positions >= 0)[:, None, None], out[:T], 0)
    return out.reshape(T, Hq * hd)
