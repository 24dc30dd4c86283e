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

_MIN_ROWS = 16  # the matrix unit's smallest tile
PAGES_PER_ITER = 4  # pages each loop iteration loads at once (4 x 16 keys)
# Context splits the engine's attention uses. Measured on an H100 (docs/benchmarks.md), per layer: 1 vs 8
# splits 2.6 vs 4.0 us at 200-token contexts, 3.5 vs 2.4 us at 1000, 6.6 vs 2.8 us at 2500. The decode
# contexts benchmarked here are 150-300 tokens, so one split.
NUM_SPLITS = 1


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _kernel(layer_ref, pos_ref, row_ref, tables_ref, q_ref, k_ref, v_ref, *out_refs, block_size: int,
            max_blocks: int, scale: float, group: int, q_block_shape: tuple[int, int], pages_per_iter: int,
            num_splits: int):
    t, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, pos, row = layer_ref[0], pos_ref[t], row_ref[t]
    rows_q, hd = q_block_shape
    # This kv head's G query heads, read straight from q [T, Hq, hd]: rows past G are masked, so q needs
    # no padded copy and the output no slice.
    in_group = jax.lax.broadcasted_iota(jnp.int32, (rows_q, hd), 0) < group
    q = plgpu.load(q_ref.at[t, pl.ds(h * group, rows_q), :], mask=in_group, other=0.0)
    num_pages = jnp.minimum(pos // block_size + 1, max_blocks)
    keys = pages_per_iter * block_size
    # This split's share of the iterations over the row's pages (a padding token, position -1, has none).
    num_iters = pl.cdiv(num_pages, pages_per_iter)
    per_split = pl.cdiv(num_iters, num_splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, num_iters)

    def pages(j, carry):  # `pages_per_iter` pages (their loads in flight together) per iteration
        o, m, l = carry
        table_idx = j * pages_per_iter + jax.lax.broadcasted_iota(jnp.int32, (pages_per_iter,), 0)
        blocks = jnp.maximum(tables_ref[row, pl.ds(j * pages_per_iter, pages_per_iter)], 0)
        blocks = jnp.where(table_idx < num_pages, blocks, 0)
        k = k_ref[layer, blocks, :, h, :].reshape(keys, hd)              # [P*bs, hd]
        v = v_ref[layer, blocks, :, h, :].reshape(keys, hd)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale     # [G16, P*bs]
        key_pos = j * keys + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(key_pos <= pos, s, -1e30)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * correction + jnp.sum(p, axis=1)
        o = o * correction[:, None] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return o, m_new, l

    init = (jnp.zeros((rows_q, hd), jnp.float32), jnp.full((rows_q,), -1e30, jnp.float32),
            jnp.zeros((rows_q,), jnp.float32))
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


def _merge_splits(o, m, l):
    """o [T, S, H, hd] (each split normalized by its own sum), m, l [T, S, H] -> [T, H, hd]."""
    weight = l * jnp.exp(m - jnp.max(m, axis=1, keepdims=True))          # [T, S, H]; empty splits weigh 0
    total = jnp.maximum(jnp.sum(weight, axis=1), 1e-30)
    return jnp.einsum("tsh,tshd->thd", weight, o) / total[..., None]


@functools.partial(jax.jit, static_argnames=("block_size", "num_splits", "interpret"))
def paged_attention(q, k_pool, v_pool, layer, positions, row_of_token, block_tables, *, block_size: int,
                    num_splits: int = 1, interpret: bool | None = None):
    """q [T, Hq, hd]; k_pool/v_pool [L, S, Hkv, hd]; layer: i32 scalar; positions, row_of_token [T];
    block_tables [R, MB] (-1: no block). Each token attends to its row's keys at positions <= its own.
    num_splits: programs sharing one token's context. -> [T, Hq*hd]."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    T, Hq, hd = q.shape
    L, S, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    G16 = max(_MIN_ROWS, _next_pow2(G))
    # On a GPU masked lanes touch no memory; the interpreter slices instead (and clamps slices that run
    # past the end), so there the head axis gets G16 spare rows.
    spare = G16 if interpret else 0
    q_rows = Hq + spare
    pages = (L, S // block_size, block_size, Hkv, hd)
    R, MB = block_tables.shape
    # Tables padded to whole iterations (-1: no block), so a page group never reads past a row's end.
    P = min(PAGES_PER_ITER, _next_pow2(MB))
    MBp = -(-MB // P) * P
    if MBp != MB:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, MBp - MB)), constant_values=-1)
    NS = num_splits
    kernel = functools.partial(_kernel, block_size=block_size, max_blocks=MB, scale=hd ** -0.5, group=G,
                               q_block_shape=(G16, hd), pages_per_iter=P, num_splits=NS)
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
        in_specs=[whole((1,)), whole((T,)), whole((T,)), whole((R, MBp)),
                  whole((T, q_rows, hd)), whole(pages), whole(pages)],
        out_specs=[whole(o.shape) for o in out_shape],
        out_shape=out_shape,
        interpret=interpret,
        name="paged_attention",
        **params,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), positions.astype(jnp.int32), row_of_token.astype(jnp.int32),
      block_tables.astype(jnp.int32), jnp.pad(q, ((0, 0), (0, spare), (0, 0))) if spare else q,
      k_pool.reshape(pages), v_pool.reshape(pages))
    out = outs[0] if NS == 1 else _merge_splits(*outs).astype(q.dtype)
    return out[:, :Hq].reshape(T, Hq * hd)


def paged_attention_fn(q, k_pool, v_pool, layer, batch, block_size: int):
    """`Ops.attend` over the kernel. Padding tokens (their KV write dropped: slot past the pool) get position
    -1, so their programs visit no page."""
    positions = jnp.where(batch.slot_mapping < k_pool.shape[1], batch.positions, -1)
    return paged_attention(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), positions, batch.row_of_token,
                           batch.block_tables, block_size=block_size, num_splits=NUM_SPLITS)
