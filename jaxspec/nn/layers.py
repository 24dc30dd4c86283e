"""The layer library: each kind of decoder layer is one function plus the declaration of its weights and of the
state it keeps. The target's decoder, the draft model and the EAGLE heads are all built from these.

A layer kind's state is declared per layer; its axes say how the step treats it:
  - a field whose first axis is `kv_slots` is paged (the KV pool): the layer writes it in place at the
    batch's slot mapping; positions past the accepted drafts are overwritten by a later step;
  - a field whose first axis is `slots` is per request slot (a recurrent state): the layer reads the slot's
    state and returns its value after every token of the step (`slot_updates`, [T, ...]); the step then keeps,
    for each row, the value after the row's last accepted token (`Decoder.commit`). That is how a state that
    cannot be overwritten later is rolled back past rejected drafts.

`LAYER_KINDS` is the public table: a new kind registered there can be named in `ModelConfig.layer_types`,
with no edit to the decoder, the step or the engine.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxspec.nn.ops import ForwardBatch, Ops, apply_rope, rms_norm, rope_inv_freq
from jaxspec.nn.schema import Spec


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """What a layer's state is sized by: flat KV slots of the paged pool, request slots (+1 trash slot)."""
    num_kv_slots: int
    num_slots: int


class LayerKind(Protocol):
    name: str

    def params(self, c) -> dict[str, Spec]:
        """One layer's weights (the decoder stacks them per kind)."""

    def state(self, c, cache: CacheShape) -> dict[str, Spec]:
        """One layer's state (first axis `kv_slots`: paged; `slots`: per request slot)."""

    def __call__(self, c, ops: Ops, lp: dict, h, state: dict, i, batch: ForwardBatch):
        """h [T, D] -> (h [T, D], state, slot_updates {field: [T, ...]}). `lp`: this layer's weights; `state`:
        every layer of this kind's state ([n, ...] per field), `i` this layer's index among them."""


# ---- blocks shared by every layer kind and the EAGLE heads -------------------------------------------------

def attention_params(c, in_dim: int | None = None) -> dict[str, Spec]:
    """q/k/v as one grouped matrix: for each kv head, its G query heads, then its k and v head (rows of hd),
    so one matmul reads them and a split by kv head keeps each group whole. `in_dim`: the attention input's
    width (2D for EAGLE-3's midlayer)."""
    D, hd, Hq, Hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    qkv_rows = Hkv * (Hq // Hkv + 2) * hd
    p = {"attn_norm": Spec((D,), ("embed",), "ones"),
         "qkv_proj": Spec((qkv_rows, in_dim or D), ("kv_heads", "embed")),
         "o_proj": Spec((D, Hq * hd), ("embed", "heads"))}
    if c.qkv_bias:
        p["qkv_bias"] = Spec((qkv_rows,), ("kv_heads",), "zeros")
    if c.qk_norm:
        p["q_norm"] = Spec((hd,), ("head_dim",), "ones")
        p["k_norm"] = Spec((hd,), ("head_dim",), "ones")
    return p


def mlp_params(c) -> dict[str, Spec]:
    """gate and up interleaved per MLP unit ([F, 2, D]): one matmul, and a split of F keeps pairs together."""
    D, F = c.hidden_size, c.intermediate_size
    return {"mlp_norm": Spec((D,), ("embed",), "ones"),
            "gate_up_proj": Spec((F, 2, D), ("mlp", None, "embed")),
            "down_proj": Spec((D, F), ("embed", "mlp"))}


def kv_state(c, cache: CacheShape) -> dict[str, Spec]:
    pool = Spec((cache.num_kv_slots, c.num_kv_heads, c.head_dim), ("kv_slots", "kv_heads", "head_dim"), "zeros")
    return {"k": pool, "v": pool}


def project_qkv(c, lp, x, positions):
    """x [T, Din] (already normed) -> q [T, Hq, hd], k and v [T, Hkv, hd], q and k rotated to `positions`."""
    T, hd, Hq, Hkv = x.shape[0], c.head_dim, c.num_heads, c.num_kv_heads
    G = Hq // Hkv
    qkv = x @ lp["qkv_proj"].T                                                    # [T, Hkv*(G+2)*hd]
    if "qkv_bias" in lp:
        qkv = qkv + lp["qkv_bias"]
    qkv = qkv.reshape(T, Hkv, G + 2, hd)
    q, k, v = qkv[:, :, :G].reshape(T, Hq, hd), qkv[:, :, G], qkv[:, :, G + 1]   # [T, Hq, hd], [T, Hkv, hd] x2
    if "q_norm" in lp:
        q, k = rms_norm(q, lp["q_norm"], c.rms_norm_eps), rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    inv_freq = rope_inv_freq(c)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def attention(c, ops: Ops, lp, x, kv: dict, i, batch: ForwardBatch):
    """x [T, Din] (already normed) -> (attention output after o_proj [T, D], kv with this step's k/v written
    into layer i of the pools)."""
    q, k, v = project_qkv(c, lp, x, batch.positions)
    kv = write_kv(kv, i, batch, k, v)
    out = ops.attend(q, kv["k"], kv["v"], i, batch)                               # [T, Hq*hd]
    return out.astype(x.dtype) @ lp["o_proj"].T, kv


def write_kv(kv: dict, i, batch: ForwardBatch, k, v) -> dict:
    """The pools with this step's k/v [T, Hkv, hd] written into layer i at the batch's slot mapping (slots past
    the pool, padding, write nothing)."""
    return {**kv, "k": kv["k"].at[i, batch.slot_mapping].set(k.astype(kv["k"].dtype), mode="drop"),
            "v": kv["v"].at[i, batch.slot_mapping].set(v.astype(kv["v"].dtype), mode="drop")}


def mlp(c, lp, h):
    """h + down(silu(gate) * up) of the normed h [T, D]."""
    x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
    w = lp["gate_up_proj"]                                                        # [F, 2, D]
    gate_up = (x @ w.reshape(-1, w.shape[-1]).T).reshape(x.shape[0], w.shape[0], 2)  # [T, F, 2]
    return h + (jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1]) @ lp["down_proj"].T


