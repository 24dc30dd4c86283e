"""The layer library: each kind of decoder layer is one function plus the declaration of its weights and of the
state it keeps. The target's decoder, the draft model and the EAGLE / MTP heads are all built from these.

A layer kind's state is declared per layer; its axes say how the step treats it:
  - a field whose first axis is `kv_slots` is paged (the KV pool): the layer writes it in place at the
    batch's slot mapping; positions past the accepted drafts are overwritten by a later step;
  - a field whose first axis is `slots` is per request slot (a recurrent state), kept as a ring by position:
    entry p % size holds what the slot had after position p (`write_ring`, for the last `size` positions of
    each row), and a row starting at position p0 reads entry (p0 - 1) % size (`read_ring`). The start
    comes from the device's own count (its last accepted token), so the entry read is the state after the
    accepted tokens, whichever of the step's last k+1 positions that was: a state that cannot be overwritten
    later, as KV is, is rolled back past rejected drafts by reading an earlier entry. A state is `snapshots`
    = k+1 entries (`CacheShape.snapshots`); a window of the last K inputs, K-1+k.

`LAYER_KINDS` is the public table: a new kind registered there can be named in `ModelConfig.layer_types`,
with no edit to the decoder, the step or the engine.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jaxspec.nn import kernels
from jaxspec.nn.kernels import LayerWeights
from jaxspec.nn.ops import (ForwardBatch, Ops, apply_rope, rms_norm, rope_attention_scale, rope_cos_sin,
                            rope_inv_freq)
from jaxspec.nn.schema import Spec


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """What a layer's state is sized by: flat KV slots of the paged pool, request slots (+1 trash slot), and
    the drafts a step verifies at most (k: a per-slot state keeps the value after each of the last k+1
    positions, any of which the next step may start after)."""
    num_kv_slots: int
    num_slots: int
    num_speculative_tokens: int = 0

    @property
    def snapshots(self) -> int:
        return self.num_speculative_tokens + 1


class LayerKind(Protocol):
    name: str

    def params(self, c) -> dict[str, Spec]:
        """One layer's weights (the decoder stacks them per kind)."""

    def state(self, c, cache: CacheShape) -> dict[str, Spec]:
        """One layer's state (first axis `kv_slots`: paged; `slots`: per request slot)."""

    def __call__(self, c, ops: Ops, lp: dict, h, state: dict, i, batch: ForwardBatch):
        """h [T, D] -> (h [T, D], state with this step's KV and per-slot entries written). `lp`: this layer's
        weights; `state`: every layer of this kind's state ([n, ...] per field), `i` this layer's index among
        them."""


# ---- per-slot state kept as a ring by position -------------------------------------------------------------

def snapshot_spec(cache: CacheShape, shape: tuple, axes: tuple, dtype=None) -> Spec:
    """A per-slot state of `shape`, kept after each of the slot's last k+1 positions: [slots, k+1, *shape]."""
    return Spec((cache.num_slots, cache.snapshots, *shape), ("slots", None, *axes), "zeros", dtype)


def ring_writers(batch: ForwardBatch, size: int):
    """bool[T]: the tokens that write their ring entry, those that extend their sequence (`writes_state`)
    among the last `size` positions of their row. Earlier ones would be overwritten in the same step: one
    write per entry, so the scatter has no duplicate index."""
    written = jnp.ones_like(batch.positions, bool) if batch.writes_state is None else batch.writes_state
    num_rows = batch.block_tables.shape[0]
    last = jax.ops.segment_max(jnp.where(written, batch.positions, -1), batch.row_of_token, num_segments=num_rows)
    return written & (batch.positions > last[batch.row_of_token] - size)


def write_ring(ring, i, batch: ForwardBatch, values):
    """ring [n, slots, size, ...] with layer i's entries at each writing token's (slot, position % size) set to
    its value [T, ...]; the other tokens write nothing (an out-of-range slot, dropped)."""
    size, nowhere = ring.shape[2], ring.shape[1]
    slot = jnp.where(ring_writers(batch, size), batch.slot_of_row[batch.row_of_token], nowhere)
    return ring.at[i, slot, batch.positions % size].set(values.astype(ring.dtype), mode="drop")


