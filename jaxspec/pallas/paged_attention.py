"""Paged attention that reads the KV pages in place: one program per (token, kv head, context split)
walks its share of the row's block table, a few pages at a time, with an online softmax. Nothing is
gathered into a dense context.

A decode step has few tokens, so one program per (token, kv head) leaves most of the GPU idle while each
walks its context in dependent iterations. Splitting the context over `num_splits` programs (each split
keeps its own max and sum) and merging the splits afterwards shortens that walk.

Layout: the KV pool of the forward, k/v [L, num_blocks*block_size, Hkv, hd], viewed (for free) as
[L, num_blocks, block_size, Hkv, hd]; the kernel takes the layer index as an input so the whole pool
is passed as is (no per-layer slice copy). Query heads of one kv head (GQA group G) are one tile,
read as 16 rows (the matrix unit's smallest tile), the rows past G masked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.common import interpreted, next_pow2, page_group, softmax_update, to_kv_dtype

_MIN_ROWS = 16  # the matrix unit's smallest tile
PAGES_PER_ITER = 4  # pages each loop iteration loads at once (4 x 16 keys)
# Context splits this (unfused) kernel uses. Measured on an H100 from replayed steps
# (docs/lab/2026-11-22-second-round.md), per layer: 1 vs 8 splits 2.6 vs 4.0 us at 200-token contexts, 3.5 vs 2.4 us at
# 1000, 6.6 vs 2.8 us at 2500, so one split. Traced in a live decode the fused kernel with one split took 9-14 us per
# layer at 64-200 tokens, which the replays did not show; the fused kernel splits decode steps (`fused_splits`), this
# one is left as measured.
NUM_SPLITS = 1


def _kernel(layer_ref, window_ref, pos_ref, row_ref, tables_ref, sinks_ref, q_ref, k_ref, v_ref, *out_refs,
            block_size: int, max_blocks: int, scale: float, group: int, q_block_shape: tuple[int, int],
            pages_per_iter: int, num_splits: int, has_window: bool, has_sinks: bool):
    t, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, pos, row = layer_ref[0], pos_ref[t], row_ref[t]
    window = window_ref[0] if has_window else None
    rows_q, hd = q_block_shape
    # This kv head's G query heads, read straight from q [T, Hq, hd]: rows past G are masked, so q needs
    # no padded copy and the output no slice.
    in_group = jax.lax.broadcasted_iota(jnp.int32, (rows_q, hd), 0) < group
    q = plgpu.load(q_ref.at[t, pl.ds(h * group, rows_q), :], mask=in_group, other=0.0)
    num_pages = jnp.minimum(pos // block_size + 1, max_blocks)
    keys = pages_per_iter * block_size
    # This split's share of the iterations over the row's pages (a padding token, position -1, has none); with a
    # sliding window, from the page of the window's first key.
    num_iters = pl.cdiv(num_pages, pages_per_iter)
    lo = 0 if window is None else jnp.maximum(pos - (window - 1), 0) // keys
    per_split = pl.cdiv(jnp.maximum(num_iters - lo, 0), num_splits)
    first = lo + split * per_split
    last = jnp.minimum(first + per_split, num_iters)

    def pages(j, carry):  # `pages_per_iter` pages (their loads in flight together) per iteration
        o, m, l = carry
        k, v = page_group(tables_ref, k_ref, v_ref, layer, row, h, j, pages_per_iter, num_pages, q.dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale     # [G16, P*bs]
        key_pos = j * keys + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        visible = key_pos <= pos if window is None else (key_pos <= pos) & (key_pos > pos - window)
        m_new, correction, p, l = softmax_update(m, l, jnp.where(visible, s, -1e30))
        o = o * correction[:, None] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return o, m_new, l

    m0, l0 = _softmax_start(sinks_ref, h * group, rows_q, group, split, has_sinks)
    init = (jnp.zeros((rows_q, hd), jnp.float32), m0, l0)
    o, m, l = jax.lax.fori_loop(first, jnp.maximum(last, first), pages, init)
    o = o / jnp.maximum(l, 1e-30)[:, None]  # a split (or padding token) that visits no page: 0, never NaN
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[t, pl.ds(h * group, rows_q), :], o.astype(o_ref.dtype), mask=in_group)
    else:  # this split's normalized output, max and sum; `_merge_splits` combines them
        o_ref, m_ref, l_ref = out_refs
        plgpu.store(o_ref.at[t, split, pl.ds(h * group, rows_q), :], o, mask=in_group)
        in_group_rows = jax.lax.broadcasted_iota(jnp.int32, (rows_q,), 0) < group
        plgpu.store(m_ref.at[t, split, pl.ds(h * group, rows_q)], m, mask=in_group_rows)
        plgpu.store(l_ref.at[t, split, pl.ds(h * group, rows_q)], l, mask=in_group_rows)


def _softmax_start(sinks_ref, first_head: int, rows: int, group: int, split, has_sinks: bool):
    """The online softmax's running max and sum before any key, for `rows` query heads from `first_head` (those
    past `group` masked): nothing seen (-1e30, 0), or with attention sinks each head's sink logit counted once, in
    split 0 (max = the sink, sum = exp(0) = 1: the sink joins the sum and adds nothing to the output)."""
    nothing = (jnp.full((rows,), -1e30, jnp.float32), jnp.zeros((rows,), jnp.float32))
    if not has_sinks:
        return nothing
    in_group = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < group
    sink = plgpu.load(sinks_ref.at[pl.ds(first_head, rows)], mask=in_group, other=-1e30).astype(jnp.float32)
    mine = (split == 0) & in_group
    return jnp.where(mine, sink, nothing[0]), jnp.where(mine, 1.0, 0.0).astype(jnp.float32)


def _sinks_input(sinks, num_heads: int, spare: int):
    """Attention sinks as the kernels read them: f32 [Hq + spare] (unread without sinks)."""
    if sinks is None:
        return jnp.zeros((num_heads + spare,), jnp.float32)
    return jnp.pad(sinks.astype(jnp.float32).reshape(num_heads), (0, spare))


def _window_input(window):
    """The sliding window as the kernels read it: an i32 [1] (unread without a window)."""
    return jnp.reshape(jnp.asarray(0 if window is None else window, jnp.int32), (1,))


def _merge_splits_reference(o, m, l):
    """o [T, S, H, hd] (each split normalized by its own sum), m, l [T, S, H] -> [T, H, hd] f32."""
    weight = l * jnp.exp(m - jnp.max(m, axis=1, keepdims=True))          # [T, S, H]; empty splits weigh 0
    total = jnp.maximum(jnp.sum(weight, axis=1), 1e-30)
    return jnp.einsum("tsh,tshd->thd", weight, o) / total[..., None]


def _merge_kernel(o_ref, m_ref, l_ref, out_ref):
    t, h = pl.program_id(0), pl.program_id(1)
    m, l = m_ref[t, :, h], l_ref[t, :, h]                                  # [S]
    weight = l * jnp.exp(m - jnp.max(m))                                   # an empty split weighs 0
    total = jnp.maximum(jnp.sum(weight), 1e-30)
    out = jnp.sum(weight[:, None] * o_ref[t, :, h, :], axis=0) / total    # [hd]
    out_ref[t, h, :] = out.astype(out_ref.dtype)


# XLA compiles the reference merge to three kernels (two reductions and the weighted sum, 4.0 us a layer in a
# batch-1 decode on an H100); one program per (token, head) does it in one (2.1 us). MERGE_KERNEL = False
# keeps XLA's.
MERGE_KERNEL = True


def _merge_splits(o, m, l, num_heads: int, dtype, interpret: bool):
    """The splits' outputs merged: o [T, S, H', hd], m, l [T, S, H'] -> [T, num_heads, hd] in `dtype`."""
    if not MERGE_KERNEL or o.shape[1] & (o.shape[1] - 1):    # (the kernel's tile of splits is a power of two)
        return _merge_splits_reference(o, m, l)[:, :num_heads].astype(dtype)
    T, S, _, hd = o.shape
    whole = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)  # noqa: E731
    out_shape = jax.ShapeDtypeStruct((T, num_heads, hd), dtype)
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1))
    return pl.pallas_call(_merge_kernel, grid=(T, num_heads), in_specs=[whole(o), whole(m), whole(l)],
                          out_specs=pl.BlockSpec(out_shape.shape, lambda t, h: (0, 0, 0)), out_shape=out_shape,
                          interpret=interpret, name="merge_splits", **params)(o, m, l)