# ---- layer kinds -------------------------------------------------------------------------------------------

class Attention:
    """The Llama / Qwen2 / Qwen3 decoder layer: RMSNorm -> grouped-query attention over the paged KV -> residual
    -> RMSNorm -> SwiGLU MLP -> residual."""
    name = "attention"

    def params(self, c):
        return {**attention_params(c), **mlp_params(c)}

    def state(self, c, cache):
        return kv_state(c, cache)

    def __call__(self, c, ops, lp, h, state, i, batch):
        attn, state = attention(c, ops, lp, rms_norm(h, lp["attn_norm"], c.rms_norm_eps), state, i, batch)
        return mlp(c, lp, h + attn), state, {}


# ---- hybrids: Qwen3-Next and Qwen3.5 (Gated DeltaNet + gated full attention, dense MLP or MoE) ---------------

def ffn_params(c) -> dict[str, Spec]:
    """The feed-forward half of a hybrid layer: the dense SwiGLU MLP, or the mixture of experts."""
    return moe_params(c) if c.moe else mlp_params(c)


def ffn(c, lp, h):
    return moe(c, lp, h) if c.moe else mlp(c, lp, h)


def moe_params(c) -> dict[str, Spec]:
    """Top-k routed experts (gate/up [E, D, F, 2], down [E, F, D]: the layouts a grouped matmul reads) and a
    shared expert whose output a sigmoid gate scales."""
    D, E, F, Fs = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    p = {"mlp_norm": Spec((D,), ("embed",), "ones"),
         "router": Spec((E, D), (None, "embed")),
         "experts_gate_up": Spec((E, D, F, 2), (None, "embed", "mlp", None)),
         "experts_down": Spec((E, F, D), (None, "mlp", "embed"))}
    if Fs:
        p.update({"shared_gate_up": Spec((Fs, 2, D), ("mlp", None, "embed")),
                  "shared_down": Spec((D, Fs), ("embed", "mlp")),
                  "shared_gate": Spec((1, D), (None, "embed"))})
    return p