def read_ring(ring, i, slot, position):
    """Layer i's entries at (slot, position % size) [..., *entry]; zeros for positions < 0 (before a sequence's
    first token). `slot` and `position` broadcast together."""
    entry = ring[i, slot, position % ring.shape[2]]
    before_start = (position < 0).reshape(position.shape + (1,) * (entry.ndim - position.ndim))
    return jnp.where(before_start, jnp.zeros_like(entry), entry)


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


def project_qkv(c, ops: Ops, lp, x, positions):
    """x [T, Din] (already normed) -> q [T, Hq, hd], k and v [T, Hkv, hd], q and k rotated to `positions`."""
    return split_qkv(c, lp, ops.linear(x, lp, "qkv_proj"), positions)


def split_qkv(c, lp, qkv, positions, inv_freq=None):
    """The q/k/v projection qkv [T, Hkv*(G+2)*hd] -> q [T, Hq, hd], k and v [T, Hkv, hd], q and k rotated (by
    `inv_freq`, the layer's rotary frequencies; None: the model's)."""
    T, hd, Hq, Hkv = qkv.shape[0], c.head_dim, c.num_heads, c.num_kv_heads
    G = Hq // Hkv
    if "qkv_bias" in lp:
        qkv = qkv + lp["qkv_bias"]
    qkv = qkv.reshape(T, Hkv, G + 2, hd)
    q, k, v = qkv[:, :, :G].reshape(T, Hq, hd), qkv[:, :, G], qkv[:, :, G + 1]   # [T, Hq, hd], [T, Hkv, hd] x2
    if "q_norm" in lp:
        q, k = rms_norm(q, lp["q_norm"], c.rms_norm_eps), rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    inv_freq, scale = rope_inv_freq(c) if inv_freq is None else inv_freq, rope_attention_scale(c)
    return apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale), v


def attention(c, ops: Ops, lp, x, kv: dict, i, batch: ForwardBatch):
    """x [T, Din] (already normed) -> (attention output after o_proj [T, D], kv with this step's k/v written
    into layer i of the pools)."""
    out, kv = attend_qkv(c, ops, lp, ops.linear(x, lp, "qkv_proj"), kv, i, batch)   # [T, Hq*hd]
    return ops.linear(out.astype(x.dtype), lp, "o_proj"), kv


def attend_qkv(c, ops: Ops, lp, qkv, kv: dict, i, batch: ForwardBatch, inv_freq=None):
    """The q/k/v projection qkv [T, Hkv*(G+2)*hd] -> (attention output [T, Hq*hd] before o_proj, kv with this
    step's k/v written into layer i): bias, q/k norms and rotary (`inv_freq`: the layer's frequencies; None: the
    model's), the KV write and the attention, in one kernel where `ops.fuses_kv_write`
    (jaxspec.pallas.paged_attention), else as separate operations. A layer with attention sinks (`sinks` [Hq]
    among its weights: GPT-OSS) gives them to the attention."""
    inv_freq = rope_inv_freq(c) if inv_freq is None else inv_freq
    sinks = lp.get("sinks")
    if ops.fuses_kv_write(batch):
        cos, sin = rope_cos_sin(batch.positions, inv_freq, rope_attention_scale(c))        # [T, hd/2]
        out, k_pool, v_pool = kernels.fused_attention_fn(c, lp, qkv, cos, sin, kv["k"], kv["v"], i, batch,
                                                         ops.block_size, window=layer_window(c, i), sinks=sinks)
        return out, {**kv, "k": k_pool, "v": v_pool}
    q, k, v = split_qkv(c, lp, qkv, batch.positions, inv_freq)
    kv = write_kv(kv, i, batch, k, v)
    return ops.attend(q, kv["k"], kv["v"], i, batch, window=layer_window(c, i), sinks=sinks), kv


# A window no position is that far from: a layer without one, where layers with and without share one program.
NO_WINDOW = 1 << 30


