"""Paged-KV slot mapping kernel.

For every scheduled token t (row r = row_of_token[t], position p = positions[t]):
    slot[t] = block_tables[r, p // block_size] * block_size + p % block_size
Padding tokens (valid = False), negative positions, positions beyond the row's table, rows outside
[0, R) and unallocated table entries (< 0) get `num_slots`, an out-of-range sentinel that the KV
write drops (`.at[slot].set(..., mode="drop")`). The kernel never reads outside block_tables:
the gather index is clamped to 0 for every token that gets the sentinel.

One program per block of `block_tokens` tokens (a power of two); the token axis is padded in the
wrapper, and block_tables is passed whole (only gathered from, so its shape is free).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.pallas.common import interpreted, next_pow2


def _slots(pos, row, valid, gather, *, num_rows, max_blocks, block_size, num_slots):
    blk = pos // block_size
    ok = valid & (pos >= 0) & (blk < max_blocks) & (row >= 0) & (row < num_rows)
    entry = gather(jnp.where(ok, row, 0), jnp.where(ok, blk, 0))
    ok = ok & (entry >= 0)
    return jnp.where(ok, entry * block_size + pos % block_size, num_slots).astype(jnp.int32)


def slot_mapping_reference(positions, row_of_token, valid, block_tables, block_size: int, num_slots: int):
    """Pure-jnp reference of `slot_mapping` (also the fallback when kernels are disabled)."""
    block_tables = jnp.asarray(block_tables, jnp.int32)
    num_rows, max_blocks = block_tables.shape
    return _slots(
        jnp.asarray(positions, jnp.int32), jnp.asarray(row_of_token, jnp.int32), jnp.asarray(valid, bool),
        lambda r, b: block_tables[r, b],
        num_rows=num_rows, max_blocks=max_blocks, block_size=block_size, num_slots=num_slots)


def _slot_kernel(pos_ref, row_ref, valid_ref, bt_ref, out_ref, *, num_rows, max_blocks, block_size, num_slots):
    out_ref[...] = _slots(
        pos_ref[...], row_ref[...], valid_ref[...] != 0,
        lambda r, b: bt_ref[r, b],
        num_rows=num_rows, max_blocks=max_blocks, block_size=block_size, num_slots=num_slots)


@functools.partial(jax.jit, static_argnames=("block_size", "num_slots", "interpret", "block_tokens"))
def _slot_mapping_call(positions, row_of_token, valid, block_tables, *, block_size, num_slots, interpret,
                       block_tokens):
    (t,) = positions.shape
    num_rows, max_blocks = block_tables.shape
    bt = block_tokens
    t_pad = -(-t // bt) * bt

    def pad(x, dtype):
        return jnp.pad(jnp.asarray(x).astype(dtype), (0, t_pad - t))

    kernel = functools.partial(_slot_kernel, num_rows=num_rows, max_blocks=max_blocks, block_size=block_size,
                               num_slots=num_slots)
    tok_spec = pl.BlockSpec((bt,), lambda i: (i,))
    out = pl.pallas_call(
        kernel,
        grid=(t_pad // bt,),
        in_specs=[tok_spec, tok_spec, tok_spec, pl.BlockSpec((num_rows, max_blocks), lambda i: (0, 0))],
        out_specs=tok_spec,
        out_shape=jax.ShapeDtypeStruct((t_pad,), jnp.int32),
        interpret=interpret,
    )(pad(positions, jnp.int32), pad(row_of_token, jnp.int32), pad(valid, jnp.int32),
      jnp.asarray(block_tables, jnp.int32))
    return out[:t]


def slot_mapping(positions, row_of_token, valid, block_tables, block_size: int, num_slots: int,
                 *, interpret: bool | None = None, block_tokens: int | None = None):
    """Pallas slot mapping -> i32[T] (see module docstring).

    interpret=None runs the kernel in interpret mode unless the default backend is a GPU.
    """
    (t,) = positions.shape
    if t == 0:
        return jnp.zeros((0,), jnp.int32)
    if block_tokens is None:
        block_tokens = min(256, max(16, next_pow2(t)))
    if block_tokens & (block_tokens - 1):
        raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")
    return _slot_mapping_call(positions, row_of_token, valid, block_tables, block_size=int(block_size),
                              num_slots=int(num_slots), interpret=interpreted(interpret),
                              block_tokens=block_tokens)
