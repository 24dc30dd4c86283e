"""GPT-OSS's decoder layer: attention with sinks and biases, experts with biases and a clamped SwiGLU."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.nn.layers.attention import attend_qkv, attention_params, kv_state
from jaxspec.nn.layers.moe import route_by_expert
from jaxspec.nn.ops import Ops, rms_norm
from jaxspec.nn.schema import Spec


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