@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "interpret"))
def paged_attention(q, k_pool, v_pool, layer, positions, row_of_token, block_tables, *, block_size: int,
                    num_splits: int = 1, interpret: bool | None = None, window=None, sinks=None):
    """q [T, Hq, hd]; k_pool/v_pool [L, S, Hkv, hd]; layer: i32 scalar; positions, row_of_token [T];
    block_tables [R, MB] (-1: no block). Each token attends to its row's keys at positions <= its own (and, with a
    sliding `window`, an i32 scalar, > its own - window: the pages before the window are not read). `sinks`: f32
    [Hq], each query head's attention-sink logit (in the softmax's sum, attending to nothing), or None.
    num_splits: programs sharing one token's context. -> [T, Hq*hd]."""
    interpret = interpreted(interpret)
    T, Hq, hd = q.shape
    L, S, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    G16 = max(_MIN_ROWS, next_pow2(G))
    # On a GPU masked lanes touch no memory; the interpreter slices instead (and clamps slices that run
    # past the end), so there the head axis gets G16 spare rows.
    spare = G16 if interpret else 0
    q_rows = Hq + spare
    pages = (L, S // block_size, block_size, Hkv, hd)
    R, MB = block_tables.shape
    # Tables padded to whole iterations (-1: no block), so a page group never reads past a row's end.
    P = min(PAGES_PER_ITER, next_pow2(MB))
    MBp = -(-MB // P) * P
    if MBp != MB:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, MBp - MB)), constant_values=-1)
    NS = num_splits
    kernel = functools.partial(_kernel, block_size=block_size, max_blocks=MB, scale=hd ** -0.5, group=G,
                               q_block_shape=(G16, hd), pages_per_iter=P, num_splits=NS, has_window=window is not None,
                               has_sinks=sinks is not None)
    whole = lambda shape: pl.BlockSpec(shape, lambda t, h, s: (0,) * len(shape))  # noqa: E731
    if NS == 1:
        out_shape = [jax.ShapeDtypeStruct((T, q_rows, hd), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((T, NS, q_rows, hd), jnp.float32),
                     jax.ShapeDtypeStruct((T, NS, q_rows), jnp.float32),
                     jax.ShapeDtypeStruct((T, NS, q_rows), jnp.float32)]
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2))
    outs = pl.pallas_call(
        kernel,
        grid=(T, Hkv, NS),
        in_specs=[whole((1,)), whole((1,)), whole((T,)), whole((T,)), whole((R, MBp)), whole((q_rows,)),
                  whole((T, q_rows, hd)), whole(pages), whole(pages)],
        out_specs=[whole(o.shape) for o in out_shape],
        out_shape=out_shape,
        interpret=interpret,
        name="paged_attention",
        **params,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), _window_input(window), positions.astype(jnp.int32),
      row_of_token.astype(jnp.int32), block_tables.astype(jnp.int32), _sinks_input(sinks, Hq, spare),
      jnp.pad(q, ((0, 0), (0, spare), (0, 0))) if spare else q,
      k_pool.reshape(pages), v_pool.reshape(pages))
    out = outs[0][:, :Hq] if NS == 1 else _merge_splits(*outs, Hq, q.dtype, interpret)
    return out.reshape(T, Hq * hd)


