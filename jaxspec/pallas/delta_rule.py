"""The gated delta rule over a ragged step, recurrently: one program per (row, value head) walks the row's tokens
in order with the head's state S [dk, dv] (fp32) in registers, for decode and verify rows (1 or 1+k tokens) and
for the last W tokens of longer rows (prefill chunks: their earlier tokens go to the chunked kernel below).

    S <- ring entry (p0 - 1) of the row's slot (zeros at p0 = 0)         p0: the row's first position
    for each token t of the row:
        S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
        if t is among the row's last W positions: ring entry (p_t % W) of the slot <- S

The ring is the layer kind's per-slot state (jaxspec.nn.layers: [n, slots, W, Hv, dk, dv], W = k+1 entries
kept by position), updated in place (input/output aliasing); the layer index is an input, so the whole stacked
ring is passed as is. A row's tokens that keep state (`writes_state`) must be a prefix of its tokens (true of
every batch the engine builds); the kernel walks that prefix and leaves the other tokens' outputs zero.
`jaxspec.nn.layers.delta_rule_scan` is the plain-JAX reference.

A row's tokens before its last W (prefill chunks) go first to `delta_rule_chunked`, the chunkwise-parallel (WY)
form in chunks of CHUNK tokens: `_prep_kernel`, parallel over every chunk and head, does the matmuls that do
not depend on the state a chunk starts from ((I + A)^-1 among them), and `_state_kernel` carries the state
through each row's chunks in order, three matmuls a chunk. The recurrent kernel then walks the row's last W (or
fewer) tokens from the state the chunks left, and writes their ring entries. `jaxspec.nn.kernels.delta_rule_fn`
(the layer's entry point) says why it is split so. `jaxspec.nn.layers.delta_rule_chunked` is the chunked form's
plain-JAX reference.

Shapes: T tokens, R rows, Hv value heads of key width dk and value width dv (powers of two: Triton tiles).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas.common import interpreted


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
def delta_rule_recurrent(q, k, v, beta, g, ring, layer, first, count, slot, start, o=None, *,
                         interpret: bool | None = None):
    """q, k [T, Hv, dk], v [T, Hv, dv], beta and the log decay g [T, Hv] (all f32); ring [n, slots, W, Hv, dk, dv]
    f32; layer: i32 scalar; per row r: first [R] its first token's index, count [R] its tokens that keep state
    (a prefix), slot [R], start [R] its first token's position; o [T, Hv, dv]: outputs of other tokens, kept
    (None: zeros). -> (o [T, Hv, dv] f32, ring)."""
    interpret = interpreted(interpret)
    T, Hv, dv = v.shape
    R = first.shape[0]
    i32 = lambda x: jnp.asarray(x, jnp.int32)   # noqa: E731
    whole = lambda shape: pl.BlockSpec(shape, lambda r, h: (0,) * len(shape))  # noqa: E731
    arrays = (jnp.reshape(i32(layer), (1,)), i32(first), i32(count), i32(slot), i32(start), q, k, v, beta, g,
              jnp.zeros((T, Hv, dv), jnp.float32) if o is None else o, ring)
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


# ---- prefill: the chunkwise-parallel (WY) form ---------------------------------------------------------------

# Measured on the H100 at Qwen3-Next's shapes (docs/lab/2026-11-24-delta-rule-chunked.md), chunk {32, 64} x block_v {32, 64} x warps
# {4, 8}: 64 and 32 (4 warps) were the fastest at 512 and 2048 tokens.
CHUNK = 64      # tokens per chunk (a power of two; >= 16 on the GPU: the matrix unit's smallest tile)
BLOCK_V = 32    # value columns per state-pass program: S's columns evolve independently, so dv is split


def _dot(a, b, contract=(1, 0), precision=None):
    """a @ b contracting a's axis contract[0] with b's axis contract[1], accumulated in f32."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def unit_lower_inverse(A, dot=_dot):
    """(I + A)^-1 for a strictly lower-triangular A [C, C] (C a power of two), by doubling diagonal blocks: if Y
    inverts the diagonal blocks of size b of X = I + A, then Y - Y X' Y inverts its diagonal blocks of size 2b,
    X' being what those hold outside the b-blocks (their lower-left quarter). log2(C) steps of two matmuls (a
    loop: one copy of them in the compiled kernel), and no power series (whose terms grow like binomial
    coefficients when a chunk's keys repeat)."""
    C = A.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    apart = rows ^ cols          # rows i and j lie in one aligned block of size b iff (i ^ j) < b

    def double(level, Y):
        b = jax.lax.shift_left(jnp.int32(1), level)
        return Y - dot(dot(Y, jnp.where((apart >= b) & (apart < 2 * b), A, 0.0)), Y)

    return jax.lax.fori_loop(0, C.bit_length() - 1, double, (rows == cols).astype(jnp.float32))