def moe(c, lp, h):
    """h + MoE(normed h): softmax router, top-k experts per token (weights renormalised when norm_topk_prob),
    each token's k (token, expert) pairs sorted by expert and run as one grouped matmul (`jax.lax.ragged_dot`),
    no per-expert loop; plus sigmoid(shared_gate . x) * shared expert."""
    T, D = h.shape
    E, k = c.num_experts, c.num_experts_per_tok
    x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
    probs = jax.nn.softmax((x @ lp["router"].T).astype(jnp.float32), axis=-1)          # [T, E]
    top_w, top_e = jax.lax.top_k(probs, k)                                              # [T, k]
    if c.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)                                            # pairs grouped by expert
    token = order // k
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    wgu = lp["experts_gate_up"]                                                         # [E, D, F, 2]
    gu = jax.lax.ragged_dot(x[token], wgu.reshape(E, D, -1), group_sizes)              # [T*k, F*2]
    gu = gu.reshape(T * k, -1, 2)
    act = jax.nn.silu(gu[..., 0]) * gu[..., 1]                                          # [T*k, F]
    out = jax.lax.ragged_dot(act.astype(x.dtype), lp["experts_down"], group_sizes)      # [T*k, D]
    out = out * top_w.reshape(-1)[order][:, None].astype(out.dtype)
    y = jnp.zeros((T, D), out.dtype).at[token].add(out)
    if "shared_gate_up" in lp:
        w = lp["shared_gate_up"]
        sgu = (x @ w.reshape(-1, D).T).reshape(T, w.shape[0], 2)
        shared = (jax.nn.silu(sgu[..., 0]) * sgu[..., 1]) @ lp["shared_down"].T
        y = y + jax.nn.sigmoid(x @ lp["shared_gate"].T) * shared
    return h + y.astype(h.dtype)


def partial_rope(x, positions, c):
    """Rotary embedding on the first `c.rotary_dim` dims of each head (rotate-half layout), the rest kept."""
    rd = c.rotary_dim
    inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, rd, 2, dtype=jnp.float32) / rd))
    return jnp.concatenate([apply_rope(x[..., :rd], positions, inv_freq), x[..., rd:]], axis=-1)


