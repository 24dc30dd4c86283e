"""What the Pallas kernels share: block sizes rounded to powers of two, whether a kernel is interpreted, the online
softmax's update, a row's group of KV pages and a value as a KV pool stores it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def interpreted(interpret: bool | None) -> bool:
    """A kernel's `interpret` argument: None is the default, interpreted everywhere but on a GPU (the tests' CPU)."""
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def softmax_update(m, l, s):
    """One step of the online softmax over a tile of scores s [rows, n] (masked keys at -1e30), from the running max m
    and sum l [rows] -> (new max, the factor the running output is scaled by, the tile's weights p [rows, n], new
    sum). The caller adds p @ v to its output scaled by the factor."""
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    return m_new, correction, p, l * correction + jnp.sum(p, axis=1)


def page_group(tables_ref, k_ref, v_ref, layer, row, kv_head, j, pages_per_iter: int, num_pages, dtype):
    """Iteration j's keys and values of a row: its pages j*P .. j*P+P-1 (P = pages_per_iter; past the row's
    `num_pages`, page 0 stands in, for the caller to mask) of one kv head from pools viewed as [L, blocks,
    block_size, Hkv, hd] -> k, v [P*block_size, hd] in `dtype` (a one-byte pool read back)."""
    table_idx = j * pages_per_iter + jax.lax.broadcasted_iota(jnp.int32, (pages_per_iter,), 0)
    blocks = jnp.maximum(tables_ref[row, pl.ds(j * pages_per_iter, pages_per_iter)], 0)
    blocks = jnp.where(table_idx < num_pages, blocks, 0)
    keys, hd = pages_per_iter * k_ref.shape[2], k_ref.shape[-1]
    return tuple(ref[layer, blocks, :, kv_head, :].reshape(keys, hd).astype(dtype) for ref in (k_ref, v_ref))


def to_kv_dtype(x, dtype):
    """x as a KV pool of `dtype` stores it: a one-byte float pool (an fp8 KV cache, per-tensor scale 1) saturates at
    its largest finite value, where a plain cast past it gives NaN."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        largest = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -largest, largest)
    return x.astype(dtype)