def _prep_kernel(cfirst_ref, clen_ref, q_ref, k_ref, v_ref, beta_ref, g_ref, o_in_ref,
                 w_ref, qs_ref, kd_ref, u_ref, o_ref, *, chunk: int, precision):
    """One program per (chunk, value head): everything of the chunk that does not depend on the state it starts
    from, stored by token. With S0 that state (the algebra: `jaxspec.nn.layers.delta_rule_chunked`),
        u = u0 - w S0,   o = o0 + qs S0,   S_end = exp(G_C) S0 + kd^T u
    where, Y = (I + A)^-1 and P[t, s] = D[t, s] q_t . k_s (s <= t):
        w = Y diag(beta exp(G)) K,  u0 = Y diag(beta) V,  qs = diag(exp(G)) Q - P w,  o0 = P u0,
        kd = diag(exp(G_C - G)) K."""
    del o_in_ref    # aliased to o_ref
    j, h = pl.program_id(0), pl.program_id(1)
    n, C = clen_ref[j], chunk
    dk, dv = q_ref.shape[2], v_ref.shape[2]
    dot = functools.partial(_dot, precision=precision)

    @pl.when(n > 0)
    def _():
        tokens = pl.ds(cfirst_ref[j], C)
        t = jax.lax.broadcasted_iota(jnp.int32, (C,), 0)
        causal = t[:, None] >= t[None, :]
        real = t < n                    # the last chunk's tokens past the row load as zeros: no effect on S
        rk, rv = jnp.broadcast_to(real[:, None], (C, dk)), jnp.broadcast_to(real[:, None], (C, dv))
        q = plgpu.load(q_ref.at[tokens, h, :], mask=rk, other=0.0)
        k = plgpu.load(k_ref.at[tokens, h, :], mask=rk, other=0.0)
        v = plgpu.load(v_ref.at[tokens, h, :], mask=rv, other=0.0)
        beta = plgpu.load(beta_ref.at[tokens, h], mask=real, other=0.0)
        g = plgpu.load(g_ref.at[tokens, h], mask=real, other=0.0)
        G = jnp.cumsum(g)                                                    # [C] log decay from the chunk's start
        G_end = jnp.sum(jnp.where(t == C - 1, G, 0.0))
        D = jnp.exp(jnp.where(causal, G[:, None] - G[None, :], -jnp.inf))   # [C, C] decay from s to t (s <= t)
        A = jnp.where(t[:, None] > t[None, :], beta[:, None] * D * dot(k, k, (1, 1)), 0.0)
        Y = unit_lower_inverse(A, dot)                                       # (I + A)^-1
        w = dot(Y, k * (beta * jnp.exp(G))[:, None])                         # [C, dk]
        u0 = dot(Y, v * beta[:, None])                                       # [C, dv]
        P = jnp.where(causal, D * dot(q, k, (1, 1)), 0.0)
        plgpu.store(w_ref.at[tokens, h, :], w, mask=rk)
        plgpu.store(u_ref.at[tokens, h, :], u0, mask=rv)
        plgpu.store(qs_ref.at[tokens, h, :], q * jnp.exp(G)[:, None] - dot(P, w), mask=rk)
        plgpu.store(o_ref.at[tokens, h, :], dot(P, u0), mask=rv)
        plgpu.store(kd_ref.at[tokens, h, :], k * jnp.exp(G_end - G)[:, None], mask=rk)


