"""The hybrids' (Qwen3-Next, Qwen3.5) linear-attention layer, Gated DeltaNet: a causal conv and the gated delta
rule, both keeping per-slot state as rings by position (jaxspec.nn.layers.base)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.nn import kernels
from jaxspec.nn.layers.base import read_ring, ring_writers, snapshot_spec, write_ring
from jaxspec.nn.layers.moe import ffn, ffn_params
from jaxspec.nn.ops import ForwardBatch, Ops, rms_norm
from jaxspec.nn.schema import Spec


def l2_normalize(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class GatedDeltaNet:
    """Qwen3-Next / Qwen3.5 linear attention (Gated DeltaNet), then the dense MLP or the MoE.

        [q | k | v], z, b, a = in_proj(norm(h))
        q, k, v  <- SiLU(causal depthwise conv over the last K inputs)          (the conv window: per slot)
        q, k     <- L2-normalised (q also scaled by dk^-1/2), repeated to the value heads
        beta = sigmoid(b);  a_t = exp(-exp(A_log) * softplus(a + dt_bias))
        S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T;   o_t = S_t q_t   (S: per slot, fp32)
        h += out_proj(RMSNorm(o) * silu(z))

    Per-slot state, rings by position (jaxspec.nn.layers.base): `conv` [slots, K-1+k, C], the slot's last
    K-1+k conv inputs, so that the K-1 before any of the step's last k+1 positions are there; `ssm` [slots,
    k+1, Hv, dk, dv] fp32, S after each of the slot's last k+1 positions. Per slot and layer that is (k+1)
    delta-rule states and K-1+k conv inputs, whatever the step's token count: a prefill chunk keeps only the
    states after its last k+1 positions (and the next step reads the last). The recurrence is a plain scan
    over the step's tokens that restarts at each row's first token from the entry its start selects (zeros at
    position 0), writing S into the ring in place: the reference form, exact for prefill chunks, decode and
    verify.
    """
    name = "gated_deltanet"

    @staticmethod
    def dims(c):
        Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        return Hk, Hv, dk, dv, 2 * Hk * dk + Hv * dv

    def params(self, c):
        D = c.hidden_size
        Hk, Hv, dk, dv, C = self.dims(c)
        return {"attn_norm": Spec((D,), ("embed",), "ones"),
                "in_proj": Spec((C + Hv * dv + 2 * Hv, D), (None, "embed")),       # [q | k | v | z | b | a]
                "conv_weight": Spec((c.linear_conv_kernel_dim, C), (None, None)),
                "dt_bias": Spec((Hv,), (None,), "ones"), "A_log": Spec((Hv,), (None,), "zeros"),
                "gdn_norm": Spec((dv,), (None,), "ones"),
                "out_proj": Spec((D, Hv * dv), ("embed", None)), **ffn_params(c)}

    def state(self, c, cache):
        Hk, Hv, dk, dv, C = self.dims(c)
        inputs = c.linear_conv_kernel_dim - 1 + cache.num_speculative_tokens
        return {"conv": Spec((cache.num_slots, inputs, C), ("slots", None, None), "zeros"),
                "ssm": snapshot_spec(cache, (Hv, dk, dv), (None, None, None), jnp.float32)}

    def __call__(self, c, ops, lp, h, state, i, batch):
        T = h.shape[0]
        Hk, Hv, dk, dv, C = self.dims(c)
        proj = ops.linear(h, lp, "in_proj", norm="attn_norm", eps=c.rms_norm_eps)
        qkv, z, b, a = jnp.split(proj, [C, C + Hv * dv, C + Hv * dv + Hv], axis=-1)
        window = conv_window(state["conv"], i, batch, qkv, c.linear_conv_kernel_dim)      # [T, K, C]
        conv = jnp.einsum("tkc,kc->tc", window.astype(jnp.float32), lp["conv_weight"].astype(jnp.float32))
        q, k, v = jnp.split(jax.nn.silu(conv), [Hk * dk, 2 * Hk * dk], axis=-1)
        q = l2_normalize(q.reshape(T, Hk, dk)) * dk ** -0.5
        k = l2_normalize(k.reshape(T, Hk, dk))
        q, k = jnp.repeat(q, Hv // Hk, axis=1), jnp.repeat(k, Hv // Hk, axis=1)        # [T, Hv, dk]
        beta = jax.nn.sigmoid(b.astype(jnp.float32))                                    # [T, Hv]
        g = -jnp.exp(lp["A_log"].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
        o, ssm = delta_rule(ops)(state["ssm"], i, batch, q, k, v.reshape(T, Hv, dv), beta, g)
        state = {**state, "conv": write_ring(state["conv"], i, batch, qkv), "ssm": ssm}
        o = rms_norm(o, lp["gdn_norm"].astype(jnp.float32), c.rms_norm_eps)            # [T, Hv, dv]
        o = o * jax.nn.silu(z.reshape(T, Hv, dv).astype(jnp.float32))
        h = ops.linear(o.reshape(T, Hv * dv).astype(h.dtype), lp, "out_proj", residual=h)
        return ffn(c, ops, lp, h, batch.writes_state), state


def conv_window(ring, i, batch: ForwardBatch, inputs, K: int):
    """The causal conv's window of each token [T, K, C]: its row's last K inputs up to it. Those at positions
    before the row's first token come from the slot's ring of inputs (layer i), zeros before position 0."""
    T = inputs.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    in_row = t - batch.first_token_of_row[batch.row_of_token]                           # index in its row
    slot = batch.slot_of_row[batch.row_of_token]
    cols = []
    for lag in range(K - 1, 0, -1):
        from_step = inputs[jnp.maximum(t - lag, 0)]
        from_ring = read_ring(ring, i, slot, batch.positions - lag).astype(inputs.dtype)
        cols.append(jnp.where((in_row >= lag)[:, None], from_step, from_ring))
    return jnp.stack(cols + [inputs], axis=1)


def delta_rule(ops: Ops):
    """The recurrence `ops` chose: the scan below (the reference) or the Pallas kernel, with one contract."""
    if ops.delta_rule == "pallas":
        return kernels.delta_rule_fn
    return delta_rule_scan


def delta_rule_scan(ring, i, batch: ForwardBatch, q, k, v, beta, g):
    """The gated delta rule over the step's tokens in order, one state per head [Hv, dk, dv] (fp32): a row's
    first token at position p0 starts from the slot's entry (p0 - 1) of layer i's ring (zeros at p0 = 0),
    and each writing token stores S after it at its own entry, in place. q, k [T, Hv, dk], v [T, Hv, dv],
    beta and the log decay g [T, Hv] -> (o [T, Hv, dv], ring)."""
    T, W = q.shape[0], ring.shape[2]
    row = batch.row_of_token
    restart = jnp.arange(T) == batch.first_token_of_row[row]
    slot = batch.slot_of_row[row]
    write_slot = jnp.where(ring_writers(batch, W), slot, ring.shape[1])                # out of range: no write

    def token(carry, xs):
        S, ring = carry
        q_t, k_t, v_t, beta_t, g_t, restart_t, slot_t, dst_t, pos_t = xs
        S = jnp.where(restart_t, read_ring(ring, i, slot_t, pos_t - 1), S)
        S = S * jnp.exp(g_t)[:, None, None]
        delta = (v_t - jnp.einsum("hkv,hk->hv", S, k_t)) * beta_t[:, None]
        S = S + k_t[:, :, None] * delta[:, None, :]
        ring = ring.at[i, dst_t, pos_t % W].set(S, mode="drop")
        return (S, ring), jnp.einsum("hkv,hk->hv", S, q_t)

    S0 = jnp.zeros(ring.shape[3:], jnp.float32)
    (_, ring), o = jax.lax.scan(token, (S0, ring), (q, k, v, beta, g, restart, slot, write_slot, batch.positions))
    return o, ring


def delta_rule_chunked(q, k, v, beta, g, state, chunk: int = 64):
    """The gated delta rule over one sequence in chunks of `chunk` tokens (the chunkwise-parallel, WY form):
    within a chunk everything is matmuls, only the state passes from chunk to chunk. The plain-JAX reference of
    `jaxspec.pallas.delta_rule.delta_rule_chunked`; exact (in real arithmetic) to `delta_rule_scan`.

    In a chunk of tokens 1..C starting from the state S0, with G_t = g_1 + .. + g_t and D[t, s] = exp(G_t - G_s)
    (s <= t, all <= 1 when g <= 0), unrolling S_t = exp(g_t) S_{t-1} + k_t u_t^T gives
        u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{s<t} D[t, s] (k_t . k_s) u_s),
    a unit lower-triangular system (I + A) U = diag(beta) V - diag(beta exp(G)) K S0, A[t, s] = beta_t D[t, s]
    k_t . k_s (s < t), solved here by substitution; then
        o_t = exp(G_t) S0^T q_t + sum_{s<=t} D[t, s] (q_t . k_s) u_s,   S_C = exp(G_C) S0 + K^T diag(D[C, :]) U.
    A last partial chunk is padded with tokens of k = q = v = beta = g = 0, which leave the state as it is.

    q, k [T, H, dk], v [T, H, dv], beta and the log decay g [T, H], state [H, dk, dv] (the state before the
    first token) -> (o [T, H, dv], the state after the last token [H, dk, dv]), all f32."""
    T, H, dk = q.shape
    n = -(-T // chunk)
    hi = jax.lax.Precision.HIGHEST

    def chunks(x):   # [T, H, ...] -> [n, H, C, ...], zero-padded
        x = jnp.pad(x.astype(jnp.float32), [(0, n * chunk - T)] + [(0, 0)] * (x.ndim - 1))
        return jnp.moveaxis(x.reshape(n, chunk, *x.shape[1:]), 1, 2)

    t = jnp.arange(chunk)
    causal, strict = t[:, None] >= t[None, :], t[:, None] > t[None, :]

    def one_chunk(S, xs):
        q, k, v, beta, g = xs                                                # [H, C, d] / [H, C]
        G = jnp.cumsum(g, axis=-1)                                           # [H, C]
        D = jnp.exp(jnp.where(causal, G[:, :, None] - G[:, None, :], -jnp.inf))   # [H, C, C]
        A = jnp.where(strict, beta[:, :, None] * D * jnp.einsum("htk,hsk->hts", k, k, precision=hi), 0.0)
        rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(G))[..., None] * k], axis=-1)
        eye = jnp.eye(chunk, dtype=jnp.float32)
        solved = jax.scipy.linalg.solve_triangular(eye + A, rhs, lower=True, unit_diagonal=True)
        u = solved[..., :v.shape[-1]] - jnp.einsum("htk,hkv->htv", solved[..., v.shape[-1]:], S, precision=hi)
        P = jnp.where(causal, D * jnp.einsum("htk,hsk->hts", q, k, precision=hi), 0.0)
        o = (jnp.einsum("htk,hkv->htv", jnp.exp(G)[..., None] * q, S, precision=hi)
             + jnp.einsum("hts,hsv->htv", P, u, precision=hi))
        to_end = jnp.exp(G[:, -1:] - G)                                      # [H, C] = D[C, :]
        S = (jnp.exp(G[:, -1])[:, None, None] * S
             + jnp.einsum("htk,htv->hkv", to_end[..., None] * k, u, precision=hi))
        return S, o

    S, o = jax.lax.scan(one_chunk, state.astype(jnp.float32), tuple(map(chunks, (q, k, v, beta, g))))
    o = jnp.moveaxis(o, 2, 1).reshape(n * chunk, H, -1)[:T]
    return o, S
