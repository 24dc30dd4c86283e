"""The gated delta rule over a ragged step, recurrently: one program per (row, value head) walks the row's tokens
in order with the head's state S [dk, dv] (fp32) in registers, for decode and verify rows (1 or 1+k tokens) and
for prefill chunks alike.

    S <- ring entry (p0 - 1) of the row's slot (zeros at p0 = 0)         p0: the row's first position
    for each token t of the row:
        S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
        if t is among the row's last W positions: ring entry (p_t % W) of the slot <- S

The ring is the layer kind's per-slot state (jaxspec.nn.layers: [n, slots, W, Hv, dk, dv], W = k+1 entries
kept by position), updated in place (input/output aliasing); the layer index is an input, so the whole stacked
ring is passed as is. A row's tokens that keep state (`writes_state`) must be a prefix of its tokens (true of
every batch the engine builds); the kernel walks that prefix and leaves the other tokens' outputs zero.
`jaxspec.nn.layers.delta_rule_scan` is the plain-JAX reference.

Shapes: T tokens, R rows, Hv value heads of key width dk and value width dv (powers of two: Triton tiles).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _kernel(layer_ref, first_ref, count_ref, slot_ref, start_ref, q_ref, k_ref, v_ref, beta_ref, g_ref,
            o_in_ref, ring_in_ref, o_ref, ring_ref, *, window: int):
    del o_in_ref, ring_in_ref   # aliased to o_ref and ring_ref
    r, h = pl.program_id(0), pl.program_id(1)
    layer, first, count, slot, p0 = layer_ref[0], first_ref[r], count_ref[r], slot_ref[r], start_ref[r]
    before = ring_ref[layer, slot, jax.lax.rem(p0 - 1 + window, window), h, :, :]       # [dk, dv]
    S = jnp.where(p0 > 0, before, jnp.zeros_like(before))
    writes_from = count - window       # the row's last W tokens keep their state

    def token(j, S):
        t = first + j
        q, k, v = q_ref[t, h, :], k_ref[t, h, :], v_ref[t, h, :]                         # [dk], [dk], [dv]
        S = S * jnp.exp(g_ref[t, h])
        delta = (v - jnp.sum(k[:, None] * S, axis=0)) * beta_ref[t, h]                   # [dv]
        S = S + k[:, None] * delta[None, :]
        o_ref[t, h, :] = jnp.sum(q[:, None] * S, axis=0)

        @pl.when(j >= writes_from)
        def _():
            ring_ref[layer, slot, jax.lax.rem(p0 + j, window), h, :, :] = S
        return S

    jax.lax.fori_loop(0, count, token, S)


@functools.partial(jax.jit, static_argnames=("interpret",))
def delta_rule_recurrent(q, k, v, beta, g, ring, layer, first, count, slot, start, *, interpret: bool | None = None):
    """q, k [T, Hv, dk], v [T, Hv, dv], beta and the log decay g [T, Hv] (all f32); ring [n, slots, W, Hv, dk, dv]
    f32; layer: i32 scalar; per row r: first [R] its first token's index, count [R] its tokens that keep state
    (a prefix), slot [R], start [R] its first token's position. -> (o [T, Hv, dv] f32, ring)."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    T, Hv, dv = v.shape
    R = first.shape[0]
    i32 = lambda x: jnp.asarray(x, jnp.int32)   # noqa: E731
    whole = lambda shape: pl.BlockSpec(shape, lambda r, h: (0,) * len(shape))  # noqa: E731
    arrays = (jnp.reshape(i32(layer), (1,)), i32(first), i32(count), i32(slot), i32(start), q, k, v, beta, g,
              jnp.zeros((T, Hv, dv), jnp.float32), ring)
    return pl.pallas_call(
        functools.partial(_kernel, window=ring.shape[2]),
        grid=(R, Hv),
        in_specs=[whole(a.shape) for a in arrays],
        out_specs=[whole((T, Hv, dv)), whole(ring.shape)],
        out_shape=[jax.ShapeDtypeStruct((T, Hv, dv), jnp.float32), jax.ShapeDtypeStruct(ring.shape, ring.dtype)],
        input_output_aliases={10: 0, 11: 1},
        interpret=interpret,
        name="delta_rule_recurrent",
    )(*arrays)


def delta_rule_fn(ring, i, batch, q, k, v, beta, g):
    """`jaxspec.nn.layers.delta_rule_scan`'s contract over the kernel: per row, its first token, its tokens that
    keep state, its slot and first position from the ForwardBatch. -> (o [T, Hv, dv], ring)."""
    T, R = q.shape[0], batch.block_tables.shape[0]
    written = jnp.ones((T,), bool) if batch.writes_state is None else batch.writes_state
    count = jax.ops.segment_sum(written.astype(jnp.int32), batch.row_of_token, num_segments=R)
    first = batch.first_token_of_row
    start = batch.positions[jnp.clip(first, 0, T - 1)]
    return delta_rule_recurrent(q, k, v, beta, g, ring, i, first, count, batch.slot_of_row, start)