def layer_window(c, i):
    """Layer i's sliding window: None (the whole context, every layer), the window (a Python int: every layer
    has it, or i is static: unrolled layers), or an i32 scalar picked from the layers' windows (scanned layers)."""
    if c.sliding_window is None:
        return None
    if c.sliding_layers is None:
        return c.sliding_window
    if isinstance(i, int):
        return c.layer_window(i)
    return jnp.asarray([c.sliding_window if s else NO_WINDOW for s in c.sliding_layers], jnp.int32)[i]


def write_kv(kv: dict, i, batch: ForwardBatch, k, v) -> dict:
    """The pools with this step's k/v [T, Hkv, hd] written into layer i at the batch's slot mapping (slots past
    the pool, padding, write nothing)."""
    return {**kv, "k": kv["k"].at[i, batch.slot_mapping].set(k.astype(kv["k"].dtype), mode="drop"),
            "v": kv["v"].at[i, batch.slot_mapping].set(v.astype(kv["v"].dtype), mode="drop")}


def mlp(c, ops: Ops, lp, h):
    """h + down(silu(gate) * up) of the normed h [T, D]."""
    act = ops.linear(h, lp, "gate_up_proj", norm="mlp_norm", eps=c.rms_norm_eps)      # [T, F]
    return ops.linear(act, lp, "down_proj", residual=h)


# ---- layer kinds -------------------------------------------------------------------------------------------

class Attention:
    """The Llama / Qwen2 / Qwen3 decoder layer: RMSNorm -> grouped-query attention over the paged KV -> residual
    -> RMSNorm -> SwiGLU MLP -> residual. Each norm, SwiGLU and residual add is an argument of the projection next
    to it (`Ops.linear`), so that a kernel that runs the projection can hold it too."""
    name = "attention"

    def params(self, c):
        return {**attention_params(c), **mlp_params(c)}

    def state(self, c, cache):
        return kv_state(c, cache)

    def __call__(self, c, ops, lp, h, state, i, batch):
        qkv = ops.linear(h, lp, "qkv_proj", norm="attn_norm", eps=c.rms_norm_eps)      # [T, Hkv*(G+2)*hd]
        out, state = attend_qkv(c, ops, lp, qkv, state, i, batch)                         # [T, Hq*hd]
        h = ops.linear(out.astype(h.dtype), lp, "o_proj", residual=h)                     # h + attention
        return mlp(c, ops, lp, h), state


class AttentionMoE(Attention):
    """Qwen3-MoE's sparse layer: the Attention layer's attention, then the mixture of experts (`moe`: softmax router,
    top-k experts, no shared expert) where the dense MLP was."""
    name = "attention_moe"

    def params(self, c):
        return {**attention_params(c), **moe_params(c)}

    def __call__(self, c, ops, lp, h, state, i, batch):
        qkv = ops.linear(h, lp, "qkv_proj", norm="attn_norm", eps=c.rms_norm_eps)
        out, state = attend_qkv(c, ops, lp, qkv, state, i, batch)
        h = ops.linear(out.astype(h.dtype), lp, "o_proj", residual=h)
        return moe(c, ops, lp, h, batch.writes_state), state


# ---- Gemma 3: four norms a layer, local and global attention --------------------------------------------------

# Gemma 3's norms, declared float32: they hold 1 + w (ModelConfig.plus_one_norms), as its RMSNorm computes in float32.
GEMMA3_NORMS = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


def layer_inv_freq(c, i):
    """Layer i's rotary frequencies [hd/2]: the local ones (`local_rope_theta`) where `local_rope_layers` marks it,
    else the model's; picked by index when i is traced (scanned layers), as `layer_window` picks the window."""
    if c.local_rope_layers is None:
        return rope_inv_freq(c)
    if isinstance(i, int):
        return rope_inv_freq(c, local=c.local_rope_layers[i])
    return jnp.where(jnp.asarray(c.local_rope_layers)[i], rope_inv_freq(c, local=True), rope_inv_freq(c))


