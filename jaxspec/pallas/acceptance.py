"""Token-acceptance kernel: the per-row walk over K drafts of rejection sampling.

The vocabulary-wide work (gathering p(d), q(d), target argmax, recovered/bonus samples) is done in
plain XLA by `jaxspec.decode.rejection.rejection_sample`; this kernel only sees small per-row
arrays. One program handles a block of `block_rows` rows; every array is padded in the wrapper to
power-of-two block shapes, so the kernel needs no tail masks and lowers with Pallas' Triton backend.

Inputs (R rows, K draft positions):
  draft_ids i32[R, K], valid bool[R, K] (draft in range and j < num_drafts), p_d f32[R, K],
  q_d f32[R, K], uniforms f32[R, K], is_greedy bool[R], target_argmax i32[R, K+1],
  recovered i32[R, K+1], num_drafts i32[R].
Row r accepts drafts 0..n-1 where n is the first position whose draft fails (greedy: draft !=
target argmax; random: not u * q(d) < p(d); always: invalid or j >= num_drafts), then emits at
position n the target argmax (greedy) or recovered[r, n] (random). The rest is -1.
Outputs: output_tokens i32[R, K+1], num_accepted i32[R].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.pallas.common import interpreted, next_pow2


def acceptance_reference(draft_ids, valid, p_d, q_d, uniforms, is_greedy, target_argmax, recovered, num_drafts):
    """Pure-jnp reference of `acceptance` (also the fallback when kernels are disabled)."""
    draft_ids = jnp.asarray(draft_ids, jnp.int32)
    r, k = draft_ids.shape
    greedy = jnp.asarray(is_greedy, bool)[:, None]
    target_argmax = jnp.asarray(target_argmax, jnp.int32)
    recovered = jnp.asarray(recovered, jnp.int32)
    num_drafts = jnp.asarray(num_drafts, jnp.int32)
    ok = jnp.asarray(valid, bool) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    acc_greedy = draft_ids == target_argmax[:, :k]
    acc_random = jnp.asarray(uniforms) * jnp.asarray(q_d) < jnp.asarray(p_d)
    acc = ok & jnp.where(greedy, acc_greedy, acc_random)
    n_acc = jnp.sum(jnp.cumprod(acc.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    emit_src = jnp.where(greedy, target_argmax, recovered)
    emit = jnp.take_along_axis(emit_src, n_acc[:, None], axis=1)  # [R, 1]
    col = jnp.arange(k + 1)[None, :]
    drafts_ext = jnp.concatenate([draft_ids, jnp.full((r, 1), -1, jnp.int32)], axis=1)
    out = jnp.where(col < n_acc[:, None], drafts_ext, jnp.where(col == n_acc[:, None], emit, -1))
    return out.astype(jnp.int32), n_acc


def _acceptance_kernel(d_ref, valid_ref, pd_ref, qd_ref, u_ref, greedy_ref, am_ref, rec_ref, nd_ref,
                       out_ref, nacc_ref):
    d = d_ref[...]  # [BR, W]; columns >= K are padding (valid = 0)
    valid = valid_ref[...] != 0
    p_d = pd_ref[...]
    q_d = qd_ref[...]
    u = u_ref[...]
    greedy = (greedy_ref[...] != 0)[:, None]  # [BR, 1]
    am = am_ref[...]
    rec = rec_ref[...]
    nd = nd_ref[...][:, None]  # [BR, 1]
    width = d.shape[1]
    col = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, W]

    acc = valid & (col < nd) & jnp.where(greedy, d == am, u * q_d < p_d)
    # number of leading accepts = index of the first non-accepted column (padding is never accepted)
    n_acc = jnp.min(jnp.where(acc, width, col), axis=1)  # [BR]
    n_acc_c = n_acc[:, None]
    emit_src = jnp.where(greedy, am, rec)
    emit = jnp.sum(jnp.where(col == n_acc_c, emit_src, 0), axis=1)[:, None]  # masked pick, no gather
    out = jnp.where(col < n_acc_c, d, jnp.where(col == n_acc_c, emit, -1))
    out_ref[...] = out
    nacc_ref[...] = n_acc


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows"))
def _acceptance_call(draft_ids, valid, p_d, q_d, uniforms, is_greedy, target_argmax, recovered, num_drafts,
                     *, interpret: bool, block_rows: int):
    r, k = draft_ids.shape
    width = next_pow2(k + 1)
    br = block_rows
    r_pad = -(-r // br) * br

    def pad2(x, value, dtype):
        x = jnp.asarray(x).astype(dtype)
        return jnp.pad(x, ((0, r_pad - x.shape[0]), (0, width - x.shape[1])), constant_values=value)

    def pad1(x, value, dtype):
        x = jnp.asarray(x).astype(dtype)
        return jnp.pad(x, (0, r_pad - x.shape[0]), constant_values=value)

    args = (
        pad2(draft_ids, -1, jnp.int32),
        pad2(valid, 0, jnp.int32),
        pad2(p_d, 0.0, jnp.float32),
        pad2(q_d, 1.0, jnp.float32),
        pad2(uniforms, 1.0, jnp.float32),
        pad1(is_greedy, 0, jnp.int32),
        pad2(target_argmax, 0, jnp.int32),
        pad2(recovered, 0, jnp.int32),
        pad1(num_drafts, 0, jnp.int32),
    )
    spec2 = pl.BlockSpec((br, width), lambda i: (i, 0))
    spec1 = pl.BlockSpec((br,), lambda i: (i,))
    in_specs = [spec2, spec2, spec2, spec2, spec2, spec1, spec2, spec2, spec1]
    out, n_acc = pl.pallas_call(
        _acceptance_kernel,
        grid=(r_pad // br,),
        in_specs=in_specs,
        out_specs=[spec2, spec1],
        out_shape=[
            jax.ShapeDtypeStruct((r_pad, width), jnp.int32),
            jax.ShapeDtypeStruct((r_pad,), jnp.int32),
        ],
        interpret=interpret,
    )(*args)
    return out[:r, : k + 1], n_acc[:r]


def acceptance(draft_ids, valid, p_d, q_d, uniforms, is_greedy, target_argmax, recovered, num_drafts,
               *, interpret: bool | None = None, block_rows: int | None = None):
    """Pallas token-acceptance kernel -> (output_tokens i32[R, K+1] padded with -1, num_accepted i32[R]).

    interpret=None runs the kernel in interpret mode unless the default backend is a GPU.
    """
    r = draft_ids.shape[0]
    if block_rows is None:
        block_rows = min(128, max(16, next_pow2(r)))
    if block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    return _acceptance_call(draft_ids, valid, p_d, q_d, uniforms, is_greedy, target_argmax, recovered,
                            num_drafts, interpret=interpreted(interpret), block_rows=block_rows)