def _state_kernel(layer_ref, first_ref, count_ref, slot_ref, start_ref, w_ref, qs_ref, kd_ref, u_ref, g_ref,
                  o_in_ref, ring_in_ref, o_ref, ring_ref, *, window: int, chunk: int, block_v: int, precision):
    """One program per (row, value head, block of value columns): the state through the row's chunks in order,
    from the ring entry before its first position, completing each chunk's outputs; the state after the row's
    last token goes to that token's ring entry. Three matmuls a chunk, all else done by `_prep_kernel`."""
    del o_in_ref, ring_in_ref   # aliased to o_ref and ring_ref
    r, h, jv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    count = count_ref[r]

    @pl.when(count > 0)     # decode and verify rows: nothing to read (in steps where the kernel runs for others)
    def _():
        _state_pass(r, h, jv, count, layer_ref, first_ref, slot_ref, start_ref, w_ref, qs_ref, kd_ref, u_ref, g_ref,
                    o_ref, ring_ref, window=window, chunk=chunk, block_v=block_v, precision=precision)


def _state_pass(r, h, jv, count, layer_ref, first_ref, slot_ref, start_ref, w_ref, qs_ref, kd_ref, u_ref, g_ref,
                o_ref, ring_ref, *, window, chunk, block_v, precision):
    layer, first, slot, p0 = layer_ref[0], first_ref[r], slot_ref[r], start_ref[r]
    cols = pl.ds(jv * block_v, block_v)
    before = ring_ref[layer, slot, jax.lax.rem(jnp.maximum(p0 - 1, 0), window), h, :, cols]     # [dk, BV]
    S = jnp.where(p0 > 0, before, jnp.zeros_like(before))
    dk, C = S.shape[0], chunk
    dot = functools.partial(_dot, precision=precision)
    t = jax.lax.broadcasted_iota(jnp.int32, (C,), 0)

    def one_chunk(c, S):
        tokens = pl.ds(first + c * C, C)
        real = c * C + t < count
        rk, rv = jnp.broadcast_to(real[:, None], (C, dk)), jnp.broadcast_to(real[:, None], (C, block_v))
        w = plgpu.load(w_ref.at[tokens, h, :], mask=rk, other=0.0)
        qs = plgpu.load(qs_ref.at[tokens, h, :], mask=rk, other=0.0)
        kd = plgpu.load(kd_ref.at[tokens, h, :], mask=rk, other=0.0)
        u = plgpu.load(u_ref.at[tokens, h, cols], mask=rv, other=0.0) - dot(w, S)        # [C, BV]
        o = plgpu.load(o_ref.at[tokens, h, cols], mask=rv, other=0.0) + dot(qs, S)
        plgpu.store(o_ref.at[tokens, h, cols], o, mask=rv)
        G_end = jnp.sum(plgpu.load(g_ref.at[tokens, h], mask=real, other=0.0))
        return jnp.exp(G_end) * S + dot(kd, u, (0, 0))

    S = jax.lax.fori_loop(0, pl.cdiv(count, C), one_chunk, S)
    ring_ref[layer, slot, jax.lax.rem(p0 + count - 1, window), h, :, cols] = S