def with_query_scale(c, lp):
    """lp with q_norm times sqrt(head_dim / query_pre_attn_scalar): every attention path (the Pallas kernels too)
    scales scores by head_dim ** -0.5, and q's norm is q's last scaling before them (rotary is linear), so the
    scores come out scaled by query_pre_attn_scalar ** -0.5. Unchanged where the two are equal (Gemma 3 4B/12B)."""
    if not c.query_pre_attn_scalar or c.query_pre_attn_scalar == c.head_dim:
        return lp
    factor = (c.head_dim / c.query_pre_attn_scalar) ** 0.5
    if isinstance(lp, LayerWeights):   # the kernels read the whole stack
        return lp.replacing({"q_norm": lp.stacks["q_norm"] * factor})
    return {**lp, "q_norm": lp["q_norm"] * factor}


class Gemma3Attention:
    """Gemma 3's decoder layer, local (a sliding window, the local rotary base) or global (the whole context, the
    global base with its scaling) as the config marks layer i:

        h = h + post_attn_norm(o_proj(attention(attn_norm(h))))         q and k RMSNormed per head
        h = h + post_mlp_norm(down(gelu_tanh(gate) * up of mlp_norm(h)))

    Every RMSNorm scales by (1 + w) in float32 (its weights hold 1 + w, float32); scores are scaled by
    query_pre_attn_scalar ** -0.5. The input norms ride on the projections after them (`Ops.linear`), as the
    Attention layer's; the post norms stand between a projection and its residual, so those adds are apart."""
    name = "gemma3_attention"

    def params(self, c):
        D = c.hidden_size
        p = {**attention_params(c), **mlp_params(c),
             "post_attn_norm": Spec((D,), ("embed",), "ones"), "post_mlp_norm": Spec((D,), ("embed",), "ones")}
        return {name: dataclasses.replace(spec, dtype=jnp.float32) if name in GEMMA3_NORMS else spec
                for name, spec in p.items()}

    def state(self, c, cache):
        return kv_state(c, cache)

    def __call__(self, c, ops, lp, h, state, i, batch):
        lp = with_query_scale(c, lp)
        qkv = ops.linear(h, lp, "qkv_proj", norm="attn_norm", eps=c.rms_norm_eps)
        out, state = attend_qkv(c, ops, lp, qkv, state, i, batch, inv_freq=layer_inv_freq(c, i))
        attn = ops.linear(out.astype(h.dtype), lp, "o_proj")
        h = h + rms_norm(attn, lp["post_attn_norm"], c.rms_norm_eps)
        act = ops.linear(h, lp, "gate_up_proj", norm="mlp_norm", eps=c.rms_norm_eps, activation=c.hidden_act)
        return h + rms_norm(ops.linear(act, lp, "down_proj"), lp["post_mlp_norm"], c.rms_norm_eps), state


# ---- GPT-OSS: attention with sinks and biases, experts with biases and a clamped SwiGLU -----------------------

def gpt_oss_moe_params(c) -> dict[str, Spec]:
    """The router (with a bias) and the experts as the checkpoint lays them out, which is the grouped matmul's
    [E, K, N]: gate/up [E, D, 2F] (gate and up columns interleaved, so a split of 2F keeps pairs together), down
    [E, F, D], each with a bias per expert."""
    D, E, F = c.hidden_size, c.num_experts, c.moe_intermediate_size
    return {"mlp_norm": Spec((D,), ("embed",), "ones"),
            "router": Spec((E, D), (None, "embed")), "router_bias": Spec((E,), (None,), "zeros"),
            "experts_gate_up_proj": Spec((E, D, 2 * F), (None, "embed", "mlp")),
            "experts_gate_up_bias": Spec((E, 2 * F), (None, "mlp"), "zeros"),
            "experts_down_proj": Spec((E, F, D), (None, "mlp", "embed")),
            "experts_down_bias": Spec((E, D), (None, "embed"), "zeros")}