# ---- attention with the step's rotary embedding and KV write inside ----------------------------------------
#
# The unfused layer runs five kernels between the q/k/v matmul and o: rotary on q, rotary on k with k's
# scatter into the pool, v's scatter, the padding mask, and the attention (H100 trace, 1.5B: 6.7 us of each
# layer's 55). Here one program per (token, kv head) does all of it: it rotates its q rows and its own k,
# writes its k/v into the pool, and attends. Programs run in no order, so a program may not read a key another
# program of this step writes: the keys a token sees are split at its row's first position in the step, p0.
# Those before p0 were written by earlier steps and are read from the pool's pages; those from p0 to the
# token's own position are this step's, read from the projection itself (rows first..t of qkv, rotated again
# by each reader). That needs the batch's rows contiguous at consecutive positions with every token writing
# its KV (`ForwardBatch.first_in_step`), which the engine's step batches are. Rotary pairs element j with
# j + hd/2, so every head row is handled as its two halves (two dots of hd/2 instead of one of hd). A
# decode-sized step also splits each token's pages over several programs (`fused_splits`; split 0 writes the
# KV, the last split takes the step's own keys) and merges the splits after, as flash-decoding does.

def _fused_kernel(layer_ref, wlayer_ref, window_ref, pos_ref, slot_ref, first_ref, row_ref, tables_ref, sinks_ref,
                  qkv_ref, cos_ref, sin_ref, *refs, block_size: int, max_blocks: int, num_kv_slots: int, scale: float,
                  group: int, q_rows: int, chunk: int, pages_per_iter: int, num_splits: int, has_bias: bool,
                  has_norm: bool, eps: float, has_window: bool, has_sinks: bool):
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    q_norm_ref, k_norm_ref = (refs.pop(0), refs.pop(0)) if has_norm else (None, None)
    k_ref, v_ref, *out_refs, k_out_ref, v_out_ref = refs
    t, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, wlayer, slot, row = layer_ref[0], wlayer_ref[0], slot_ref[t], row_ref[t]
    window = window_ref[0] if has_window else None
    writes = slot < num_kv_slots
    pos = jnp.where(writes, pos_ref[t], -1)          # a token that writes no KV is padding: it sees no key
    first = first_ref[t]
    p0 = pos - (t - first)                           # this row's first position in the step
    hd = qkv_ref.shape[-1]
    G, W, half = group, group + 2, hd // 2
    dtype = qkv_ref.dtype
    halves = (pl.ds(0, half), pl.ds(half, half))
    k_row, v_row = h * W + G, h * W + G + 1          # this kv head's k and v rows of a token's qkv
    wl = pl.ds(wlayer, 1)

    def load(ref, idx, mask=None):
        """f32 halves of `ref` at the leading indices `idx` (its last axis is head_dim)."""
        kw = {} if mask is None else dict(mask=mask, other=0.0)
        return tuple(plgpu.load(ref.at[(*idx, part)], **kw).astype(jnp.float32) for part in halves)

    def with_bias(x, rows, mask=None):
        """qkv rows + the bias (in the model's dtype, as the unfused layer adds it)."""
        if not has_bias:
            return x
        b = load(bias_ref, (wlayer, rows), mask)
        return tuple((xi + bi).astype(dtype).astype(jnp.float32) for xi, bi in zip(x, b))

    def rotate(x, norm_ref, cos, sin):
        """Halves x [n, hd/2] (f32) -> RMSNorm (q_norm / k_norm, rounded to the model's dtype as the unfused layer
        rounds) and rotary: the rotated halves in the model's dtype."""
        x1, x2 = x
        if norm_ref is not None:
            inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=-1, keepdims=True) +
                                 jnp.sum(x2 * x2, axis=-1, keepdims=True)) / hd + eps)
            w1, w2 = load(norm_ref, (wl,))
            x1 = (w1 * (x1 * inv)).astype(dtype).astype(jnp.float32)
            x2 = (w2 * (x2 * inv)).astype(dtype).astype(jnp.float32)
        return (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)

    one = pl.ds(t, 1)
    cos_t, sin_t = (plgpu.load(ref.at[one, :]) for ref in (cos_ref, sin_ref))                  # [1, hd/2]

    # This kv head's G query heads (rows h*W .. h*W+G-1 of the token's qkv), read as a tile of q_rows rows.
    in_group = jax.lax.broadcasted_iota(jnp.int32, (q_rows, half), 0) < G
    q_tile = pl.ds(h * W, q_rows)
    q = rotate(with_bias(load(qkv_ref, (t, q_tile), in_group), q_tile, in_group), q_norm_ref, cos_t, sin_t)

    @pl.when(writes & (split == 0))
    def _write_own_kv():   # the token's own k (rotated) and v into the pool, where later steps read them
        k = rotate(with_bias(load(qkv_ref, (one, k_row)), pl.ds(k_row, 1)), k_norm_ref, cos_t, sin_t)  # [1, hd/2]
        v = with_bias(load(qkv_ref, (one, v_row)), pl.ds(v_row, 1))
        dst = (layer, slot // block_size, pl.ds(slot % block_size, 1), h)
        for ref, x in ((k_out_ref, k), (v_out_ref, v)):
            for part, xi in zip(halves, x):
                plgpu.store(ref.at[(*dst, part)], to_kv_dtype(xi, ref.dtype))

    def attend(carry, k, v, visible):
        """One online-softmax update: keys k and values v as halves [n, hd/2], `visible` [q_rows, n]."""
        o1, o2, m, l = carry
        s = sum(jax.lax.dot_general(qi, ki.astype(dtype), (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) for qi, ki in zip(q, k)) * scale
        m_new, correction, p, l = softmax_update(m, l, jnp.where(visible, s, -1e30))
        o1, o2 = (oi * correction[:, None] + jax.lax.dot_general(
            p.astype(dtype), vi.astype(dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            for oi, vi in zip((o1, o2), v))
        return o1, o2, m_new, l

    # (1) the keys before p0, in the pool: the row's pages, `pages_per_iter` at a time, this split's share of them.
    keys = pages_per_iter * block_size
    num_pages = jnp.where(pos >= 0, jnp.minimum(pl.cdiv(p0, block_size), max_blocks), 0)

    def pages(j, carry):
        table_idx = j * pages_per_iter + jax.lax.broadcasted_iota(jnp.int32, (pages_per_iter,), 0)
        blocks = jnp.maximum(tables_ref[row, pl.ds(j * pages_per_iter, pages_per_iter)], 0)
        blocks = jnp.where(table_idx < num_pages, blocks, 0)
        k = tuple(k_ref[layer, blocks, :, h, part].reshape(keys, half) for part in halves)
        v = tuple(v_ref[layer, blocks, :, h, part].reshape(keys, half) for part in halves)
        key_pos = j * keys + jax.lax.broadcasted_iota(jnp.int32, (q_rows, keys), 1)
        visible = key_pos < p0 if window is None else (key_pos < p0) & (key_pos > pos - window)
        return attend(carry, k, v, visible)

    # (2) this step's keys, p0 .. pos: the row's tokens first .. t of qkv, `chunk` at a time, rotated here.
    def in_step(j, carry):
        start = first + j * chunk
        rows = pl.ds(start, chunk)
        mine = start + jax.lax.broadcasted_iota(jnp.int32, (chunk, half), 0) <= t
        cos, sin = (plgpu.load(ref.at[rows, :], mask=mine, other=0.0) for ref in (cos_ref, sin_ref))
        k = rotate(with_bias(load(qkv_ref, (rows, k_row), mine), pl.ds(k_row, 1)), k_norm_ref, cos, sin)
        v = with_bias(load(qkv_ref, (rows, v_row), mine), pl.ds(v_row, 1))
        if jnp.dtype(k_ref.dtype).itemsize == 1:   # an fp8 pool: the keys as later steps will read them back
            k, v = (tuple(to_kv_dtype(xi, k_ref.dtype) for xi in x) for x in (k, v))
        key_row = start + jax.lax.broadcasted_iota(jnp.int32, (q_rows, chunk), 1)   # at position pos - (t - row)
        visible = key_row <= t if window is None else (key_row <= t) & (key_row > t - window)
        return attend(carry, k, v, visible)

    zeros = jnp.zeros((q_rows, half), jnp.float32)
    carry = (zeros, zeros, *_softmax_start(sinks_ref, h * G, q_rows, G, split, has_sinks))
    num_iters = pl.cdiv(num_pages, pages_per_iter)
    lo = 0 if window is None else jnp.maximum(pos - (window - 1), 0) // keys   # the window's first page group
    per_split = pl.cdiv(jnp.maximum(num_iters - lo, 0), num_splits)
    begin = lo + split * per_split
    carry = jax.lax.fori_loop(begin, jnp.maximum(jnp.minimum(begin + per_split, num_iters), begin), pages, carry)
    # (2), this step's own keys, is the last split's share
    in_step_iters = jnp.where((pos >= 0) & (split == num_splits - 1), pl.cdiv(t - first + 1, chunk), 0)
    carry = jax.lax.fori_loop(0, in_step_iters, in_step, carry)
    o1, o2, m, l = carry
    total = jnp.maximum(l, 1e-30)[:, None]      # a split (or padding token) that visits no key: 0, never NaN
    if num_splits == 1:
        (o_ref,) = out_refs
        for part, oi in zip(halves, (o1, o2)):
            plgpu.store(o_ref.at[t, pl.ds(h * G, q_rows), part], (oi / total).astype(o_ref.dtype), mask=in_group)
    else:   # this split's normalized output, max and sum; `_merge_splits` combines the splits
        o_ref, m_ref, l_ref = out_refs
        for part, oi in zip(halves, (o1, o2)):
            plgpu.store(o_ref.at[t, split, pl.ds(h * G, q_rows), part], oi / total, mask=in_group)
        rows_in_group = jax.lax.broadcasted_iota(jnp.int32, (q_rows,), 0) < G
        plgpu.store(m_ref.at[t, split, pl.ds(h * G, q_rows)], m, mask=rows_in_group)
        plgpu.store(l_ref.at[t, split, pl.ds(h * G, q_rows)], l, mask=rows_in_group)


def fused_splits(num_tokens: int, max_pages: int = 0) -> int:
    """Programs that share one token's context in the fused kernel. A decode step has one real token per row, and
    one program walking a 200-token context page by page took 9-14 us per layer on an H100 (a dependent loop of
    loads, the GPU nearly idle): split, each program takes a page or two per iteration (`_split_pages`) and the
    splits are merged after (`_merge_splits`). Larger steps have programs enough, and the merge's [T, splits, H,
    hd] buffer grows with T. `max_pages`: the block table's width (max_model_len's pages); with FUSED_PAGES_PER_SPLIT
    set, a long one (at least FUSED_LONG_CONTEXT_PAGES) gets splits enough that none walks more than that many pages
    at full length (a 32k context split 16 ways walks 128 dependent pages per program: decode at 32k cost 3.7x decode
    at 2k on an H100), as far as FUSED_MAX_TOKEN_SPLITS allows. A power of two: the merge kernel reads a token's
    splits as one tile."""
    splits = min(FUSED_MAX_SPLITS, FUSED_SPLIT_PROGRAMS // num_tokens)
    if FUSED_PAGES_PER_SPLIT and max_pages >= FUSED_LONG_CONTEXT_PAGES:
        splits = max(splits, min(-(-max_pages // FUSED_PAGES_PER_SPLIT), FUSED_MAX_TOKEN_SPLITS // num_tokens))
    splits = max(1, splits)
    return 1 << (splits.bit_length() - 1)


FUSED_MAX_SPLITS = 16
FUSED_SPLIT_PROGRAMS = 128     # tokens x splits the split count aims at (8 tokens: 16 splits; >= 128 tokens: 1)
# Long contexts (block tables of FUSED_LONG_CONTEXT_PAGES pages or more: max_model_len 8192 at 16-token pages; the
# default 4096 keeps the count above): pages one split walks at most at max_model_len, within tokens x splits of
# FUSED_MAX_TOKEN_SPLITS (the merge's buffer). 0, the default, keeps the count above at every length: on an H100
# (benchmarks/kernels/bench_decode_attention.py, docs/lab/2026-12-07-long-prompts-gpu.md) one decode row at a 32k
# context took 302 / 213 / 190 us a layer at 16 / 32 / 64 splits, but 8 rows took 321 / 416 / 370 us, and the
# engine-level A/B (long_prompts.py --fused-pages-per-split 64 against 0) is not run yet.
FUSED_LONG_CONTEXT_PAGES = 512
FUSED_PAGES_PER_SPLIT = 0
FUSED_MAX_TOKEN_SPLITS = 512
FUSED_SPLIT_PAGES_PER_ITER = None   # pages a split program loads per iteration (None: `_split_pages`)


def _split_pages(num_splits: int, block_size: int) -> int:
    """Pages a split program loads per iteration, at least the matrix unit's 16 keys: one with many splits (each
    walks a page or two of a decode row), two with few (batch 32 on an H100: 9.0 against 9.8 us a layer)."""
    pages = FUSED_SPLIT_PAGES_PER_ITER or (1 if num_splits >= 8 else 2)
    return max(pages, _MIN_ROWS // block_size)


@functools.partial(jax.jit, static_argnames=("num_heads", "block_size", "eps", "num_splits", "interpret"))
def paged_attention_fused(qkv, k_pool, v_pool, layer, cos, sin, positions, slot_mapping, first_in_step,
                          row_of_token, block_tables, bias=None, q_norm=None, k_norm=None, weight_layer=0, *,
                          num_heads: int, block_size: int, eps: float = 1e-6, num_splits: int | None = None,
                          interpret: bool | None = None, window=None, sinks=None):
    """Attention with the rotary embedding and the KV write inside, for a step whose rows' tokens are contiguous.

    qkv [T, Hkv*(G+2)*hd]: the q/k/v projection (for each kv head its G query heads, then k, then v), before
    the bias, q/k norms and rotary; k_pool/v_pool [L, S, Hkv, hd] and `layer`; cos/sin f32 [T, hd/2] of each
    token's position; positions, slot_mapping (>= S: writes nothing, and the token is padding), first_in_step
    (index in T of the token's row's first token this step), row_of_token [T]; block_tables [R, MB]; bias
    [Lw, Hkv*(G+2)*hd] and q_norm/k_norm [Lw, hd] stacked over layers, this layer's at `weight_layer`;
    num_splits: programs sharing a token's context (None: `fused_splits(T, MB)`); window: a sliding window, an i32 scalar
    (each token sees the keys at its position and the window - 1 before; the pages before it are not read); sinks:
    f32 [Hq] attention-sink logits, or None.
    -> (out [T, Hq*hd], k_pool, v_pool with this step's k/v written)."""
    interpret = interpreted(interpret)
    T = qkv.shape[0]
    L, S, Hkv, hd = k_pool.shape
    G = num_heads // Hkv
    W = G + 2
    q_rows = max(_MIN_ROWS, next_pow2(G))
    qkv = qkv.reshape(T, Hkv * W, hd)
    NS = fused_splits(T, block_tables.shape[1]) if num_splits is None else num_splits
    # this step's keys per iteration: a split (decode-sized) step's rows have a few each (one per decode token)
    chunk = _MIN_ROWS if NS > 1 else max(_MIN_ROWS, min(64, next_pow2(T)))
    # On a GPU masked lanes touch no memory; the interpreter slices instead (clamping slices that run past the
    # end), so there qkv, cos and sin get spare tokens and head rows.
    spare_t, spare_r = (chunk, q_rows) if interpret else (0, 0)
    pad = lambda x, *widths: jnp.pad(x, [(0, w) for w in widths]) if interpret else x   # noqa: E731
    pages = (L, S // block_size, block_size, Hkv, hd)
    R, MB = block_tables.shape
    P = min(PAGES_PER_ITER if NS == 1 else _split_pages(NS, block_size), next_pow2(MB))
    MBp = -(-MB // P) * P
    if MBp != MB:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, MBp - MB)), constant_values=-1)
    extra = []
    if bias is not None:
        extra.append(pad(bias.reshape(-1, Hkv * W, hd), 0, spare_r, 0))
    if q_norm is not None:
        extra += [q_norm, k_norm]
    kernel = functools.partial(
        _fused_kernel, block_size=block_size, max_blocks=MB, num_kv_slots=S, scale=hd ** -0.5, group=G,
        q_rows=q_rows, chunk=chunk, pages_per_iter=P, num_splits=NS, has_bias=bias is not None,
        has_norm=q_norm is not None, eps=eps, has_window=window is not None, has_sinks=sinks is not None)
    whole = lambda shape: pl.BlockSpec(shape, lambda t, h, s: (0,) * len(shape))  # noqa: E731
    ints = [jnp.reshape(layer, (1,)), jnp.reshape(weight_layer, (1,)), _window_input(window), positions,
            slot_mapping, first_in_step, row_of_token, block_tables]
    ins = [x.astype(jnp.int32) for x in ints] + [_sinks_input(sinks, num_heads, spare_r),
                                                 pad(qkv, spare_t, spare_r, 0), pad(cos, spare_t, 0),
                                                 pad(sin, spare_t, 0), *extra, k_pool.reshape(pages),
                                                 v_pool.reshape(pages)]
    H = num_heads + spare_r
    if NS == 1:
        out_shape = [jax.ShapeDtypeStruct((T, H, hd), qkv.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((T, NS, H, hd), jnp.float32), jax.ShapeDtypeStruct((T, NS, H), jnp.float32),
                     jax.ShapeDtypeStruct((T, NS, H), jnp.float32)]
    out_shape += [jax.ShapeDtypeStruct(pages, k_pool.dtype), jax.ShapeDtypeStruct(pages, v_pool.dtype)]
    params = {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2))
    *outs, k_new, v_new = pl.pallas_call(
        kernel,
        grid=(T, Hkv, NS),
        in_specs=[whole(x.shape) for x in ins],
        out_specs=[whole(o.shape) for o in out_shape],
        out_shape=out_shape,
        input_output_aliases={len(ins) - 2: len(out_shape) - 2, len(ins) - 1: len(out_shape) - 1},
        interpret=interpret,
        name="paged_attention_fused",
        **params,
    )(*ins)
    out = outs[0][:, :num_heads] if NS == 1 else _merge_splits(*outs, num_heads, qkv.dtype, interpret)
    return out.reshape(T, num_heads * hd), k_new.reshape(k_pool.shape), v_new.reshape(v_pool.shape)