@functools.partial(jax.jit, static_argnames=("chunk", "block_v", "max_chunks", "num_warps", "ieee", "interpret"))
def delta_rule_chunked(q, k, v, beta, g, ring, layer, first, count, slot, start, o=None, *, chunk: int = CHUNK,
                       block_v: int = BLOCK_V, max_chunks: int | None = None, num_warps: tuple = (4, 4),
                       ieee: bool = False, interpret: bool | None = None):
    """The gated delta rule over each row's first `count` tokens in chunks of `chunk`: the arguments of
    `delta_rule_recurrent`, and the same start (ring entry start-1 of the row's slot, zeros at position 0); the
    outputs of those tokens, and the state after the last of them written to ring entry (start+count-1) % W
    (rows with count 0 write nothing). o: outputs of other tokens, kept (None: zeros). -> (o, ring).

    Two kernels: `_prep_kernel`, parallel over all the rows' chunks and heads (the chunks' matmuls, (I + A)^-1
    among them), then `_state_kernel`, sequential over each row's chunks (three matmuls a chunk). Chunks start
    at each row's first token (a row's last one may be partial); `max_chunks` (static) bounds their number
    over all rows, by default ceil(T / chunk) + R, which always holds. num_warps: (prep, state) on the GPU.

    On the GPU each f32 matmul is three TF32 products on the tensor cores (f32 to ~1e-6); ieee=True makes them
    f32 FMAs instead, which Triton unrolls: measured on the H100, minutes to compile. Interpreted: f32."""
    interpret = interpreted(interpret)
    T, Hv, dv = v.shape
    dk, R, C = q.shape[2], first.shape[0], chunk
    bv = min(block_v, dv)
    if dv % bv:
        raise ValueError(f"block_v={bv} must divide the value width {dv}")
    precision = (jax.lax.Precision.HIGHEST if interpret or ieee
                 else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    i32 = lambda x: jnp.asarray(x, jnp.int32)   # noqa: E731
    first, count = i32(first), jnp.maximum(i32(count), 0)
    # The chunk table: chunk j is chunk c of row `row`, from token first[row] + c*C, of `length` tokens (0: unused).
    NC = max_chunks or -(-T // C) + R
    per_row = -(-count // C)
    ends = jnp.cumsum(per_row)
    j = jnp.arange(NC, dtype=jnp.int32)
    row = jnp.sum(j[:, None] >= ends[None, :], axis=1).astype(jnp.int32)                 # R: no row
    rc = jnp.minimum(row, R - 1)
    c = j - (ends - per_row)[rc]
    cfirst = first[rc] + c * C
    length = jnp.where(row < R, jnp.minimum(C, count[rc] - c * C), 0)
    f32 = lambda d: jax.ShapeDtypeStruct((T, Hv, d), jnp.float32)   # noqa: E731
    o = jnp.zeros((T, Hv, dv), jnp.float32) if o is None else o

    def params(warps):
        return {} if interpret else dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))

    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    prep_in = (cfirst, length, q, k, v, beta, g, o)
    w, qs, kd, u, o = pl.pallas_call(
        functools.partial(_prep_kernel, chunk=C, precision=precision),
        grid=(NC, Hv),
        in_specs=[whole(a.shape) for a in prep_in],
        out_specs=[whole((T, Hv, d)) for d in (dk, dk, dk, dv, dv)],
        out_shape=[f32(dk), f32(dk), f32(dk), f32(dv), f32(dv)],
        input_output_aliases={7: 4},
        interpret=interpret,
        name="delta_rule_chunk_prep",
        **params(num_warps[0]),
    )(*prep_in)
    state_in = (jnp.reshape(i32(layer), (1,)), first, count, i32(slot), i32(start), w, qs, kd, u, g, o, ring)
    return pl.pallas_call(
        functools.partial(_state_kernel, window=ring.shape[2], chunk=C, block_v=bv, precision=precision),
        grid=(R, Hv, dv // bv),
        in_specs=[whole(a.shape) for a in state_in],
        out_specs=[whole((T, Hv, dv)), whole(ring.shape)],
        out_shape=[f32(dv), jax.ShapeDtypeStruct(ring.shape, ring.dtype)],
        input_output_aliases={10: 0, 11: 1},
        interpret=interpret,
        name="delta_rule_chunk_state",
        **params(num_warps[1]),
    )(*state_in)