def clamped_swiglu(gate_up, alpha: float, limit: float):
    """GPT-OSS's activation of interleaved gate/up columns [..., 2F] -> [..., F]: the gate clamped above at `limit`,
    up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def gpt_oss_moe(c, ops: Ops, lp, h, routed=None):
    """h + MoE(normed h), GPT-OSS's: the router's k largest logits per token (bias added), softmax over those k;
    each chosen expert's gate/up (+ bias), clamped SwiGLU, down (+ bias), weighted and summed per token. The pairs
    sorted by expert, one grouped matmul per projection (as `moe`); tokens not `routed` get h back."""
    x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
    logits = ops.linear(x, lp, "router").astype(jnp.float32) + lp["router_bias"].astype(jnp.float32)   # [T, E]
    top_logits, top_e = jax.lax.top_k(logits, c.num_experts_per_tok)                                 # [T, k]
    top_w = jax.nn.softmax(top_logits, axis=-1)
    routes = route_by_expert(top_e, c.num_experts, routed)
    gate_up = ops.linear(x[routes.token], lp, "experts_gate_up_proj", group_sizes=routes.group_sizes)
    gate_up = gate_up + lp["experts_gate_up_bias"][routes.expert].astype(gate_up.dtype)          # [T*k, 2F]
    act = clamped_swiglu(gate_up, c.swiglu_alpha, c.swiglu_limit).astype(x.dtype)
    out = ops.linear(act, lp, "experts_down_proj", group_sizes=routes.group_sizes)
    out = out + lp["experts_down_bias"][routes.expert].astype(out.dtype)                         # [T*k, D]
    return h + routes.combine(out, top_w).astype(h.dtype)


class GptOss:
    """GPT-OSS's decoder layer: RMSNorm -> grouped-query attention (q/k/v biases, YaRN rotary, the layer's sliding
    window if it has one, a learned sink logit per query head in the softmax) -> o_proj + bias -> residual ->
    RMSNorm -> GPT-OSS's mixture of experts (`gpt_oss_moe`) -> residual."""
    name = "gpt_oss"

    def params(self, c):
        p = {**attention_params(c), "sinks": Spec((c.num_heads,), ("heads",), "zeros"), **gpt_oss_moe_params(c)}
        if c.attention_bias:
            p["o_bias"] = Spec((c.hidden_size,), ("embed",), "zeros")
        return p

    def state(self, c, cache):
        return kv_state(c, cache)

    def __call__(self, c, ops, lp, h, state, i, batch):
        qkv = ops.linear(h, lp, "qkv_proj", norm="attn_norm", eps=c.rms_norm_eps)
        out, state = attend_qkv(c, ops, lp, qkv, state, i, batch)                  # the sinks: lp["sinks"]
        if "o_bias" in lp:
            h = h + lp["o_bias"].astype(h.dtype)
        h = ops.linear(out.astype(h.dtype), lp, "o_proj", residual=h)
        return gpt_oss_moe(c, ops, lp, h, batch.writes_state), state


# ---- hybrids: Qwen3-Next and Qwen3.5 (Gated DeltaNet + gated full attention, dense MLP or MoE) ---------------

def ffn_params(c) -> dict[str, Spec]:
    """The feed-forward half of a hybrid layer: the dense SwiGLU MLP, or the mixture of experts."""
    return moe_params(c) if c.moe else mlp_params(c)


def ffn(c, ops: Ops, lp, h, routed=None):
    return moe(c, ops, lp, h, routed) if c.moe else mlp(c, ops, lp, h)


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


def moe(c, ops: Ops, lp, h, routed=None):
    """h + MoE(normed h): softmax router, top-k experts per token (weights renormalised when norm_topk_prob),
    each token's k (token, expert) pairs sorted by expert and run as one grouped matmul (`Ops.linear` with the
    experts' group sizes), no per-expert loop; plus sigmoid(shared_gate . x) * shared expert. routed: bool[T], the
    tokens whose output is read (None: all); the others (a step's padding) are routed to no expert, so that
    they cost no expert's weights, and get h back."""
    x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
    probs = jax.nn.softmax(ops.linear(x, lp, "router").astype(jnp.float32), axis=-1)   # [T, E]
    top_w, top_e = jax.lax.top_k(probs, c.num_experts_per_tok)                          # [T, k]
    if c.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    routes = route_by_expert(top_e, c.num_experts, routed)
    act = ops.linear(x[routes.token], lp, "experts_gate_up", group_sizes=routes.group_sizes)   # [T*k, F]
    out = ops.linear(act.astype(x.dtype), lp, "experts_down", group_sizes=routes.group_sizes)  # [T*k, D]
    y = routes.combine(out, top_w)
    if "shared_gate_up" in lp:   # (the shared expert is dense: every token's row is computed anyway)
        shared = ops.linear(ops.linear(x, lp, "shared_gate_up"), lp, "shared_down")
        y = y + jax.nn.sigmoid(ops.linear(x, lp, "shared_gate")) * shared
    return h + y.astype(h.dtype)


