"""Paged attention that reads the KV pages in place: one program per (token, kv head) walks its row's
block table, a page at a time, with an online softmax. Nothing is gathered into a dense context.

Layout: the KV pool of the forward, k/v [L, num_blocks*block_size, Hkv, hd], viewed (for free) as
[L, num_blocks, block_size, Hkv, hd]; the kernel takes the layer index as an input so the whole pool
is passed as is (no per-layer slice copy). Query heads of one kv head (GQA group G) are one tile,
padded to 16 rows for the matrix unit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # GPU compiler parameters (absent from some CPU-only installs)
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

_MIN_ROWS = 16  # the matrix unit's smallest tile


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _kernel(layer_ref, pos_ref, row_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, *, block_size: int,
            max_blocks: int, scale: float):
    t, h = pl.program_id(0), pl.program_id(1)
    layer, pos, row = layer_ref[0], pos_ref[t], row_ref[t]
    q = q_ref[...]                                                     # [G16, hd]
    rows_q, hd = q.shape
    num_pages = jnp.minimum(pos // block_size + 1, max_blocks)

    def page(j, carry):
        o, m, l = carry
        block = jnp.maximum(tables_ref[row, j], 0)
        k = k_ref[layer, block, :, h, :]                               # [bs, hd]
        v = v_ref[layer, block, :, h, :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale     # [G16, bs]
        key_pos = j * block_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
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
    o, m, l = jax.lax.fori_loop(0, num_pages, page, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "interpret"))
def paged_attention(q, k_pool, v_pool, layer, positions, row_of_token, block_tables, *, block_size: int,
                    interpret: bool | None = None):
    """q [T, Hq, hd]; k_pool/v_pool [L, S, Hkv, hd]; layer: i32 scalar; positions, row_of_token [T];
    block_tables [R, MB] (-1: no block). Each token attends to its row's keys at positions <= its own.
    -> [T, Hq*hd]."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    T, Hq, hd = q.shape
    L, S, Hkv, _ = k_pool.shape
    G = Hq // Hkv
    G16 = max(_MIN_ROWS, _next_pow2(G))
    qg = jnp.pad(q.reshape(T, Hkv, G, hd), ((0, 0), (0, 0), (0, G16 - G), (0, 0)))
    pages = (L, S // block_size, block_size, Hkv, hd)
    R, MB = block_tables.shape
    kernel = functools.partial(_kernel, block_size=block_size, max_blocks=MB, scale=hd ** -0.5)
    whole = lambda shape: pl.BlockSpec(shape, lambda t, h: (0,) * len(shape))  # noqa: E731
    params = dict(compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2)) if (
        plgpu is not None and not interpret) else {}
    out = pl.pallas_call(
        kernel,
        grid=(T, Hkv),
        in_specs=[whole((1,)), whole((T,)), whole((T,)), whole((R, MB)),
                  pl.BlockSpec((None, None, G16, hd), lambda t, h: (t, h, 0, 0)),
                  whole(pages), whole(pages)],
        out_specs=pl.BlockSpec((None, None, G16, hd), lambda t, h: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((T, Hkv, G16, hd), q.dtype),
        interpret=interpret,
        name="paged_attention",
        **params,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), positions.astype(jnp.int32), row_of_token.astype(jnp.int32),
      block_tables.astype(jnp.int32), qg, k_pool.reshape(pages), v_pool.reshape(pages))
    return out[:, :, :G].reshape(T, Hq * hd)


def paged_attention_fn(q, k_pool, v_pool, layer, batch, block_size: int):
    """`forward`'s attention_fn signature over the kernel."""
    return paged_attention(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), batch.positions, batch.row_of_token,
                           batch.block_tables, block_size=block_size)