class GatedAttention:
    """Qwen3-Next / Qwen3.5 full attention: q_proj gives [q | gate] per head, RMSNorm over each head's q and k,
    rotary on a part of each head, output * sigmoid(gate) before o_proj; then the dense MLP or the MoE.
    q/gate/k/v are one grouped matrix: per kv head, its G q heads, its G gate heads, its k and v head."""
    name = "gated_attention"

    def params(self, c):
        D, hd, Hq, Hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        rows = Hkv * (2 * (Hq // Hkv) + 2) * hd
        return {"attn_norm": Spec((D,), ("embed",), "ones"),
                "qkv_proj": Spec((rows, D), ("kv_heads", "embed")),
                "q_norm": Spec((hd,), ("head_dim",), "ones"), "k_norm": Spec((hd,), ("head_dim",), "ones"),
                "o_proj": Spec((D, Hq * hd), ("embed", "heads")), **ffn_params(c)}

    def state(self, c, cache):
        return kv_state(c, cache)

    def __call__(self, c, ops, lp, h, state, i, batch):
        T, hd, Hq, Hkv = h.shape[0], c.head_dim, c.num_heads, c.num_kv_heads
        G = Hq // Hkv
        x = rms_norm(h, lp["attn_norm"], c.rms_norm_eps)
        qkv = (x @ lp["qkv_proj"].T).reshape(T, Hkv, 2 * G + 2, hd)
        q, gate = qkv[:, :, :G].reshape(T, Hq, hd), qkv[:, :, G:2 * G].reshape(T, Hq * hd)
        k, v = qkv[:, :, 2 * G], qkv[:, :, 2 * G + 1]
        q, k = rms_norm(q, lp["q_norm"], c.rms_norm_eps), rms_norm(k, lp["k_norm"], c.rms_norm_eps)
        q, k = partial_rope(q, batch.positions, c), partial_rope(k, batch.positions, c)
        state = write_kv(state, i, batch, k, v)
        out = ops.attend(q, state["k"], state["v"], i, batch).astype(h.dtype)          # [T, Hq*hd]
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(h.dtype)
        h = h + out @ lp["o_proj"].T
        return ffn(c, lp, h), state, {}


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

    Per-slot state: `conv` [slots, K-1, C], the row's last K-1 conv inputs; `ssm` [slots, Hv, dk, dv] fp32. Both
    are returned after every token (`slot_updates`), so the step keeps them at each row's last accepted token.
    The recurrence is a plain scan over the step's tokens that restarts at each row's first token (from the
    slot's state, or zeros at position 0): the reference form, exact for prefill chunks, decode and verify.
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
        return {"conv": Spec((cache.num_slots, c.linear_conv_kernel_dim - 1, C), ("slots", None, None), "zeros"),
                "ssm": Spec((cache.num_slots, Hv, dk, dv), ("slots", None, None, None), "zeros", jnp.float32)}

    def __call__(self, c, ops, lp, h, state, i, batch):
        T = h.shape[0]
        Hk, Hv, dk, dv, C = self.dims(c)
        K = c.linear_conv_kernel_dim
        x = rms_norm(h, lp["attn_norm"], c.rms_norm_eps)
        proj = x @ lp["in_proj"].T
        qkv, z, b, a = jnp.split(proj, [C, C + Hv * dv, C + Hv * dv + Hv], axis=-1)
        # The causal conv: token t's window is its row's last K inputs; those before the row's first token
        # come from the slot's window (zeros at position 0).
        row = batch.row_of_token
        first = batch.first_token_of_row[row]                                           # [T]
        d = jnp.arange(T, dtype=jnp.int32) - first                                      # index in its row
        start = segment_start_state(state["conv"][i], batch, T)                         # [T, K-1, C]
        cols = []
        for lag in range(K - 1, 0, -1):
            inside = (d >= lag)[:, None]
            from_step = qkv[jnp.clip(jnp.arange(T) - lag, 0, T - 1)]
            from_slot = jnp.take_along_axis(start, jnp.clip(K - 1 - lag + d, 0, K - 2)[:, None, None], axis=1)[:, 0]
            cols.append(jnp.where(inside, from_step, from_slot.astype(qkv.dtype)))
        window = jnp.stack(cols + [qkv], axis=1)                                        # [T, K, C]
        conv = jnp.einsum("tkc,kc->tc", window.astype(jnp.float32), lp["conv_weight"].astype(jnp.float32))
        conv = jax.nn.silu(conv)
        q, k, v = jnp.split(conv, [Hk * dk, 2 * Hk * dk], axis=-1)
        q = l2_normalize(q.reshape(T, Hk, dk)) * dk ** -0.5
        k = l2_normalize(k.reshape(T, Hk, dk))
        q, k = jnp.repeat(q, Hv // Hk, axis=1), jnp.repeat(k, Hv // Hk, axis=1)        # [T, Hv, dk]
        v = v.reshape(T, Hv, dv)
        beta = jax.nn.sigmoid(b.astype(jnp.float32))                                    # [T, Hv]
        g = -jnp.exp(lp["A_log"].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + lp["dt_bias"].astype(jnp.float32))
        ssm = state["ssm"][i]                                                           # [slots, Hv, dk, dv]
        slot_t = batch.slot_of_row[row]
        fresh = batch.positions[first] == 0

        def token(S, xs):
            q_t, k_t, v_t, beta_t, g_t, restart, fresh_t, slot = xs
            S = jnp.where(restart, jnp.where(fresh_t, 0.0, ssm[slot]), S)
            S = S * jnp.exp(g_t)[:, None, None]
            delta = (v_t - jnp.einsum("hkv,hk->hv", S, k_t)) * beta_t[:, None]
            S = S + k_t[:, :, None] * delta[:, None, :]
            return S, (jnp.einsum("hkv,hk->hv", S, q_t), S)

        _, (o, S_all) = jax.lax.scan(token, jnp.zeros((Hv, dk, dv), jnp.float32),
                                     (q, k, v, beta, g, d == 0, fresh, slot_t))
        o = rms_norm(o, lp["gdn_norm"].astype(jnp.float32), c.rms_norm_eps)            # [T, Hv, dv]
        o = o * jax.nn.silu(z.reshape(T, Hv, dv).astype(jnp.float32))
        h = h + o.reshape(T, Hv * dv).astype(h.dtype) @ lp["out_proj"].T
        updates = {"conv": window[:, 1:].astype(state["conv"].dtype), "ssm": S_all}
        return ffn(c, lp, h), state, updates


LAYER_KINDS: dict[str, LayerKind] = {"attention": Attention(), "gated_attention": GatedAttention(),
                                     "gated_deltanet": GatedDeltaNet()}


def per_slot_fields(state_specs: dict[str, Spec]) -> list[str]:
    """The fields of a layer kind's state that are kept per request slot (committed after acceptance)."""
    return [name for name, spec in state_specs.items() if spec.axes[0] == "slots"]


def segment_start_state(state, batch: ForwardBatch, T: int):
    """For a per-slot state [slots+1, ...]: each token's row's state at the start of this step, [T, ...]; zeros
    for rows that start their sequence (position 0: a new or re-prefilled request)."""
    row = batch.row_of_token
    prev = state[batch.slot_of_row[row]]                                          # [T, ...]
    fresh = batch.positions[batch.first_token_of_row[row]] == 0                   # [T]
    return jnp.where(fresh.reshape((T,) + (1,) * (prev.ndim - 1)), jnp.zeros_like(prev), prev)