class ExpertRoutes(NamedTuple):
    """Each token's k (token, expert) pairs sorted by expert, as the grouped matmul reads them: pair j belongs to
    token `token[j]` and expert `expert[j]`, and choice i of the flat [T*k] choices is at `position[i]` among the
    pairs; `group_sizes` [E] counts each expert's pairs. The pairs of tokens not routed come last, counted by no
    group (expert E): the grouped matmul leaves their rows unwritten and `combine` drops them."""
    position: jax.Array
    token: jax.Array
    expert: jax.Array
    group_sizes: jax.Array

    def combine(self, out, top_w):
        """The pairs' outputs [T*k, D] weighted by their routing weights top_w [T, k], summed per token in float32:
        [T, D]. A gather back to the choices' order, then a sum over each token's k (a scatter-add into the
        tokens would serialise on each token's k atomic adds, and add in no fixed order)."""
        T, k = top_w.shape
        routed = self.position < jnp.sum(self.group_sizes)                              # [T*k]: not sorted last
        # where, not a product: the rows of pairs not routed may hold NaN
        pairs = jnp.where(routed[:, None], out[self.position].astype(jnp.float32) * top_w.reshape(-1, 1), 0.0)
        return pairs.reshape(T, k, -1).sum(axis=1)


def route_by_expert(top_e, num_experts: int, routed=None) -> ExpertRoutes:
    """top_e i32[T, k] (each token's chosen experts) -> the pairs grouped by expert (a stable sort: no per-expert
    loop, one grouped matmul per projection). routed: bool[T] or None (all); the pairs of the other tokens go to
    expert `num_experts`, past every group."""
    k = top_e.shape[1]
    if routed is not None:
        top_e = jnp.where(routed[:, None], top_e, num_experts)
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                   unique_indices=True)
    return ExpertRoutes(position, order // k, flat_e[order],
                        jnp.bincount(flat_e, length=num_experts).astype(jnp.int32))


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
        qkv = ops.linear(h, lp, "qkv_proj", norm="attn_norm", eps=c.rms_norm_eps).reshape(T, Hkv, 2 * G + 2, hd)
        q, gate = qkv[:, :, :G].reshape(T, Hq, hd), qkv[:, :, G:2 * G].reshape(T, Hq * hd)
        k, v = qkv[:, :, 2 * G], qkv[:, :, 2 * G + 1]
        q, k = rms_norm(q, lp["q_norm"], c.rms_norm_eps), rms_norm(k, lp["k_norm"], c.rms_norm_eps)
        q, k = partial_rope(q, batch.positions, c), partial_rope(k, batch.positions, c)
        state = write_kv(state, i, batch, k, v)
        out = ops.attend(q, state["k"], state["v"], i, batch).astype(h.dtype)          # [T, Hq*hd]
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(h.dtype)
        h = ops.linear(out, lp, "o_proj", residual=h)
        return ffn(c, ops, lp, h, batch.writes_state), state


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

    Per-slot state, rings by position (see the module docstring): `conv` [slots, K-1+k, C], the slot's last
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


LAYER_KINDS: dict[str, LayerKind] = {"attention": Attention(), "attention_moe": AttentionMoE(),
                                     "gemma3_attention": Gemma3Attention(), "gpt_oss": GptOss(),
                                     "gated_attention": GatedAttention(), "gated_deltanet": GatedDeltaNet()}


def per_slot_fields(state_specs: dict[str, Spec]) -> list[str]:
    """The fields of a layer kind's state that are kept per request slot."""
    return [name for name, spec in state_specs.items() if spec.axes[0] == "slots"]
